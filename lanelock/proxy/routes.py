"""Which requests hold the lane, and which fallbacks may take them.

Generation endpoints (POST) hold the lane; everything else (/v1/models, /health, /props, /slots,
/api/tags, ...) passes through ungated. The list is the `proxy_paths` setting (config file).
"""

from __future__ import annotations

# OpenAI style, llama.cpp native, Ollama native.
DEFAULT_GATED = (
    "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings",
    "/chat/completions", "/completions",
    "/completion", "/infill", "/embedding", "/embeddings", "/rerank", "/reranking", "/v1/rerank",
    "/api/chat", "/api/generate", "/api/embed", "/api/embeddings",
)


class Routes:
    def __init__(self, paths=None):
        self.gated = frozenset(_norm(path) for path in (paths or DEFAULT_GATED))

    def is_gated(self, method: str, path: str) -> bool:
        return method == "POST" and _norm(path) in self.gated


def _norm(path: str) -> str:
    return path.rstrip("/") or "/"


def openai_style(path: str) -> bool:
    """Paths an OpenAI-compatible URL fallback understands: /v1/..."""
    return path.startswith("/v1/")


class Fallback:
    """--fallback URL (an OpenAI-compatible base such as https://api.example.com/v1) or
    --fallback @HOST:PORT (another local engine, gated on its own lane)."""

    __slots__ = ("text", "url", "backend")

    def __init__(self, text: str):
        self.text = text.strip()
        self.url = self.backend = None
        if self.text.startswith("@"):
            self.backend = self.text[1:]
        else:
            self.url = self.text.rstrip("/")

    def target(self, path_qs: str) -> str | None:
        """The URL a request for path_qs goes to at a URL fallback, or None when it cannot go
        there (an Ollama- or llama.cpp-native path)."""
        if self.url is None or not openai_style(path_qs):
            return None
        return self.url + path_qs[len("/v1"):]   # a base URL as the OpenAI SDK takes it


def parse_fallback(text: str) -> Fallback:
    """A Fallback, or ValueError with the reason (a usage error)."""
    fallback = Fallback(text)
    if fallback.backend is not None:
        from ..key import lane_for

        lane_for(fallback.backend)   # BackendError (a ValueError) for a malformed one
        return fallback
    from urllib.parse import urlsplit

    parts = urlsplit(fallback.url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--fallback {text!r}: expected an http(s):// base URL such as "
                         "https://api.example.com/v1, or @HOST:PORT for another local engine")
    return fallback
