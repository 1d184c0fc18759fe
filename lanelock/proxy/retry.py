"""Retry-After of a busy answer: about when the lane comes to this request's place.

The rule is estimate.py's (status shows the same estimate beside each waiter): a typical hold --
the median of this proxy's recent holds, else of the lane's journal -- for what is left of the
holder's turn, then one hold for each waiter that goes before a request of this class: the
waiters of its class and higher (a retry queues behind those of its own class) -- never less, for
a holder, than the rest of its own session's median hold (the journal's last hour): a proxy whose
own requests are short must not promise a lane that a long session holds. The store is read off
the event loop.

The journal's last hour is read at most once every FRESH seconds, whatever the number of busy
answers: read per answer, a busy proxy read megabytes per request (its own journal growing with
every turn) and its memory grew with them (+70% over 10,000 requests, tests/test_proxy_memory.py).
A median a few seconds old is as good an estimate.
"""

from __future__ import annotations

import asyncio
import math
import time

from ..estimate import KEPT, ahead, journal_figures, median, until_lane

FRESH = 5.0   # seconds a reading of the journal answers for


class RetryAfter:
    def __init__(self, gate):
        self.gate = gate
        self.holds: list[float] = []   # this proxy's recent holds, in seconds
        self._read: tuple = (-math.inf, None, {})   # (monotonic read at, typical, by session)

    def held(self, seconds: float) -> None:
        """A turn of this proxy held the lane this long (the lane taken to the answer's end)."""
        self.holds = (self.holds + [seconds])[-KEPT:]

    async def seconds(self, holder: dict | None, priority: str) -> int:
        holder = holder or {}
        seated = holder.get("holders") if isinstance(holder.get("holders"), list) else [holder]
        journal_typical, by_session = await self._journal()
        medians = tuple(by_session.get((one or {}).get("session")) for one in seated)
        typical = median(self.holds) if self.holds else journal_typical
        if typical is None:
            if not any(medians):
                return 1
            typical = 0.0   # the holders' own medians are all that is known
        queue = await asyncio.to_thread(self._queue)
        held = [(one or {}).get("held_for") or 0.0 for one in seated] or [0.0]
        return until_lane(typical, held[0], ahead(queue, priority),
                          holder.get("seats") or 1, tuple(held[1:]), medians)

    async def _journal(self) -> tuple:
        """(the lane's typical hold, {session: its median hold}) of the journal's last hour,
        read again once FRESH seconds have passed since the last reading."""
        read_at, typical, by_session = self._read
        if time.monotonic() - read_at >= FRESH:
            typical, by_session = await asyncio.to_thread(journal_figures, self.gate.store,
                                                          self.gate.lane)
            self._read = (time.monotonic(), typical, by_session)
        return typical, by_session

    def _queue(self) -> list[dict]:
        try:   # as a turn asks: never /proc/locks on a busy answer's path (client_process.py)
            return self.gate.store.waiting(self.gate.lane)
        except Exception:  # noqa: BLE001 - an estimate is a nicety
            return []
