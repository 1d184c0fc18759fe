"""The API families the proxy speaks, in one table: paths, where session and model live, the busy
answer, which fallbacks can serve a request and how their key is sent.

Gating is not decided here: every request that can make the engine compute holds the lane
(routes.py), whether or not its family is known. A family only shapes what a client is told and
where a deflected request may go. Adding a family is one Dialect in DIALECTS.
"""

from __future__ import annotations

import json


class Dialect:
    """One API family. paths: exact request paths (no trailing slash; matched on the raw path
    with one trailing slash allowed). fallback_kind: the kind of URL fallback that serves it
    ("openai", "anthropic"; None: only @HOST:PORT engines). busy: the body of a busy answer;
    error: the body of any other error (status, kind, message, param)."""

    __slots__ = ("name", "paths", "session", "model", "busy_status", "fallback_kind", "_busy",
                 "_error")

    def __init__(self, name, paths, *, session=None, model=("model",), busy_status=503,
                 fallback_kind=None, busy=None, error=None):
        self.name, self.paths = name, frozenset(paths)
        self.session = session          # the body's field path holding the session, or None
        self.model = model              # the body's field path holding the model, or None
        self.busy_status = busy_status
        self.fallback_kind = fallback_kind
        self._busy = busy or _openai_error
        self._error = error or _openai_failure

    def session_of(self, fields: dict) -> str | None:
        return _text_at(fields, self.session)

    def model_of(self, fields: dict) -> str | None:
        return _text_at(fields, self.model)

    def busy_body(self, kind: str, message: str) -> dict:
        return self._busy(kind, message)

    def error_body(self, status: int, kind: str, message: str, param=None) -> dict:
        return self._error(status, kind, message, param)


def _openai_error(kind: str, message: str) -> dict:
    return {"error": {"type": kind, "code": kind, "message": message}}


def _anthropic_error(kind: str, message: str) -> dict:
    # The Messages API's answer when it is overloaded (HTTP 529): its SDK retries it, then raises
    # anthropic.InternalServerError (status 529) with this type.
    return {"type": "error", "error": {"type": "overloaded_error", "message": message}}


def _ollama_error(kind: str, message: str) -> dict:
    return {"error": message}


def _openai_failure(status: int, kind: str, message: str, param=None) -> dict:
    # OpenAI's own shape: a refused request is an invalid_request_error naming its param (the
    # SDK's BadRequestError.param); lanelock's kind is the code.
    return {"error": {"type": "invalid_request_error" if status == 400 else kind, "code": kind,
                      "param": param, "message": message}}


def _anthropic_failure(status: int, kind: str, message: str, param=None) -> dict:
    # The Messages API's error types: its SDK maps the status, the type tells the cause.
    return {"type": "error", "error": {"type": "invalid_request_error" if status == 400
                                       else "api_error", "message": message}}


def _ollama_failure(status: int, kind: str, message: str, param=None) -> dict:
    return {"error": message}


OPENAI = Dialect("openai", (
    "/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/audio/transcriptions",
    "/v1/audio/translations", "/v1/audio/speech", "/v1/images/generations", "/v1/moderations",
    "/chat/completions", "/completions", "/embeddings"),
    session=("user",), fallback_kind="openai")
RESPONSES = Dialect("openai-responses", ("/v1/responses", "/responses"),
                    session=("user",), fallback_kind="openai")
ANTHROPIC = Dialect("anthropic", ("/v1/messages", "/messages"),
                    session=("metadata", "user_id"), busy_status=529, fallback_kind="anthropic",
                    busy=_anthropic_error, error=_anthropic_failure)
LLAMA_CPP = Dialect("llama.cpp", (
    "/completion", "/completions", "/infill", "/embedding", "/embeddings", "/rerank",
    "/reranking", "/v1/rerank", "/v1/reranking"), session=None)
OLLAMA = Dialect("ollama", ("/api/chat", "/api/generate", "/api/embed", "/api/embeddings"),
                 busy=_ollama_error, error=_ollama_failure)
# Anything else that is gated (a path an engine adds next year, llama-swap's /upstream/MODEL/...):
# held, answered OpenAI-style when busy, deflected only to @HOST:PORT engines.
OTHER = Dialect("other", ())

DIALECTS = (OPENAI, RESPONSES, ANTHROPIC, LLAMA_CPP, OLLAMA)
_BY_PATH: dict[str, Dialect] = {}
for _dialect in DIALECTS:
    for _path in _dialect.paths:
        _BY_PATH.setdefault(_path, _dialect)

# URL fallbacks by kind: how a request's path maps onto the declared base URL, and how the key is
# sent. OpenAI bases include /v1 (https://api.openai.com/v1, as the OpenAI SDK takes them);
# Anthropic bases do not (https://api.anthropic.com, as the Anthropic SDK takes them).
FALLBACK_KINDS = {
    "openai": {"strip": "/v1", "key": ("Authorization", "Bearer {key}"),
               "example": "https://api.openai.com/v1"},
    "anthropic": {"strip": "", "key": ("x-api-key", "{key}"),
                  "example": "https://api.anthropic.com"},
}


def of(path: str) -> Dialect:
    """The family of a raw request path (its query removed); OTHER when none claims it."""
    found = _BY_PATH.get(path)
    if found is None and path.endswith("/") and len(path) > 1:
        found = _BY_PATH.get(path[:-1])
    return found or OTHER


def _text_at(fields: dict, where) -> str | None:
    value = fields
    for name in where or ():
        if not isinstance(value, dict):
            return None
        value = value.get(name)
    return value if isinstance(value, str) and where else None


# Status lines' phrases for statuses aiohttp has none for: the Messages API's own 529.
REASON_PHRASES = {529: "Overloaded"}


def busy_answer(dialect: Dialect, kind: str, message: str) -> tuple[int, bytes]:
    """(status, JSON body) of a busy answer in the client's dialect."""
    return dialect.busy_status, json.dumps(dialect.busy_body(kind, message)).encode()


def error_answer(dialect: Dialect, status: int, kind: str, message: str,
                 param: str | None = None) -> bytes:
    """The JSON body of an error answer (a refused request, an engine that is down) in the
    client's dialect; param: what the client sent wrong (a header's name)."""
    return json.dumps(dialect.error_body(status, kind, message, param)).encode()
