"""Retry-After of a busy answer: about when the lane comes to this request's place.

The rule is estimate.py's (status shows the same estimate beside each waiter): a typical hold --
the median of this proxy's recent holds, else of the lane's journal -- for what is left of the
holder's turn, then one hold for each waiter that goes before a request of this class: the
waiters of its class and higher (a retry queues behind those of its own class). The store is read
off the event loop.
"""

from __future__ import annotations

import asyncio

from ..estimate import KEPT, ahead, journal_typical, median, until_lane


class RetryAfter:
    def __init__(self, gate):
        self.gate = gate
        self.holds: list[float] = []   # this proxy's recent holds, in seconds

    def held(self, seconds: float) -> None:
        """A turn of this proxy held the lane this long (the lane taken to the answer's end)."""
        self.holds = (self.holds + [seconds])[-KEPT:]

    async def seconds(self, holder: dict | None, priority: str) -> int:
        typical = median(self.holds) if self.holds else \
            await asyncio.to_thread(journal_typical, self.gate.store, self.gate.lane)
        if typical is None:
            return 1
        queue = await asyncio.to_thread(self._queue)
        holder = holder or {}
        seated = holder.get("holders") if isinstance(holder.get("holders"), list) else [holder]
        held = [(one or {}).get("held_for") or 0.0 for one in seated] or [0.0]
        return until_lane(typical, held[0], ahead(queue, priority),
                          holder.get("seats") or 1, tuple(held[1:]))

    def _queue(self) -> list[dict]:
        try:   # as a turn asks: never /proc/locks on a busy answer's path (client_process.py)
            return self.gate.store.waiting(self.gate.lane)
        except Exception:  # noqa: BLE001 - an estimate is a nicety
            return []
