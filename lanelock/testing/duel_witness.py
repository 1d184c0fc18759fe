"""The duel's witness step: what the gate cannot see, the engine's own account can.

On a stand-in engine of its own (llama.cpp's /slots shape, a free loopback port, a lock root in
the duel's work directory: the user's engine and lanes are never touched), with `lanelock watch`
as a real process: a request sent straight to the engine while the lane is free must be reported
unseen, and a turn through `lanelock run` must not be.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time

INTERVAL = 0.1        # the watch's interval here: detection within two of them
GENERATION = 0.3      # seconds a stand-in generation takes (three looks at INTERVAL)
TIMEOUT = 15.0


def witness_step(duel, workdir: str, result: dict) -> str | None:
    """Run the step; returns the failure's reason or None. The processes go on duel's list."""
    from .standin import make_server

    server = make_server(0, GENERATION, "duel-engine", kind="llama.cpp")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    port = server.server_address[1]
    url, backend = f"http://127.0.0.1:{port}", f"127.0.0.1:{port}"
    root = os.path.join(workdir, "witness-locks")
    base = [sys.executable, "-m", "lanelock"]
    lane = ["-b", backend, "--lock-dir", root]
    env = dict(os.environ)
    env.pop("LANELOCK_STORE", None)   # this step's lane lives in its own root, whatever the duel's
    try:
        watch = duel._spawn("witness", base + ["watch", *lane, "--interval", str(INTERVAL)], env,
                            workdir, ())
        lines = _Lines(watch.stderr)
        if lines.wait("watching the engine") is None:
            return duel._fail_on("witness", watch, "lanelock watch never started watching")
        _ask(url)                                   # straight to the engine, no turn
        unseen = lines.wait("unseen generation")
        if unseen is None:
            duel.step("witness: unseen", False, "a request straight to the engine while the lane "
                      "was free was not reported")
            return "the witness missed a generation no turn covered"
        duel.step("witness: unseen", True, f"a request straight to the engine while the lane was "
                  f"free: {unseen.partition('lanelock: ')[2][:160]}")
        turn = subprocess.run(base + ["run", *lane, "-q", "--", sys.executable, "-m",
                                      "lanelock.testing", "client", url],
                              env=env, cwd=workdir, stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=TIMEOUT)
        if turn.returncode != 0:
            duel.step("witness: covered", False, f"the gated turn failed: exit {turn.returncode}")
            return "the gated turn failed"
        os.killpg(watch.pid, signal.SIGTERM)        # it reports anything still in progress
        rest = lines.rest()
        watch.wait(TIMEOUT)
        late = [line for line in rest if "unseen generation" in line]
        result["witness"] = {"engine": url, "unseen_reported": unseen, "gated_reported": late}
        if late:
            duel.step("witness: covered", False, f"a gated turn was reported unseen: {late[0]}")
            return "the witness called a gated turn unseen"
        duel.step("witness: covered", True, "a turn through lanelock run: covered, not reported")
        return None
    finally:
        server.shutdown()
        server.server_close()


def _ask(url: str) -> None:
    from .standin import complete

    complete(url, "straight to the engine", timeout=TIMEOUT)


class _Lines:
    """Lines of a child's stderr, read as they come (no sleeps)."""

    def __init__(self, stream):
        self.fd = stream.fileno()
        self.buffer = b""
        self.eof = False

    def wait(self, needle: str, timeout: float = TIMEOUT) -> str | None:
        deadline = time.monotonic() + timeout
        while True:
            while b"\n" in self.buffer:
                line, self.buffer = self.buffer.split(b"\n", 1)
                text = line.decode("utf-8", "replace")
                if needle in text:
                    return text
            remaining = deadline - time.monotonic()
            if self.eof or remaining <= 0:
                return None
            readable, _, _ = select.select([self.fd], [], [], remaining)
            if readable:
                chunk = os.read(self.fd, 65536)
                self.eof = not chunk
                self.buffer += chunk

    def rest(self, timeout: float = TIMEOUT) -> list[str]:
        lines = []
        while True:
            line = self.wait("", timeout)
            if line is None:
                return lines + ([self.buffer.decode("utf-8", "replace")] if self.buffer else [])
            lines.append(line)
