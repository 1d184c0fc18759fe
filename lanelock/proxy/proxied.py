"""One request through the proxy, as one object passed from step to step.

What it asked (its target, body, dialect, model, session, class and wait), the lane's answer (the
turn, its state and reason) and what was relayed (the status, whether the answer reached its end,
how it was cut). The access-log middleware makes it; the handler fills what it learns and hands
it on explicitly -- to the relay, the fallback chain, the turn's end and the -v line.

Invariant: `target` is the raw request target as received, and it is both the target judged
(cheap or gated, routes.py) and the target forwarded: nothing here ever normalises it.
"""

from __future__ import annotations

import time

from ..gate import HELD

STATE = "X-Lanelock-State"
REASON = "X-Lanelock-Reason"
SEAT = "X-Lanelock-Seat"     # the seat a held request holds (1 on a lane of one seat)
SLOT = "X-Lanelock-Slot"     # the engine slot a pinned request was sent to (--pin-slots)

# How an answer that did not reach its end ended (the turn's release says it: never "cleanly").
CUT = {"engine": "the engine cut the answer", "client": "the client hung up mid-answer",
       "lost": "the lane was lost mid-answer (the lane store ended its session)"}
GONE_BEFORE = "the client hung up before the answer"


class Proxied:
    """A request's state from its first byte to the -v line. http: aiohttp's request (method,
    headers, the connection); every other field is lanelock's."""

    __slots__ = ("http", "target", "path", "body", "_fields", "dialect", "model", "session",
                 "asked", "turn", "state", "status", "done", "cut", "timing", "fallback",
                 "lane", "options", "seat", "slot", "own", "recording")

    def __init__(self, http):
        self.http = http
        self.target = http.raw_path            # path and query, byte for byte as received
        self.path = self.target.partition("?")[0]
        self.body = b""
        self._fields: dict | None = {}         # the body's JSON object ({}: none), once read
        self.dialect = None                    # dialects.Dialect of a gated request
        self.model: str | None = None
        self.session: str | None = None
        self.asked = None                      # class_and_wait.Asked: the class and wait applied
        self.turn = None                       # the lane's answer: the Turn taken for it
        self.state: str | None = None          # X-Lanelock-State of what was relayed
        self.status: int | None = None         # the relayed answer's status, once it came
        self.done = False                      # relayed to its last byte
        self.cut: str | None = None            # why the relayed answer stopped short (CUT)
        self.timing: Timing | None = None      # a gated request's wait and hold
        self.fallback: str | None = None       # the fallback that answered ("fallback 1 URL")
        self.lane = None                       # per_lane.Lane of a gated request: its lane's
        self.options = None                    # the ProxyOptions in force when it came
        self.seat: int | None = None           # the seat a held request ran on
        self.slot: int | None = None           # the engine slot it was pinned to (--pin-slots)
        self.own = False                       # the proxy's own answer (own.py): not logged
        # A forward-first turn's naming and record (app.py), under way while its request goes.
        self.recording = None

    @property
    def method(self) -> str:
        return self.http.method

    @property
    def remote(self) -> str:
        return self.http.remote or "?"

    def read_fields(self, body: bytes) -> None:
        """The body, and its JSON object ({}: none). A body two JSON readers read differently
        raises request_model.Disagree when the fields are read, for a gated request only."""
        self.body = body
        self._fields = None

    @property
    def fields(self) -> dict:
        if self._fields is None:
            from . import request_model

            # A form where the engine reads a form is no JSON; anywhere else gjson would still
            # look for a JSON object in it (request_model.py).
            form = self.path in request_model.FORM_PATHS and request_model.is_form(
                self.http.headers.get("Content-Type", ""))
            self._fields = {} if form else request_model.json_fields(self.body)
        return self._fields

    def ended(self) -> str | None:
        """How a relayed answer ended when it did not reach its end (relay.py's words), else
        None. A stream relayed to its last byte is whole even if the client hung up after."""
        if self.done:
            return None
        if self.cut:
            return self.cut
        return CUT["client"] if self.status is not None else GONE_BEFORE

    def log_line(self, response, started: float) -> str:
        """The -v line: [session] (a gated request's), method, target, status, state, the seat
        and pinned slot it held, the fallback that answered or how it was cut, time."""
        state = response.headers.get(STATE, "-") if response is not None else self.state or "-"
        # A stream relayed to its last byte is an answer even if the client hung up before the
        # handler returned (curl closes right after [DONE]); one the engine cut is the engine's.
        status = response.status if response is not None else (
            self.status if self.done or self.cut == CUT["engine"] else "client gone")
        if self.seat is not None:
            state += f" on seat {self.seat}" + (f", slot {self.slot}" if self.slot is not None
                                                 else "")
        if self.cut == CUT["engine"] and not self.done:
            state += f", {CUT['engine']}"
        # A gated request's wait and hold apart: a long time in the queue is the others'
        # holds, not this one's.
        took = f"{time.monotonic() - started:.3f}s" if self.timing is None else str(self.timing)
        session = f"[{self.session[:200]}] " if self.session else ""
        by = f" by {self.fallback}" if self.fallback else ""
        return f"proxy: {session}{self.method} {self.target[:200]} {status} {state}{by} {took}"


class Timing:
    """A gated request's time waiting for the lane and holding it (the -v line, Retry-After)."""

    __slots__ = ("waited", "_held_from")

    def __init__(self):
        self.waited = 0.0
        self._held_from: float | None = None

    def held_from(self, state: str) -> None:
        if state == HELD:
            self._held_from = time.monotonic()

    def held_until_now(self) -> float:
        return 0.0 if self._held_from is None else time.monotonic() - self._held_from

    def __str__(self) -> str:
        held = f", held {self.held_until_now():.3f}s" if self._held_from is not None else ""
        return f"(waited {self.waited:.3f}s{held})"
