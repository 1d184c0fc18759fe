"""A stand-in engine that routes requests to models as the real engine's source does, and records
what each model ran -- to show that a proxy never lets a model run beside a holder of its lane.

    python -m lanelock.testing.routed --engine llama-swap --models A,author/model --alias x=A \\
        --delay 0.5 --port-file PORTFILE
    python -m lanelock.testing.routed --engine ollama --models llama3:latest --port-file PORTFILE

llama-swap (proxy/proxymanager.go): a POST to an inference path runs the body's `model` read with
gjson -- the FIRST of repeated keys -- through RealModelName (an alias is its model); a multipart
/v1/audio/transcriptions or /v1/images/edits runs the form's first `model` field (FormValue: the
query's when the form has none); GET /v1/audio/voices and GET /sdapi/v1/loras load the model of
their `?model=` (swapProcessGroup); any method on /upstream/PATH runs the first model its decoded
path's segments name, joined one by one, empty ones skipped (findModelInPath). A model it does not
know runs nothing (400). GET /v1/models lists the models, GET /running the ones that ran.

Ollama: POST /api/chat, /api/generate, /api/embed and /v1/chat/completions run the body's
`model` as Go's encoding/json reads it (the LAST key that matches `model` in any case), named as
Ollama names it: lower case, `library/` and `:latest` implied (llama3 is llama3:latest).

A run takes --delay seconds. GET /stats: {"runs": [{"model", "method", "path", "started",
"ended"}], "max_in_flight": {MODEL: most runs of it at once}}. Loopback only.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

SWAP_INFERENCE = frozenset({
    "/v1/chat/completions", "/v1/responses", "/v1/completions", "/v1/messages",
    "/v1/messages/count_tokens", "/v1/embeddings", "/reranking", "/rerank", "/v1/rerank",
    "/v1/reranking", "/infill", "/completion", "/v1/audio/speech", "/v1/audio/voices",
    "/v1/images/generations"})
SWAP_FORMS = frozenset({"/v1/audio/transcriptions", "/v1/images/edits"})
SWAP_QUERY_GETS = frozenset({"/v1/audio/voices", "/sdapi/v1/loras"})
OLLAMA_PATHS = frozenset({"/api/chat", "/api/generate", "/api/embed", "/api/embeddings",
                          "/v1/chat/completions", "/v1/completions"})


class Record:
    def __init__(self):
        self.lock = threading.Lock()
        self.runs: list = []
        self.now: dict = {}
        self.most: dict = {}

    def begin(self, model: str, method: str, path: str) -> dict:
        run = {"model": model, "method": method, "path": path, "started": time.time(),
               "ended": None}
        with self.lock:
            self.runs.append(run)
            self.now[model] = self.now.get(model, 0) + 1
            self.most[model] = max(self.most.get(model, 0), self.now[model])
        return run

    def end(self, run: dict) -> None:
        with self.lock:
            run["ended"] = time.time()
            self.now[run["model"]] -= 1

    def stats(self) -> dict:
        with self.lock:
            return {"runs": [dict(run) for run in self.runs[-500:]],
                    "max_in_flight": dict(self.most)}


def first_keys(pairs: list) -> dict:
    """gjson's reading: of repeated keys, the first."""
    found: dict = {}
    for name, value in pairs:
        found.setdefault(name, value)
    return found


def go_model(pairs: list):
    """Go encoding/json's reading of a `model` field: the last key equal to it in any case."""
    found = None
    for name, value in pairs:
        if name.lower() == "model":
            found = value
    return found


def ollama_name(name: str) -> str:
    """Ollama's full name of a model: host and namespace left implicit, `:latest` filled in."""
    name = name.strip().lower()
    parts = name.split("/")
    if len(parts) == 3 and parts[0] == "registry.ollama.ai":
        parts = parts[1:]
    if len(parts) == 2 and parts[0] == "library":
        parts = parts[1:]
    if ":" not in parts[-1]:
        parts[-1] += ":latest"
    return "/".join(parts)


def form_value(body: bytes, content_type: str, name: str) -> str | None:
    """Go's FormValue for a multipart body: the first non-file field called name."""
    from email.parser import BytesParser
    from email.policy import HTTP

    message = BytesParser(policy=HTTP).parsebytes(
        b"Content-Type: " + content_type.encode("latin-1") + b"\r\n\r\n" + body)
    if not message.is_multipart():
        return None
    for part in message.iter_parts():
        if part.get_param("name", header="content-disposition") == name and \
                part.get_param("filename", header="content-disposition") is None:
            return part.get_payload(decode=True).decode("utf-8", "replace")
    return None


def make_server(engine: str, models: list, aliases: dict, delay: float,
                port: int = 0) -> ThreadingHTTPServer:
    record = Record()
    known = set(models) | set(aliases)

    def real(name):
        """RealModelName: a model, or an alias's model; None for a name it does not know."""
        if name in models:
            return name
        return aliases.get(name)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def _send(self, code: int, body, content_type="application/json") -> None:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        def _body(self) -> bytes:
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _run(self, model: str | None, path: str) -> None:
            if model is None:
                return self._send(400, {"error": "could not find a model for this request"})
            run = record.begin(model, self.command, path)
            try:
                time.sleep(delay)
            finally:
                record.end(run)
            return self._send(200, {"model": model, "object": "chat.completion", "choices": [
                {"index": 0, "message": {"role": "assistant", "content": f"answer from {model}"},
                 "finish_reason": "stop"}]})

        def _route(self) -> None:
            path, _, query = self.path.partition("?")
            if self.command == "GET" and path == "/stats":
                return self._send(200, record.stats())
            if engine == "llama-swap":
                return self._swap(path, query)
            return self._ollama(path)

        def _swap(self, path: str, query: str) -> None:
            method = self.command
            if method in ("GET", "HEAD") and path == "/v1/models":
                return self._send(200, {"object": "list", "data": [
                    {"id": model, "object": "model"} for model in models]})
            if method in ("GET", "HEAD") and path == "/running":
                ran = sorted({run["model"] for run in record.stats()["runs"]})
                return self._send(200, {"running": [{"model": model, "state": "ready"}
                                                     for model in ran]})
            if path.startswith("/upstream/"):
                self._body()
                name, parts = "", urllib.parse.unquote(path[len("/upstream/"):]).split("/")
                for part in parts:
                    if not part:
                        continue
                    name = f"{name}/{part}" if name else part
                    if name in known:
                        return self._run(real(name), path)
                return self._send(400, {"error": "model id required in path"})
            if method == "GET" and path in SWAP_QUERY_GETS:
                given = urllib.parse.parse_qs(query).get("model", [None])[0]
                return self._run(real(given) if given else None, path)
            if method == "POST" and path in SWAP_FORMS:
                given = form_value(self._body(), self.headers.get("Content-Type", ""), "model")
                if given is None:
                    given = urllib.parse.parse_qs(query).get("model", [None])[0]
                return self._run(real(given) if given else None, path)
            if method == "POST" and path in SWAP_INFERENCE:
                try:
                    given = json.loads(self._body(), object_pairs_hook=first_keys).get("model")
                except (ValueError, AttributeError):
                    return self._send(400, {"error": "invalid JSON"})
                return self._run(real(given) if isinstance(given, str) else None, path)
            self._body()
            return self._send(404, b"404 page not found", "text/plain")

        def _ollama(self, path: str) -> None:
            if self.command in ("GET", "HEAD") and path == "/api/version":
                return self._send(200, {"version": "0.0.0-stand-in"})
            if self.command in ("GET", "HEAD") and path == "/api/tags":
                return self._send(200, {"models": [{"name": model, "model": model}
                                                   for model in models]})
            if self.command == "POST" and path in OLLAMA_PATHS:
                try:
                    given = json.loads(self._body(), object_pairs_hook=go_model)
                except ValueError:
                    return self._send(400, {"error": "invalid JSON"})
                name = ollama_name(given) if isinstance(given, str) else None
                return self._run(name if name in models else None, path)
            self._body()
            return self._send(404, b"404 page not found", "text/plain")

        do_GET = do_POST = do_HEAD = do_PUT = do_DELETE = do_PATCH = _route

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    server.record = record
    return server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lanelock.testing.routed")
    parser.add_argument("--engine", choices=("llama-swap", "ollama"), required=True)
    parser.add_argument("--models", required=True, help="comma-separated model IDs")
    parser.add_argument("--alias", action="append", default=[], metavar="ALIAS=MODEL")
    parser.add_argument("--delay", type=float, default=0.2)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--port-file")
    args = parser.parse_args(argv)
    aliases = dict(item.split("=", 1) for item in args.alias)
    server = make_server(args.engine, args.models.split(","), aliases, args.delay, args.port)
    from .standin import serve_until_interrupted

    return serve_until_interrupted(server, args.port_file)


if __name__ == "__main__":
    sys.exit(main())
