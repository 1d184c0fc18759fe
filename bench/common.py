"""What the benchmark scripts share: loopback ports, waiting for a server, the real engine."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

TOP = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REAL_BACKEND = [sys.executable, os.path.join(TOP, "scripts", "real-backend")]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_port(port: int, proc, timeout: float = 60.0) -> None:
    """Until something accepts on the port (a benchmark may poll; a test may not)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server on {port} exited: {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise SystemExit(f"nothing listens on {port}")


def real_engine_ready() -> bool:
    """Is the real engine built? Says how to build it when not."""
    paths = json.loads(subprocess.run(REAL_BACKEND + ["paths"], capture_output=True,
                                      text=True).stdout)
    if paths["server_ready"] and paths["model_ready"]:
        return True
    print("real engine not built: scripts/real-backend build && scripts/real-backend model",
          file=sys.stderr)
    return False


def start_real_engine(parallel: int = 2) -> tuple[int, int]:
    """(port, pid) of a llama-server on a free loopback port, once its /health is 200."""
    port = free_port()
    pid = int(subprocess.run(REAL_BACKEND + ["start", "--port", str(port), "--parallel",
                                             str(parallel)],
                             capture_output=True, text=True, check=True).stdout)
    return port, pid


def stop_real_engine(pid: int) -> None:
    subprocess.run(REAL_BACKEND + ["stop", str(pid)], capture_output=True)


def streamed(port: int, request: bytes) -> tuple[float | None, float, bytes]:
    """Send a raw request on a new loopback connection and read the answer to its end: (seconds
    to the first streamed event -- None when none came --, seconds to the end, the bytes)."""
    start = time.perf_counter()
    sock = socket.create_connection(("127.0.0.1", port))
    try:
        sock.sendall(request)
        data, first = b"", None
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
            if first is None and b"data:" in data:
                first = time.perf_counter() - start
    finally:
        sock.close()
    return first, time.perf_counter() - start, data
