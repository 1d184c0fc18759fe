"""The stand-in engine (lanelock.testing.standin) in a process of its own, the one engine class the
tests share. It prints its port on stdout once it listens; the test reads that pipe, never a sleep.
"""

from __future__ import annotations

import http.client
import json
import subprocess
import sys

from support.cli import TIMEOUT
from support.processes import read_line

# address: where it listens (a netns host's LAN address, or loopback); the port is the kernel's.
ENGINE_SCRIPT = """
import sys
from http.server import ThreadingHTTPServer
from lanelock.testing import standin

address, delay, name, tokens, interval = sys.argv[1:6]

class Bound(ThreadingHTTPServer):
    def server_bind(self):
        self.server_address = (address, self.server_address[1])
        super().server_bind()

standin.ThreadingHTTPServer = Bound
server = standin.make_server(0, float(delay), name, int(tokens),
                             float(interval) if interval != "-" else None,
                             strict=sys.argv[6:] == ["strict"])
print(server.server_address[1], flush=True)
server.serve_forever()
"""


class Engine:
    """The stand-in engine in its own process. delay: seconds a plain answer takes; a streamed one
    sends `tokens` events `interval` apart (default delay / tokens); strict: every request but the
    cheap ones generates; address: where it listens."""

    def __init__(self, procs, *, delay=0.1, name="stand-in", tokens=8, interval=None,
                 strict=False, address="127.0.0.1"):
        self.name = name
        self.address = address
        self.proc = procs.start([sys.executable, "-c", ENGINE_SCRIPT, address, str(delay), name,
                                 str(tokens), "-" if interval is None else str(interval),
                                 *(["strict"] if strict else [])],
                                stdout=subprocess.PIPE)
        line = read_line(self.proc.stdout)
        assert line.strip().isdigit(), f"the stand-in did not start: {line!r}"
        self.port = int(line)
        self.backend = f"{address}:{self.port}"
        self.url = f"http://{self.backend}"

    def stats(self) -> dict:
        conn = http.client.HTTPConnection(self.address, self.port, timeout=TIMEOUT)
        try:
            conn.request("GET", "/stats")
            return json.loads(conn.getresponse().read())
        finally:
            conn.close()
