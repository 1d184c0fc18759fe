"""The proxy's routes judge the raw request target: its own endpoints (/lanelock/status,
/metrics) answer only their own spelling and method, every other target goes to the engine as it
came, and a cheap endpoint's name spelled any other way still holds the lane.

Real processes: `python -m lanelock proxy` in front of a recorder engine that writes down each
request it is sent (one JSON line on stdout, read through the pipe), and a `lanelock run` holder
for the busy lane.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from support.processes import read_line
from support.proxy import Proxy, raw_request

pytest.importorskip("aiohttp")

# An engine that writes down each request (method, target) and answers 200 with a JSON body that
# says it was the engine; HEAD too (support.proxy's Recorder answers GET and POST alone).
RECORDER = r"""
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _serve(self, body=True):
        size = int(self.headers.get("Content-Length") or 0)
        if size:
            self.rfile.read(size)
        print(json.dumps([self.command, self.path]), flush=True)
        data = b'{"engine": true}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body:
            self.wfile.write(data)

    do_GET = do_POST = _serve

    def do_HEAD(self):
        self._serve(body=False)

server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
server.daemon_threads = True
print(server.server_address[1], flush=True)
server.serve_forever()
"""


class Recorder:
    def __init__(self, procs):
        self.proc = procs.start([sys.executable, "-c", RECORDER], stdout=subprocess.PIPE)
        self.port = int(read_line(self.proc.stdout))
        self.backend = f"127.0.0.1:{self.port}"

    def next_request(self) -> list:
        """The next request sent by a test (a target with '?n='), passing over the proxy's own
        reads of the engine (status asks what it runs, metrics scrapes its /metrics)."""
        while True:
            seen = json.loads(read_line(self.proc.stdout))
            if "?n=" in seen[1]:
                return seen


@pytest.fixture
def served(procs):
    engine = Recorder(procs)
    # --no-witness: the engine sees the requests of the test and the proxy's own reads alone
    proxy = Proxy(procs, engine.backend, "--no-witness")
    return engine, proxy


def test_the_proxys_own_endpoints_answer_only_their_own_spelling_and_method(served):
    """GET /lanelock/status and GET /metrics are the proxy's; another spelling of either (a dot
    segment, a percent-encoding, a doubled slash, a trailing one) and another method are
    requests for the engine, forwarded as they came -- the target judged is the raw one, not
    the path the router resolved."""
    engine, proxy = served
    status, headers, body = raw_request(proxy.port, "GET", "/lanelock/status?n=0")
    assert status == 200 and "lanes" in json.loads(body) and "proxy" in json.loads(body)
    status, headers, body = raw_request(proxy.port, "GET", "/metrics?n=0")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    assert b"lanelock_" in body
    for number, (method, path) in enumerate((
            # (not //lanelock/status: Python's http.server, the recorder's, collapses leading
            # slashes itself)
            ("GET", "/lanelock/%73tatus"), ("GET", "/lanelock/./status"),
            ("GET", "/lanelock//status"), ("GET", "/./metrics"), ("GET", "/%6detrics"),
            ("HEAD", "/lanelock/status"), ("HEAD", "/metrics"), ("GET", "/lanelock/status/"),
            ("POST", "/lanelock/status"), ("POST", "/metrics")), 1):
        target = f"{path}?n={number}"
        status, headers, body = raw_request(proxy.port, method, target)
        assert status == 200, (method, target, status, body)
        if method != "HEAD":
            assert json.loads(body) == {"engine": True}, (method, target, body[:200])
        assert engine.next_request() == [method, target], (method, target)
        # a POST is a generation as far as the gate knows: it held the lane
        assert headers.get("x-lanelock-state") == ("held" if method == "POST" else None), \
            (method, target, headers)


def test_a_cheap_endpoints_name_spelled_otherwise_still_holds_the_lane(served, holder):
    """While another turn holds the lane, POST /tokenize is forwarded at once; a dot segment, a
    percent-encoding, a doubled or trailing slash before or in the same name is judged as
    written -- not cheap -- and answered busy without reaching the engine."""
    engine, proxy = served
    held = holder("-b", engine.backend, "-s", "holder")
    status, headers, body = raw_request(proxy.port, "POST", "/tokenize?n=1")
    assert (status, json.loads(body)) == (200, {"engine": True})
    assert "x-lanelock-state" not in headers
    assert engine.next_request() == ["POST", "/tokenize?n=1"]
    for target in ("/./tokenize", "/%74okenize", "//tokenize", "/tokenize/", "/x/../tokenize",
                   "/tokenize%2F"):
        status, headers, body = raw_request(proxy.port, "POST", target + "?n=2")
        assert (headers.get("x-lanelock-state"), headers.get("x-lanelock-reason")) == \
            ("busy", "local_backend_busy"), (target, status, body)
    assert held.release() == 0
    # nothing of the busy ones reached the engine: the next it sees is this one
    raw_request(proxy.port, "POST", "/tokenize?n=3")
    assert engine.next_request() == ["POST", "/tokenize?n=3"]
