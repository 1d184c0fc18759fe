#!/usr/bin/env python3
"""What one `lanelock proxy` hop adds to the time to the first streamed byte (run by hand; not a
test).

    python bench/hop.py [--requests 60] [--processes 800] [--rounds 1]

Side by side in one run, on loopback against the stand-in engine (which streams at once; two
alike, one the proxy's, one for the others): the first byte direct, through nginx (Debian's, its config written to a temp dir; buffering off),
and through the proxy -- a request with no session header (named after its client process,
proxy/client_process.py) and one with X-Lanelock-Session. Each case twice: on the box as it is,
then with --processes extra idle processes of the client's user (spawned and killed here: a
desktop with a browser and an IDE has 500-1,500). Requests are interleaved, a new connection
each (the worst case for naming a client: nothing is kept between requests), and the proxy's CPU
time per request it served (user and system, all its threads). The proxy opens its next engine
connection as the last one closes (proxy/spare.py, kept 2 s): here every request finds one open.
Target: each proxy case adds <= 1.0 ms p50 over direct. Prints a markdown table with PASS/MISS.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import free_port, streamed, wait_port  # noqa: E402

LANELOCK = [sys.executable, "-m", "lanelock"]
TARGET_MS = 1.0
BODY = (b'{"model":"stand-in","stream":true,"max_tokens":3,'
        b'"messages":[{"role":"user","content":"hi"}]}')
NGINX_CONF = """daemon off;
master_process off;
worker_processes 1;
user root;
pid {work}/nginx.pid;
error_log {work}/nginx-error.log error;
events {{ worker_connections 256; }}
http {{
    access_log off;
    client_body_temp_path {work}/nginx-body;
    proxy_temp_path {work}/nginx-proxy;
    # no upstream keepalive: on a reused connection the stand-in's chunked answer meets
    # delayed ACKs (+40 ms), which would measure the stand-in, not nginx
    upstream engine {{ server 127.0.0.1:{engine}; }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://engine;
            proxy_http_version 1.1;
            proxy_buffering off;
        }}
    }}
}}
"""


def first_byte(port: int, headers: str = "") -> float:
    """Milliseconds from connecting to the first event of a streamed answer, over a new
    connection: the same plain client for every target."""
    request = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(BODY)}\r\n"
               f"Connection: close\r\n{headers}\r\n").encode() + BODY
    first, _, data = streamed(port, request)
    if first is None:
        raise SystemExit(f"no streamed answer from port {port}: {data[:200]!r}")
    return first * 1000


def pct(values, fraction):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(fraction * (len(ordered) - 1))))]


def spawn_idle(count: int) -> list[subprocess.Popen]:
    """count idle processes of this user (each a sleep: a process with a few descriptors)."""
    return [subprocess.Popen(["sleep", "3600"], stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for _ in range(count)]


def stop(procs) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of a process, its threads included (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(targets: dict, requests: int) -> dict:
    """{case: [ms, ...]}, the cases interleaved so that noise hits each alike."""
    for port, headers in targets.values():   # warm up
        for _ in range(5):
            first_byte(port, headers)
    found = {name: [] for name in targets}
    settle = targets["direct"][0]
    for _ in range(requests):
        for name, (port, headers) in targets.items():
            found[name].append(first_byte(port, headers))
        # Unmeasured: what the proxy does once an answer has gone (it opens its next engine
        # connection, proxy/spare.py) would otherwise land on the next round's first request.
        first_byte(settle)
    return found


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=60, help="per case and box")
    parser.add_argument("--processes", type=int, default=800, help="extra idle processes")
    parser.add_argument("--rounds", type=int, default=1, help="repeat the whole run")
    parser.add_argument("--nginx", default=shutil.which("nginx") or "/usr/sbin/nginx")
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="lanelock-hop-bench-")
    env = dict(os.environ, LANELOCK_DIR=os.path.join(work, "locks"),
               LANELOCK_CONFIG=os.path.join(work, "none.toml"),
               LANELOCK_SYSTEM_CONFIG=os.path.join(work, "none.toml"))
    servers, idle, rows = [], [], []
    try:
        # Two stand-ins alike: the proxy's, and the one direct and nginx ask. As an answer ends
        # the proxy opens its next engine connection (proxy/spare.py), which its engine accepts
        # (the stand-in starts a thread for it) just as the next case's request would arrive.
        engine_port, other_port, proxy_port = free_port(), free_port(), free_port()
        for port in (engine_port, other_port):
            engine = subprocess.Popen([sys.executable, "-m", "lanelock.testing", "serve",
                                       "--port", str(port), "--tokens", "3",
                                       "--token-interval", "0"], env=env)
            servers.append(engine)
            wait_port(port, engine)
        proxy = subprocess.Popen(LANELOCK + ["proxy", "-q", "--listen", f"127.0.0.1:{proxy_port}",
                                             "-b", f"127.0.0.1:{engine_port}"], env=env)
        servers.append(proxy)
        wait_port(proxy_port, proxy)
        targets = {"direct": (other_port, "")}
        if args.nginx and os.path.exists(args.nginx):
            nginx_port = free_port()
            conf = os.path.join(work, "nginx.conf")
            with open(conf, "w") as handle:
                handle.write(NGINX_CONF.format(work=work, engine=other_port, port=nginx_port))
            nginx = subprocess.Popen([args.nginx, "-p", work, "-c", conf],
                                     stderr=subprocess.DEVNULL)
            servers.append(nginx)
            wait_port(nginx_port, nginx)
            targets["nginx"] = (nginx_port, "")
        else:
            print("nginx not found: its row is left out", file=sys.stderr)
        targets["proxy, no session header"] = (proxy_port, "")
        targets["proxy, X-Lanelock-Session"] = (proxy_port, "X-Lanelock-Session: bench\r\n")
        for round_ in range(args.rounds):
            for box in ("quiet", "busy"):
                if box == "busy" and not idle:
                    idle = spawn_idle(args.processes)
                elif box == "quiet" and idle:
                    stop(idle)
                    idle = []
                processes = sum(1 for name in os.listdir("/proc") if name.isdigit())
                label = f"{processes} processes" + (" (quiet)" if box == "quiet" else
                                                    f" (+{args.processes} idle)")
                before = cpu_seconds(proxy.pid)
                found = measure(targets, args.requests)
                # What the proxy's process spent per request it served (both its cases and the
                # warm-up): on a busy machine every CPU millisecond is a wall-clock one.
                cpu = (cpu_seconds(proxy.pid) - before) / (2 * (args.requests + 5)) * 1000
                direct = pct(found["direct"], 0.5)
                for name, values in found.items():
                    p50, p95 = pct(values, 0.5), pct(values, 0.95)
                    if name == "direct":
                        rows.append((label, name, f"{p50:.2f} / {p95:.2f} ms", "", ""))
                        continue
                    added = p50 - direct
                    gated = name.startswith("proxy")
                    verdict = ("PASS" if added <= TARGET_MS else "MISS") if gated else ""
                    rows.append((label, name, f"{added:+.2f} ms ({p50:.2f} / {p95:.2f} ms)",
                                 f"<= +{TARGET_MS:.1f} ms" if gated else "", verdict))
                    print(f"  {label}, {name}: {rows[-1][2]} {verdict}", file=sys.stderr,
                          flush=True)
                rows.append((label, "proxy's CPU time per request (both cases)",
                             f"{cpu:.2f} ms", "", ""))
    finally:
        stop(idle)
        stop(servers)
        shutil.rmtree(work, ignore_errors=True)
    print("| box | path | first byte: added p50 (p50 / p95) | target | |\n"
          "| --- | --- | --- | --- | --- |")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
