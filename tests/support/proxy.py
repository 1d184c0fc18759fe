"""What a test of `lanelock proxy` needs around the proxy: the proxy in its own process (Proxy),
a recorder of what an upstream was sent (Recorder), a client speaking HTTP over a fresh connection
(request, raw_request, open_stream, read_until, chat_body), and the lane as lanelock reports it
(probe, history, lane_status, turn_state, lock_path). Every process is started through the procs
fixture and synchronised on its startup line."""

from __future__ import annotations

import http.client
import json
import re
import socket
import subprocess
import sys
from pathlib import Path

from support.cli import LANELOCK, TIMEOUT
from support.http import answer, read_all
from support.processes import read_line
from support.server import Server

STAMP = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}[+-]\d\d:\d\d ")
LISTENING = re.compile(r"proxy listening on http://127\.0\.0\.1:(\d+) for (\S+) \(lane ([^)]+)\)")
CHAT = "/v1/chat/completions"

# A stand-in for a cloud API that writes down what it was sent: one JSON line per request on
# stdout (method, path, headers, body), then an OpenAI-shaped answer.
RECORDER_SCRIPT = r"""
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _answer(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _record(self, body):
        print(json.dumps({"method": self.command, "path": self.path,
                          "headers": [[name, value] for name, value in self.headers.items()],
                          "body": body.decode("utf-8", "replace")}), flush=True)

    def do_GET(self):
        self._record(b"")
        self._answer({"object": "list", "data": [{"id": "recorded", "object": "model"}]})

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self._record(body)
        fields = json.loads(body or b"{}")
        self._answer({"id": "chatcmpl-recorder", "object": "chat.completion", "created": 0,
                      "model": fields.get("model"),
                      "usage": {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4},
                      "choices": [{"index": 0, "finish_reason": "stop",
                                   "message": {"role": "assistant",
                                               "content": "answer from recorder"}}]})

server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
server.daemon_threads = True
print(server.server_address[1], flush=True)
server.serve_forever()
"""


class Recorder:
    """The header recorder in its own process; requests() reads what it has written down."""

    def __init__(self, procs):
        self.proc = procs.start([sys.executable, "-c", RECORDER_SCRIPT], stdout=subprocess.PIPE)
        self.port = int(read_line(self.proc.stdout))
        self.url = f"http://127.0.0.1:{self.port}"

    def next_request(self) -> dict:
        seen = json.loads(read_line(self.proc.stdout))
        seen["headers"] = {name.lower(): value for name, value in seen["headers"]}
        return seen


class Proxy(Server):
    """`lanelock proxy --listen 127.0.0.1:0 -b BACKEND ARGS`, started when its startup line has
    been read from its stderr pipe (conftest's Server); the rest of its stderr is collected."""

    def __init__(self, procs, backend: str, *args, env=None):
        super().__init__(procs, [*LANELOCK, "proxy", "--listen", "127.0.0.1:0", "-b", backend,
                                 *map(str, args)], LISTENING.pattern, env=env)
        self.lane = self.found.group(3)
        self.url = f"http://127.0.0.1:{self.port}"

    def stderr(self) -> str:
        return self.log()


def unstamped(line: str) -> str:
    """A proxy's log line without its time (each starts with one: ISO 8601 with its zone)."""
    return STAMP.sub("", line)


# -- clients -----------------------------------------------------------------------------------
def chat_body(stream=False, **extra) -> bytes:
    return json.dumps({"model": "stand-in", "stream": stream,
                       "messages": [{"role": "user", "content": "hi"}], **extra}).encode()


def request(port, method, path, body=None, headers=None, timeout=TIMEOUT):
    """(status, headers as a case-insensitive message, body bytes) over a fresh connection."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body, {"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        return response.status, response.headers, response.read()
    finally:
        conn.close()


def open_stream(port, body=None, headers=None, path=CHAT) -> socket.socket:
    """A raw connection with a streaming request sent; the caller reads and hangs up."""
    body = body if body is not None else chat_body(stream=True)
    head = "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
    sock = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n{head}Connection: close\r\n\r\n".encode() + body)
    return sock


def read_until(sock, marker: bytes, seen: bytes = b"") -> bytes:
    """Read from sock until marker is in what was read (or EOF); all bytes read so far."""
    while marker not in seen:
        chunk = sock.recv(65536)
        if not chunk:
            break
        seen += chunk
    return seen


def raw_request(port, method: str, target: str, body: bytes = b"{}", headers=None):
    """(status, headers, body) for a request whose target goes out exactly as written."""
    head = "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as sock:
        sock.sendall(f"{method} {target} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                     f"{head}Connection: close\r\n\r\n".encode() + body)
        data = read_all(sock)
    status, fields, rest = answer(data)
    if fields.get("transfer-encoding") == "chunked":
        out, rest_ = b"", rest
        while rest_:
            size, _, rest_ = rest_.partition(b"\r\n")
            length = int(size, 16)
            if not length:
                break
            out, rest_ = out + rest_[:length], rest_[length + 2:]
        rest = out
    return status, fields, rest


# -- the lane, asked of lanelock ----------------------------------------------------------------
def probe(lanelock, backend) -> int:
    return lanelock("probe", "-b", backend).returncode


def history(lanelock, backend) -> list[dict]:
    result = lanelock("history", "-b", backend, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["events"]


def lane_status(lanelock, backend) -> dict:
    result = lanelock("status", "-b", backend, "--json")
    assert result.returncode == 0, result.stderr
    (lane,) = json.loads(result.stdout)["lanes"]
    return lane


def turn_state(lanelock, backend, *args) -> tuple[int, str]:
    """A `lanelock run` turn reporting how it ran: (exit status, LANELOCK_STATE)."""
    result = lanelock("run", "-b", backend, *args, "--", "sh", "-c", 'echo "$LANELOCK_STATE"')
    return result.returncode, result.stdout.strip()


def lock_path(lock_dir: Path, engine) -> Path:
    return lock_dir / f"localhost-{engine.port}.lock"
