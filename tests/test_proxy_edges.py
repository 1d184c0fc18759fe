"""`lanelock proxy` at its edges: crowded is not broken, idle connections are closed, llama-swap's
/upstream is gated, the log never carries a request's bytes, malformed requests answer 400 in the
family's shape, a URL fallback never gets the client's credentials unless asked, a bad --engine is
a usage error. Real processes: the stand-in engine, `lanelock run` holders, proxies
started under prlimit, raw sockets.
"""

from __future__ import annotations

import json
import re
import resource
import secrets
import shutil
import socket
import subprocess
import sys
import time

import pytest

from support.cli import LANELOCK, TIMEOUT
from support.http import answer, read_all, send_waiting
from support.processes import read_line, wait_for
from support.server import Server
from support.engine import Engine
from support.ports import free_port
from support.proxy import CHAT, LISTENING, Proxy, Recorder, chat_body, request

pytest.importorskip("aiohttp")

PYTHON = sys.executable
needs_prlimit = pytest.mark.skipif(shutil.which("prlimit") is None, reason="prlimit not found")
LLAMA_SWAP = """
import sys
from lanelock.testing.standin import make_server
server = make_server(0, 0.01, "tiny", 1, None, kind="llama-swap")
print(server.server_address[1], flush=True)
server.serve_forever()
"""


def raise_own_fd_limit(at_least: int) -> None:
    """This test process opens many sockets of its own: its soft limit up to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < at_least:
        if hard != resource.RLIM_INFINITY and hard < at_least:
            pytest.skip(f"the hard fd limit {hard} is below {at_least}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 1 << 16), hard))


def raw(port: int, data: bytes, timeout: float = TIMEOUT) -> bytes:
    """Send data on a fresh connection; everything the proxy answers until it closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        return read_all(sock)


# -- crowded is not broken ------------------------------------------------------------------------
@pytest.mark.slow   # a stress: 150 waiting connections
@needs_prlimit
def test_150_waiting_requests_under_96_descriptors_wait_and_none_fails_open(procs, holder,
                                                                             lanelock):
    raise_own_fd_limit(1024)
    engine = Engine(procs, delay=0.01)
    held = holder("-b", engine.backend)
    proxy = Server(procs, ["prlimit", "--nofile=96:96", *LANELOCK, "proxy", "--listen",
                          "127.0.0.1:0", "-b", engine.backend, "--wait", "1d"], LISTENING.pattern)
    cap = int(re.search(r"at most (\d+) connections", proxy.said("connections at once")).group(1))
    body = chat_body()
    request = (f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               f"X-Lanelock-Wait: inf\r\nContent-Length: {len(body)}\r\n"
               "Connection: close\r\n\r\n").encode() + body
    results, threads = send_waiting(proxy.port, 150, request, TIMEOUT * 2)

    # The proxy has taken as many as its descriptors allow; they wait in the lane's queue (the
    # queue's files say so: nothing else reports a wait in the kernel).
    def queued() -> int:
        result = lanelock("status", "-b", engine.backend, "--json")
        return len(json.loads(result.stdout)["lanes"][0].get("queue") or [])

    wait_for(lambda: queued() >= cap, f"{cap} requests queued")
    assert engine.stats()["total"] == 0, "the engine was asked while the holder held the lane"
    assert not results, results[:3]
    assert held.release() == 0
    for thread in threads:
        thread.join(TIMEOUT * 2)
    states = [(status, headers.get("x-lanelock-state")) for status, headers in results]
    assert states == [(200, "held")] * 150, sorted(set(map(str, states)))
    assert engine.stats()["max_in_flight"] == 1
    proxy.stop()
    log = proxy.log()
    assert "Traceback" not in log and "fail-open" not in log and "without it" not in log, log


@needs_prlimit
def test_the_proxy_raises_its_soft_fd_limit_to_the_hard_one(procs):
    engine = Engine(procs)
    proxy = Server(procs, ["prlimit", "--nofile=64:4096", *LANELOCK, "proxy", "--listen",
                          "127.0.0.1:0", "-b", engine.backend], LISTENING.pattern)
    limits = open(f"/proc/{proxy.proc.pid}/limits").read()
    assert re.search(r"Max open files\s+4096\s+4096", limits), limits
    proxy.stop()


@needs_prlimit
def test_a_proxy_short_of_descriptors_for_the_gate_never_forwards_beside_the_holder(procs, holder):
    """At the lowest limits a proxy starts with, opening the lane's files fails (EMFILE): the
    gate is crowded, not broken -- the request is asked again while its wait lasts, then busy."""
    engine = Engine(procs, delay=0.01)
    held = holder("-b", engine.backend)
    reasons = set()
    for limit in range(10, 19):
        try:
            proxy = Server(procs, ["prlimit", f"--nofile={limit}:{limit}", *LANELOCK, "proxy",
                                  "--listen", "127.0.0.1:0", "-b", engine.backend, "--wait", "1"],
                           LISTENING.pattern)
        except AssertionError:
            continue   # too few to start at all (Python's own imports)
        status, headers, body = request(proxy.port, "POST", CHAT, chat_body(),
                                        headers={"X-Lanelock-Wait": "0.2"})
        assert (status, headers["X-Lanelock-State"]) == (503, "busy"), (limit, body, proxy.log())
        reasons.add(headers["X-Lanelock-Reason"])
        proxy.stop()
        assert "Traceback" not in proxy.log() and "without it" not in proxy.log(), proxy.log()
    assert engine.stats()["total"] == 0
    assert "gate_crowded" in reasons, reasons   # the crowded path was taken at some limit
    held.release()


@pytest.mark.slow   # a stress: 1,100 idle connections
@needs_prlimit
def test_idle_connections_cannot_shut_out_a_client_with_the_token(procs):
    raise_own_fd_limit(4096)
    engine = Engine(procs)
    token = secrets.token_hex(8)
    # A common default: 1,024 descriptors, fewer than the idle connections.
    proxy = Server(procs, ["prlimit", "--nofile=1024:1024", *LANELOCK, "proxy", "--listen",
                          "127.0.0.1:0", "-b", engine.backend, "--token-env", "TOKEN"],
                   LISTENING.pattern, env={"TOKEN": token})
    idle = []
    try:
        for _ in range(1100):   # they send nothing, and need no token to do it
            idle.append(socket.create_connection(("127.0.0.1", proxy.port), timeout=TIMEOUT))
        status, _, body = request(proxy.port, "GET", "/v1/models",
                                  headers={"Authorization": f"Bearer {token}"})
        assert status == 200, body
        status, headers, body = request(proxy.port, "POST", CHAT, chat_body(),
                                        headers={"Authorization": f"Bearer {token}"})
        assert (status, headers["X-Lanelock-State"]) == (200, "held"), body
    finally:
        for sock in idle:
            sock.close()
    proxy.stop()
    assert "Traceback" not in proxy.log(), proxy.log()
    assert len(proxy.log()) < 4096, "the log grew with the idle connections"


def eof_within(sock: socket.socket, bound: float) -> float:
    """Seconds until the proxy closes sock (read to its end); fails past bound."""
    started = time.monotonic()
    sock.settimeout(bound)
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        except socket.timeout:
            raise AssertionError(f"still open after {bound}s") from None
        if not chunk:
            break
    return time.monotonic() - started


def test_a_silent_a_half_sent_and_an_idle_keep_alive_connection_are_closed_in_time(procs):
    engine = Engine(procs)
    proxy = Proxy(procs, engine.backend, "--header-timeout", "1", "--idle-timeout", "1.5")
    silent = socket.create_connection(("127.0.0.1", proxy.port))
    half = socket.create_connection(("127.0.0.1", proxy.port))
    half.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")   # never the blank line
    kept = socket.create_connection(("127.0.0.1", proxy.port))
    kept.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
    first = kept.recv(65536)
    answered = time.monotonic()   # the kept-alive connection's idle time counts from its answer
    assert first.startswith(b"HTTP/1.1 200"), first
    with silent, half, kept:
        assert 0.5 < eof_within(silent, 10) < 5
        assert eof_within(half, 10) < 5
        eof_within(kept, 10)
        assert 1.0 < time.monotonic() - answered < 5   # idle 1.5 s: not closed at once
    proxy.stop()
    assert "Traceback" not in proxy.log(), proxy.log()


def test_an_engine_that_stays_down_is_said_once_per_incident(procs):
    proxy = Proxy(procs, f"127.0.0.1:{free_port()}", "--no-witness")
    for _ in range(20):
        assert request(proxy.port, "POST", CHAT, chat_body())[0] == 502
        assert request(proxy.port, "GET", "/v1/models")[0] == 502
    proxy.stop()
    log = proxy.log()
    assert log.count("lanelock: warning:") == 1 and "local_backend_down: " in log, log


# The stand-in on a given port (0: the kernel's), saying each connection it accepts.
COUNTING_ENGINE = """
import sys
from http.server import ThreadingHTTPServer
from lanelock.testing import standin

class Counting(ThreadingHTTPServer):
    def get_request(self):
        accepted = super().get_request()
        print("connected", flush=True)
        return accepted

standin.ThreadingHTTPServer = Counting
server = standin.make_server(int(sys.argv[1]), 0.0, "stand-in", 2, None)
print(server.server_address[1], flush=True)
server.serve_forever()
"""


def test_a_connection_opened_ahead_to_an_engine_that_went_away_is_never_used(procs):
    def counting_engine(port):
        engine = procs.start([sys.executable, "-c", COUNTING_ENGINE, str(port)],
                             stdout=subprocess.PIPE)
        return engine, int(read_line(engine.stdout))

    def answered_then_spare(engine):
        """The request's connection, then the one opened for the next request."""
        assert read_line(engine.stdout) == "connected\n"
        assert read_line(engine.stdout) == "connected\n"

    first, port = counting_engine(0)
    proxy = Proxy(procs, f"127.0.0.1:{port}", "--no-witness")
    assert request(proxy.port, "POST", CHAT, chat_body())[0] == 200
    answered_then_spare(first)
    first.kill()
    first.wait()
    # The engine restarted on its port: the spare to the old one is dropped, a new one made.
    second, _ = counting_engine(port)
    status, headers, _ = request(proxy.port, "POST", CHAT, chat_body())
    assert (status, headers["X-Lanelock-State"]) == (200, "held")
    answered_then_spare(second)
    second.kill()
    second.wait()
    # Gone for good: down, as without a spare.
    status, headers, _ = request(proxy.port, "POST", CHAT, chat_body())
    assert (status, headers["X-Lanelock-State"]) == (502, "down")
    proxy.stop()
    assert "Traceback" not in proxy.log(), proxy.log()


# An engine on a host name that sets a cookie on every answer and says the cookie it was sent.
COOKIE_ENGINE = """
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        print("cookie:", self.headers.get("Cookie"), flush=True)
        body = b'{"ok": true}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Set-Cookie", "session_of_a=secret; Path=/")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
print(server.server_address[1], flush=True)
server.serve_forever()
"""


def test_a_cookie_one_clients_answer_set_never_goes_with_anothers_request(procs):
    engine = procs.start([sys.executable, "-c", COOKIE_ENGINE], stdout=subprocess.PIPE)
    port = int(read_line(engine.stdout))
    proxy = Proxy(procs, f"localhost:{port}", "--no-witness")   # a host name: cookies kept
    for _ in range(2):
        status, headers, _ = request(proxy.port, "POST", CHAT, chat_body())
        assert status == 200 and "session_of_a" in headers["Set-Cookie"]   # relayed as it came
        assert read_line(engine.stdout) == "cookie: None\n"
    proxy.stop()


def test_a_key_repeated_where_no_model_is_named_is_the_engines_business(procs):
    """The body's keys are checked, and those of the objects in its fields; those of the objects
    in its lists (messages, tools: most of a conversation's bytes) are read by json alone."""
    engine = Engine(procs, delay=0.0)
    proxy = Proxy(procs, engine.backend, "--no-witness")
    in_a_message = (b'{"model":"stand-in","messages":[{"role":"user","content":"a",'
                    b'"content":"b"}]}')
    assert request(proxy.port, "POST", CHAT, in_a_message)[0] == 200
    for body in (b'{"model":"stand-in","messages":[],"MODEL":"other"}',
                 b'{"model":"stand-in","messages":[],"metadata":{"user_id":"a","user_id":"b"}}'):
        status, _, data = request(proxy.port, "POST", CHAT, body)
        assert status == 400 and b"ambiguous_request_body" in data, data
    proxy.stop()


# -- llama-swap's /upstream -----------------------------------------------------------------------
def test_an_upstream_get_is_gated_and_loads_no_model_beside_the_holder(procs, holder):
    engine = procs.start([PYTHON, "-c", LLAMA_SWAP], stdout=subprocess.PIPE)
    port = int(engine.stdout.readline())
    held = holder("-b", f"127.0.0.1:{port}")
    proxy = Proxy(procs, f"127.0.0.1:{port}")
    for method, target in (("GET", "/upstream/other/health"), ("HEAD", "/upstream/other/"),
                           ("GET", "/%75pstream/other/v1/models"),
                           ("GET", "//upstream/./other/health")):
        status, headers, _ = request(proxy.port, method, target)
        assert (status, headers["X-Lanelock-State"]) == (503, "busy"), (method, target)
    assert json.loads(request(port, "GET", "/stats")[2])["loads"] == []
    assert request(proxy.port, "GET", "/v1/models")[0] == 200   # a plain read still passes
    assert held.release() == 0
    status, headers, _ = request(proxy.port, "GET", "/upstream/other/health")
    assert headers["X-Lanelock-State"] == "held"
    assert json.loads(request(port, "GET", "/stats")[2])["loads"] == ["other"]


# -- what the log says, and what malformed requests are answered ----------------------------------
def test_malformed_requests_never_put_their_bytes_in_the_log(procs):
    engine = Engine(procs)
    token = "tok" + secrets.token_hex(12)
    proxy = Proxy(procs, engine.backend, "--token-env", "TOKEN", env={"TOKEN": token})
    auth = f"Authorization: Bearer {token}".encode()
    malformed = [
        b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + auth + b"\x01\r\n\r\n",
        b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + auth.replace(b":", b" :") + b"\r\n\r\n",
        b"GET /v1/models HTTP/1.1\r\n" + auth + b"\r\nContent-Length: zz\r\n\r\n",
        b"GET /v1/models?" + token.encode() + b" HTTP/9.1\r\n" + auth + b"\r\n\r\n",
        b"G\x01T /" + token.encode() + b" HTTP/1.1\r\n" + auth + b"\r\n\r\n",
        b"POST http://x/v1/chat/completions HTTP/1.1\r\nHost: x\r\n" + auth
        + b"\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}",
        b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff" + token.encode()
        + b"\r\nConnection: close\r\n\r\n",
    ]
    for data in malformed * 3:
        status, _, _ = answer(raw(proxy.port, data))
        assert status == 400, data
    proxy.stop()
    log = proxy.log()
    assert token not in log, log
    assert "Traceback" not in log, log
    assert log.count("malformed requests answered 400") == 1, log   # once per incident


def test_an_undecodable_header_and_an_absolute_target_answer_400_in_the_familys_shape(procs):
    engine = Engine(procs)
    proxy = Proxy(procs, engine.backend, "--token-env", "TOKEN", env={"TOKEN": "sesame"})
    for path, shape in (("/v1/chat/completions", "openai"), ("/v1/messages", "anthropic")):
        status, headers, body = answer(raw(
            proxy.port, f"POST {path} HTTP/1.1\r\nHost: x\r\n".encode()
            + b"Authorization: Bearer \xffsesame\r\nContent-Length: 2\r\nConnection: close"
            b"\r\n\r\n{}"))
        assert status == 400 and headers["content-type"].startswith("application/json"), body
        error = json.loads(body)
        if shape == "openai":
            assert error["error"]["param"] == "Authorization", error
        else:
            assert error["type"] == "error" and "Authorization" in error["error"]["message"]
    for target in ("http://127.0.0.1/v1/models", "*", f"http://x{CHAT}"):
        status, headers, body = answer(raw(
            proxy.port, f"GET {target} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sesame\r\n"
            "Connection: close\r\n\r\n".encode()))
        assert status == 400, (target, body)
    proxy.stop()
    assert "Traceback" not in proxy.log(), proxy.log()


# -- a URL fallback and the client's credentials ---------------------------------------------------
CREDENTIALS = {"Authorization": "Bearer local-engine-key", "Cookie": "session=box",
               "X-Api-Key": "local-x-key", "api-key": "local-azure-key"}


@pytest.mark.parametrize("passed", [False, True], ids=["by-default", "fallback-pass-auth"])
def test_a_url_fallback_gets_the_clients_credentials_only_when_asked(procs, holder, passed):
    engine = Engine(procs)
    cloud = Recorder(procs)
    held = holder("-b", engine.backend)
    proxy = Proxy(procs, engine.backend, "--fallback", f"{cloud.url}/v1",
                  *(["--fallback-pass-auth"] if passed else []))
    status, headers, _ = request(proxy.port, "POST", CHAT, chat_body(), headers=CREDENTIALS)
    assert (status, headers["X-Lanelock-State"]) == (200, "deflected")
    seen = cloud.next_request()["headers"]
    sent = {name.lower(): value for name, value in CREDENTIALS.items()}
    got = {name: seen.get(name) for name in sent}
    assert got == (sent if passed else dict.fromkeys(sent)), got
    held.release()


# -- a bad --engine --------------------------------------------------------------------------------
@pytest.mark.parametrize("engine", ["not a url", "http://exa mple.com", "http://127.0.0.1:0",
                                    "http://a..b:8080", "http://127.0.0.1:8080/a b"])
@pytest.mark.parametrize("command", ["proxy", "watch"])
def test_a_bad_engine_is_a_usage_error_before_anything_starts(lanelock, command, engine):
    extra = ("--listen", "127.0.0.1:0") if command == "proxy" else ()
    result = lanelock(command, "-b", "127.0.0.1:8080", *extra, "--engine", engine, timeout=20)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("lanelock: --engine")
    assert "listening" not in result.stderr and "Traceback" not in result.stderr
