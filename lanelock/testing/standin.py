"""A contention-detecting stand-in for a local model server, and a tiny client for it.

    python -m lanelock.testing serve --port 0 --delay 0.2 --port-file PORTFILE
    python -m lanelock.testing client http://127.0.0.1:PORT

The server speaks just enough of the OpenAI API (/v1/chat/completions, /v1/completions, /health,
/v1/models) and llama.cpp's /completion for a client to get an answer. A completion takes --delay
seconds; with "stream": true it streams --tokens server-sent events (OpenAI chunk shapes, then
[DONE]) one every --token-interval seconds, and stops when the client hangs up, as llama-server
does. The server records how many generations were in flight at once: GET /stats gives
{"max_in_flight", "total", "in_flight", "hangups", "paths"}, POST /stats/reset clears them.
Loopback only, by design.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Counter:
    def __init__(self):
        self.lock = threading.Lock()
        self.in_flight = self.max_in_flight = self.total = 0
        self.hangups = 0          # generations the client abandoned mid-way
        self.paths: list[str] = []   # the paths generations were asked on, in order

    def enter(self) -> None:
        with self.lock:
            self.in_flight += 1
            self.total += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)

    def leave(self) -> None:
        with self.lock:
            self.in_flight -= 1

    def hung_up(self) -> None:
        with self.lock:
            self.hangups += 1

    def snapshot(self) -> dict:
        with self.lock:
            return {"max_in_flight": self.max_in_flight, "total": self.total,
                    "in_flight": self.in_flight, "hangups": self.hangups,
                    "paths": list(self.paths[-100:])}

    def reset(self) -> None:
        with self.lock:
            self.max_in_flight = self.in_flight
            self.total = self.hangups = 0
            self.paths.clear()


GENERATING = ("/v1/chat/completions", "/v1/completions", "/completion", "/completions")


# What even the strictest stand-in answers at once: the cheap endpoints (proxy/routes.py).
CHEAP = ("/tokenize", "/detokenize", "/apply-template", "/v1/messages/count_tokens",
         "/v1/responses/input_tokens", "/api/show")


def make_server(port: int = 0, delay: float = 0.1, name: str = "stand-in", tokens: int = 8,
                token_interval: float | None = None, strict: bool = False) -> ThreadingHTTPServer:
    """delay: seconds a non-streaming answer takes; a streaming one ("stream": true) sends
    `tokens` server-sent events, one every token_interval seconds (default delay / tokens).
    strict: generate on every request but GET/HEAD and the cheap endpoints, whatever its path
    or method (the strictest engine: a proxy must let no second one in)."""
    counter = Counter()
    interval = delay / max(tokens, 1) if token_interval is None else token_interval

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet: tests read stats, not logs
            pass

        def _send(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/stats":
                return self._send(200, counter.snapshot())
            if self.path == "/health":
                return self._send(200, {"status": "ok"})
            if self.path == "/v1/models":
                return self._send(200, {"object": "list", "data": [{"id": name, "object": "model"}]})
            return self._send(404, {"error": "not found"})

        def _generate(self, seconds: float) -> bool:
            """'Generate' for `seconds`, stopping early when the client hangs up, as llama-server
            does: a killed turn must not keep counting as a generation in flight."""
            import select
            import socket

            deadline = time.monotonic() + seconds
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return True
                readable, _, _ = select.select([self.connection], [], [], min(remaining, 0.002))
                if readable:
                    try:
                        if self.connection.recv(1, socket.MSG_PEEK) == b"":
                            self.close_connection = True
                            return False
                        time.sleep(remaining)   # a pipelined request, not a hang-up
                        return True
                    except OSError:
                        self.close_connection = True
                        return False

        def do_POST(self):
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(min(length, 32 << 20))
            if self.path == "/stats/reset":
                counter.reset()
                return self._send(200, counter.snapshot())
            path = self.path.split("?", 1)[0]
            if strict and path in CHEAP:
                return self._send(200, {"tokens": [1, 2, 3]})
            if path not in GENERATING and not strict:
                return self._send(404, {"error": "not found"})
            try:
                request = json.loads(raw or b"{}")
            except ValueError:
                if not strict:
                    return self._send(400, {"error": "body is not JSON"})
                request = {}
            if not isinstance(request, dict):
                request = {}
            counter.enter()
            with counter.lock:
                counter.paths.append(path)
            try:
                if request.get("stream"):
                    return self._stream(path, request)
                finished = self._generate(delay)
            finally:
                counter.leave()
            if not finished:
                counter.hung_up()
                return None
            text = f"answer from {name}"
            usage = {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4}
            if path == "/completion":   # llama.cpp's native shape
                return self._send(200, {"content": text, "stop": True, "model": name})
            if path in ("/v1/completions", "/completions"):
                return self._send(200, {"object": "text_completion", "model": name, "usage": usage,
                                        "choices": [{"index": 0, "text": text,
                                                     "finish_reason": "stop"}]})
            return self._send(200, {
                "object": "chat.completion", "model": name, "usage": usage,
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": text}}]})

        def _stream(self, path: str, request: dict) -> None:
            """Server-sent events, one token every interval; stops when the client hangs up."""
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            count = int(request.get("max_tokens") or tokens)
            for index in range(count):
                last = index == count - 1
                word = f"tok{index} "
                if path == "/completion":
                    event = {"content": word, "stop": last}
                elif path in ("/v1/completions", "/completions"):
                    event = {"object": "text_completion", "model": name, "choices": [
                        {"index": 0, "text": word, "finish_reason": "stop" if last else None}]}
                else:
                    event = {"object": "chat.completion.chunk", "model": name, "choices": [
                        {"index": 0, "delta": {"content": word},
                         "finish_reason": "stop" if last else None}]}
                if not self._chunk(f"data: {json.dumps(event)}\n\n".encode()):
                    counter.hung_up()
                    return
                if not last and not self._generate(interval):
                    counter.hung_up()
                    return
            if path != "/completion":
                self._chunk(b"data: [DONE]\n\n")
            self._chunk(b"")

        def _chunk(self, data: bytes) -> bool:
            try:
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()
                return True
            except OSError:
                self.close_connection = True
                return False

        do_PUT = do_PATCH = do_DELETE = do_POST   # the strict stand-in generates on these too

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    server.counter = counter
    return server


def complete(url: str, prompt: str = "hello", timeout: float = 60.0) -> str:
    """POST one chat completion; return the answer's text."""
    return ask(url, prompt, timeout=timeout)["content"]


def ask(url: str, prompt: str = "hello", *, max_tokens: int | None = None,
        timeout: float = 300.0) -> dict:
    """One chat completion with its facts: content, the server's timings (llama-server sends
    them), and this process's monotonic start and end (one clock for every process)."""
    payload = {"messages": [{"role": "user", "content": prompt}]}
    if max_tokens:
        payload.update(max_tokens=max_tokens, temperature=0, seed=1)
    request = urllib.request.Request(url.rstrip("/") + "/v1/chat/completions",
                                     data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
    started = time.monotonic()
    with urllib.request.urlopen(request, timeout=timeout) as response:
        answer = json.load(response)
    ended = time.monotonic()
    return {"content": answer["choices"][0]["message"]["content"], "started": started,
            "ended": ended, "timings": answer.get("timings"), "usage": answer.get("usage"),
            "url": url}


def stats(url: str) -> dict:
    with urllib.request.urlopen(url.rstrip("/") + "/stats", timeout=10) as response:
        return json.load(response)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lanelock.testing")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the contention-detecting server")
    serve.add_argument("--port", type=int, default=0)
    serve.add_argument("--delay", type=float, default=0.1)
    serve.add_argument("--name", default="stand-in")
    serve.add_argument("--tokens", type=int, default=8, help="events in a streamed answer")
    serve.add_argument("--token-interval", type=float, help="seconds between streamed events")
    serve.add_argument("--port-file", help="write the bound port here once listening")
    client = commands.add_parser("client", help="ask the server for one completion")
    client.add_argument("url")
    client.add_argument("--prompt", default="hello")
    client.add_argument("--max-tokens", type=int)
    client.add_argument("--json", action="store_true", help="print the answer with its timings")
    args = parser.parse_args(argv)
    if args.command == "client":
        try:
            answer = ask(args.url, args.prompt, max_tokens=args.max_tokens)
            print(json.dumps(answer) if args.json else answer["content"])
        except (OSError, ValueError, KeyError) as error:
            print(f"lanelock.testing client: {error}", file=sys.stderr)
            return 1
        return 0
    server = make_server(args.port, args.delay, args.name, args.tokens, args.token_interval)
    if args.port_file:
        temp = args.port_file + ".tmp"
        with open(temp, "w") as handle:
            handle.write(str(server.server_address[1]))
        os.replace(temp, args.port_file)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
