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
is asked once (engine.py: GETs that cost the engine nothing), else the witness's when it knows
it; a request that comes while it is being asked waits for the answer; one that cannot be told
is asked again after a pause, its requests meanwhile unpinned.

A seat past the engine's slots is never pinned: llama-server defers a task whose id_slot names
no slot until that slot frees, which is never -- the request would hang. llama.cpp's slot count
is asked once with its kind (engine_slots.py); llama-swap's differs per model and is not asked.

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
    """What pinning needs to know of the engine: its kind, and llama.cpp's slot count."""

    def __init__(self, url: str, say):
        self.url, self.say = url, say
        self.kind: str | None = None
        self.slots: int | None = None   # llama.cpp's slot count (None: not known)
        self._asked_at = float("-inf")
        self._asking: asyncio.Future | None = None
        self._said = False
        self._past_said: set = set()

    async def slot_of(self, seat: int, witness) -> int | None:
        """The engine's slot for seat (seat - 1), or None: the engine reads no id_slot, or has
        no slot for this seat."""
        # A request that comes while the kind is being asked waits for that answer (it would
        # go unpinned, and take any slot); after a failed ask, not for ASK_AGAIN seconds.
        if self.kind is None and (self._asking is not None
                                  or time.monotonic() - self._asked_at >= ASK_AGAIN):
            await self._ask()
        known = self.kind or getattr(getattr(witness, "engine", None), "kind", None)
        if known not in KINDS:
            return None
        if self.slots is not None and seat > self.slots:
            if seat not in self._past_said:
                self._past_said.add(seat)
                self.say.warn(f"--pin-slots: seat {seat} has no slot of its own on {self.url} "
                              f"({self.slots} slots): its requests go unpinned (lanelock seats "
                              "-b BACKEND auto sets the lane's seats to the engine's slots)")
            return None
        return seat - 1

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
            kind = engine.detect()
        except engines.CannotWitness as error:
            kind = error.kind
        except engines.Unreadable as error:
            if not self._said:
                self._said = True
                self.say.warn(f"--pin-slots: cannot tell which engine {self.url} is ({error}); "
                              "its requests go unpinned until it can be told")
            return None
        if kind == engines.LLAMA_CPP:   # its slots first: a kind known is a kind pinned
            from ..engine_slots import CannotTell, slot_count

            try:
                self.slots = slot_count(self.url)
            except CannotTell:
                self.slots = None
        self.kind = kind
        if kind not in KINDS and not self._said:
            self._said = True
            self.say.note(f"--pin-slots: {self.url} is {self.kind or 'an engine'} that reads "
                          f"no {FIELD}: its requests go as they came")
        return self.kind
