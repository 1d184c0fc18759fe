"""Which requests hold the lane.

Gate by default: every request that can make the engine compute holds the lane -- any method but
GET, HEAD and OPTIONS, on any path that is not on the list of cheap endpoints (token counting and
templating: llama.cpp's /tokenize, /detokenize, /apply-template; Anthropic's and OpenAI's token
counters; Ollama's /api/show). An endpoint an engine adds next year is gated until someone lists
it as cheap; the `proxy_cheap_paths` setting replaces the list.

The decision is made on the raw request path -- the very bytes the proxy forwards -- and a cheap
path must match exactly: a dot segment, a doubled or trailing slash or a percent-encoding never
makes a request cheap (a normalised /./v1/chat/completions judged cheap would generate beside the
holder).

A read is gated too when it can make the engine load a model: llama-swap's passthrough
`/upstream/MODEL/...` starts MODEL for any method (a GET of its /health swaps out the model the
holder generates with). That one is judged on the path as the engine will read it (percent-decoded,
dot segments and doubled slashes resolved, any case), so no spelling of it passes ungated. So
are llama-swap's reads routed by `?model=` (GET /v1/audio/voices, GET /sdapi/v1/loras: each
loads the model it names), with or without a query.
"""

from __future__ import annotations

from .request_model import QUERY_PATHS

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
    return path.rstrip("/") in QUERY_PATHS or any(
        path == prefix or path.startswith(prefix + "/") for prefix in LOADS)
