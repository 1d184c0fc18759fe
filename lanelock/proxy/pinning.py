"""--pin-slots: a seat of the lane is a slot of the engine, so a session that comes back to its
seat (the store gives a session its last seat back) finds its KV cache in that slot.

llama-server reads `id_slot` (0-based; -1 or absent: any idle slot) from the top level of the
JSON body of its completion endpoints -- /completion and /infill, and the OpenAI-compatible
/v1/chat/completions and /v1/completions, whose unknown fields it carries over before it reads
the task's (server-context.cpp: task.id_slot = json_value(data, "id_slot", -1)). A held request
on seat K of those paths whose body names no id_slot is sent id_slot = K - 1; one that names its
own (any value, -1 included) is the client's choice and left alone.

Only llama.cpp reads it, and llama-swap hands the body to the llama-server of the model it
names; every other engine's requests are sent as they came. The engine's kind is the witness's
when it runs, else asked once (engine.py: GETs that cost the engine nothing); one that cannot be
told is asked again after a pause, and its requests meanwhile go unpinned.

The body keeps every byte the client sent: the field is spliced in after the object's opening
brace, never by serialising the object again.
"""

from __future__ import annotations

import asyncio
import time

from .. import engine as engines

FIELD = "id_slot"
KINDS = (engines.LLAMA_CPP, engines.LLAMA_SWAP)   # the engines that read it
# The paths llama-server reads it on (llama-swap: the same under /upstream/MODEL).
PATHS = frozenset({"/completion", "/completions", "/v1/completions", "/chat/completions",
                   "/v1/chat/completions", "/infill"})
ASK_AGAIN = 5.0   # seconds before an engine whose kind could not be told is asked again


def pinned_path(path: str) -> bool:
    if path.startswith("/upstream/"):
        path = "/" + path[len("/upstream/"):].partition("/")[2]
    return path in PATHS


def with_slot(body: bytes, fields: dict, slot: int) -> bytes | None:
    """body with id_slot = slot, or None when it is not to be pinned (it names its own, or it
    is no JSON object)."""
    if not fields or FIELD in fields:   # fields: the body's JSON object ({}: none)
        return None
    opening = body.find(b"{")
    rest = body[opening + 1:]
    comma = b"" if rest.lstrip().startswith(b"}") else b","
    return body[:opening + 1] + b'"%s":%d%s' % (FIELD.encode(), slot, comma) + rest


class Pinning:
    """The engine's kind, as far as pinning needs it."""

    def __init__(self, url: str, say):
        self.url, self.say = url, say
        self.kind: str | None = None
        self._asked_at = float("-inf")
        self._asking: asyncio.Future | None = None
        self._said = False

    async def pins(self, witness) -> bool:
        """Does the engine read id_slot? (the witness's kind when it knows one)"""
        known = getattr(getattr(witness, "engine", None), "kind", None) or self.kind
        if known is None and time.monotonic() - self._asked_at >= ASK_AGAIN:
            known = await self._ask()
        return known in KINDS

    async def _ask(self) -> str | None:
        if self._asking is None:
            self._asking = asyncio.ensure_future(asyncio.to_thread(self._detect))
        try:
            return await asyncio.shield(self._asking)
        finally:
            if self._asking is not None and self._asking.done():
                self._asking = None

    def _detect(self) -> str | None:
        engine = engines.Engine(self.url)
        self._asked_at = time.monotonic()
        try:
            self.kind = engine.detect()
        except engines.CannotWitness as error:
            self.kind = error.kind
        except engines.Unreadable as error:
            if not self._said:
                self._said = True
                self.say.warn(f"--pin-slots: cannot tell which engine {self.url} is ({error}); "
                              "its requests go unpinned until it can be told")
            return None
        if self.kind not in KINDS and not self._said:
            self._said = True
            self.say.note(f"--pin-slots: {self.url} is {self.kind or 'an engine'} that reads "
                          f"no {FIELD}: its requests go as they came")
        return self.kind
