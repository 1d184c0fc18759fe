"""Models as the engine names them: which model a request will run, by the engine's own rules, so
that one model is one lane whatever the spelling.

The engine's kind is asked once (GET /running: llama-swap; GET /api/version: Ollama; anything
else: an engine of one name per model), again at most every REREAD seconds while it does not
answer. Only GETs that load nothing.

- llama-swap: /upstream/PATH is routed by its path's segments, empty ones skipped, joined one by
  one until they name a model it knows (findModelInPath): the first that does. Its models are its
  GET /v1/models list (read once, and again on a miss at most every REREAD seconds) and the model
  map's names (models.py: `lanelock models alias` puts an alias on its model's lane). A path that
  names no known model is read as its first segment (llama-swap answers 400 and runs nothing).
- Ollama: `NAME` is `NAME:latest`, the `library/` namespace and the registry.ollama.ai host are
  implied, and names are compared without case: a name's shortest spelling keys its lane
  (`library/Llama3:latest` is `llama3`), which is the spelling `lanelock run -m llama3` uses.
"""

from __future__ import annotations

import json
import time
from urllib.parse import unquote

LLAMA_SWAP, OLLAMA, PLAIN = "llama-swap", "ollama", "plain"
REREAD = 1.0          # seconds between two reads of the kind, or of llama-swap's list
TIMEOUT = 1.0         # seconds one GET may take
MAX_BYTES = 1 << 20   # an answer larger than this is not read
UPSTREAM = "/upstream/"
OLLAMA_HOST, OLLAMA_NAMESPACE, OLLAMA_TAG = "registry.ollama.ai", "library", "latest"


def ollama_name(name: str) -> str:
    """An Ollama model name's shortest spelling: host, namespace and tag left out where they are
    the defaults, lower case."""
    name = name.strip().lower()
    parts = name.split("/")
    if len(parts) == 3 and parts[0] == OLLAMA_HOST:
        parts = parts[1:]
    if len(parts) == 2 and parts[0] == OLLAMA_NAMESPACE:
        parts = parts[1:]
    base, colon, tag = parts[-1].partition(":")
    if colon and tag == OLLAMA_TAG:
        parts[-1] = base
    return "/".join(parts)


def upstream_segments(path: str) -> list[str] | None:
    """The non-empty segments of /upstream/PATH, decoded as llama-swap's router reads them;
    None for another path."""
    if not path.startswith(UPSTREAM):
        return None
    return [part for part in unquote(path[len(UPSTREAM):]).strip().split("/") if part]


def first_known(segments: list[str], known) -> str | None:
    """llama-swap's findModelInPath: segments joined one by one, the first that is known."""
    name = ""
    for part in segments:
        name = f"{name}/{part}" if name else part
        if name in known:
            return name
    return None


class EngineNames:
    """What one engine calls its models (its kind, llama-swap's list), asked over the proxy's
    aiohttp session."""

    def __init__(self, backend_url: str):
        self.url = backend_url.rstrip("/")
        self.kind: str | None = None
        self._kind_at = float("-inf")
        self._ids: frozenset = frozenset()
        self._ids_at = float("-inf")
        # One question at a time: a request that comes while the engine is asked waits for its
        # answer, never goes on with what was known before (two lanes for one model).
        self._asking = None

    def _lock(self):
        import asyncio

        if self._asking is None:
            self._asking = asyncio.Lock()
        return self._asking

    async def find_kind(self, session, headers) -> str | None:
        """The engine's kind (None: it has not answered yet)."""
        if self.kind is not None:
            return self.kind
        async with self._lock():
            if self.kind is None and time.monotonic() - self._kind_at >= REREAD:
                await self._ask_kind(session, headers)
        return self.kind

    async def _ask_kind(self, session, headers) -> None:
        self._kind_at = time.monotonic()
        running = await self._get(session, "/running", headers)
        if running is not None:
            if isinstance(running, dict) and isinstance(running.get("running"), list):
                self.kind = LLAMA_SWAP
                return
            version = await self._get(session, "/api/version", headers)
            self.kind = OLLAMA if isinstance(version, dict) and "version" in version else PLAIN

    async def upstream_model(self, session, headers, segments: list[str], aliases) -> str | None:
        """The model llama-swap runs for /upstream/ segments (aliases: the map's names)."""
        if not segments:
            return None
        found = first_known(segments, self._ids | set(aliases))
        if found is None:
            async with self._lock():
                if time.monotonic() - self._ids_at >= REREAD:
                    await self._read_ids(session, headers)
                found = first_known(segments, self._ids | set(aliases))
        return found or segments[0]

    async def _read_ids(self, session, headers) -> None:
        self._ids_at = time.monotonic()
        listed = await self._get(session, "/v1/models", headers)
        data = listed.get("data") if isinstance(listed, dict) else None
        if isinstance(data, list):
            self._ids = frozenset(entry["id"] for entry in data
                                  if isinstance(entry, dict) and isinstance(entry.get("id"), str))

    async def _get(self, session, path: str, headers):
        """GET path's JSON; None when the engine did not answer, {} for an answer that is no
        JSON or not 200 (it answered: it is no engine of that kind)."""
        import asyncio

        from aiohttp import ClientError, ClientTimeout

        try:
            async with session.get(self.url + path, headers=headers, allow_redirects=False,
                                   timeout=ClientTimeout(total=TIMEOUT)) as answer:
                if answer.status != 200:
                    return {}
                body = await answer.content.read(MAX_BYTES + 1)
        except (ClientError, OSError, asyncio.TimeoutError):
            return None
        try:
            return json.loads(body) if len(body) <= MAX_BYTES else {}
        except ValueError:
            return {}
