"""Which requests hold the lane, and which fallbacks may take them.

Gate by default: every request that can make the engine compute holds the lane -- any method but
GET, HEAD and OPTIONS, on any path that is not on the list of cheap endpoints (token counting and
templating: llama.cpp's /tokenize, /detokenize, /apply-template; Anthropic's and OpenAI's token
counters; Ollama's /api/show). An endpoint an engine adds next year is gated until someone lists
it as cheap; the `proxy_cheap_paths` setting replaces the list.

The decision is made on the raw request path -- the very bytes the proxy forwards -- and a cheap
path must match exactly: a dot segment, a doubled or trailing slash or a percent-encoding never
makes a request cheap (issue 24: /./v1/chat/completions was judged ungated, then forwarded
normalised, and generated beside the holder).

A read is gated too when it can make the engine load a model: llama-swap's passthrough
`/upstream/MODEL/...` starts MODEL for any method (a GET of its /health swaps out the model the
holder generates with). That one is judged on the path as the engine will read it (percent-decoded,
dot segments and doubled slashes resolved, any case), so no spelling of it passes ungated.
"""

from __future__ import annotations

from .dialects import FALLBACK_KINDS

DEFAULT_CHEAP = (
    "/tokenize", "/detokenize", "/apply-template",     # llama.cpp
    "/v1/messages/count_tokens",                        # Anthropic Messages
    "/v1/responses/input_tokens",                       # OpenAI Responses
    "/api/show",                                        # Ollama: a model's details
)
# Methods that read: no engine computes for them (models, health, props, slots, metrics).
READS = frozenset({"GET", "HEAD", "OPTIONS"})
# Paths under which any method may load a model (llama-swap's passthrough).
LOADS = ("/upstream",)


class Routes:
    def __init__(self, cheap=None):
        self.cheap = frozenset(DEFAULT_CHEAP if cheap is None else cheap)

    def is_gated(self, method: str, raw_path: str) -> bool:
        """raw_path: the request target as received, query removed."""
        if method not in READS:
            return raw_path not in self.cheap
        return loads_a_model(raw_path)


def loads_a_model(raw_path: str) -> bool:
    """Is raw_path, read the way a server routes it, under a path that loads a model?"""
    import posixpath
    from urllib.parse import unquote

    path = posixpath.normpath("/" + unquote(raw_path).lower())
    path = "/" + path.lstrip("/")   # normpath keeps a leading '//'
    return any(path == prefix or path.startswith(prefix + "/") for prefix in LOADS)


class Fallback:
    """--fallback [KIND=]URL (a base URL of an API of that kind: openai, the default, such as
    https://api.openai.com/v1; anthropic, such as https://api.anthropic.com) or --fallback
    @HOST:PORT (another local engine, gated on its own lane; it takes every dialect)."""

    __slots__ = ("text", "url", "backend", "kind")

    def __init__(self, text: str):
        self.text = text.strip()
        self.url = self.backend = self.kind = None
        if self.text.startswith("@"):
            self.backend = self.text[1:]
            return
        kind, sep, rest = self.text.partition("=")
        if sep and kind.lower() in FALLBACK_KINDS:
            self.kind, self.url = kind.lower(), rest.strip().rstrip("/")
        else:
            self.kind, self.url = "openai", self.text.rstrip("/")

    def serves(self, dialect) -> bool:
        return self.backend is not None or dialect.fallback_kind == self.kind

    def target(self, raw_path_qs: str) -> str | None:
        """The URL a request goes to at this URL fallback (None for an @ engine)."""
        if self.url is None:
            return None
        strip = FALLBACK_KINDS[self.kind]["strip"]
        path = raw_path_qs[len(strip):] if strip and raw_path_qs.startswith(strip + "/") \
            else raw_path_qs
        return self.url + path


def parse_fallback(text: str) -> Fallback:
    """A Fallback, or ValueError with the reason (a usage error)."""
    fallback = Fallback(text)
    if fallback.backend is not None:
        from ..lanes import lane_for

        lane_for(fallback.backend)   # BackendError (a ValueError) for a malformed one
        return fallback
    from urllib.parse import urlsplit

    parts = urlsplit(fallback.url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        examples = ", ".join(f"{kind}={info['example']}" for kind, info in FALLBACK_KINDS.items())
        raise ValueError(f"--fallback {text!r}: expected an http(s):// base URL (optionally "
                         f"KIND=URL: {examples}), or @HOST:PORT for another local engine")
    return fallback
