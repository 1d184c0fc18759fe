"""Retry-After of a busy answer: about when the lane comes to this request's place.

The rule is estimate.py's (status shows the same estimate beside each waiter): a typical hold --
the median of this proxy's recent holds, else of the lane's journal -- for what is left of the
holder's turn, then one hold for each waiter that goes before a request of this class: the
waiters of its class and higher (a retry queues behind those of its own class) -- never less, for
a holder, than the rest of its own session's median hold (the journal's last hour): a proxy whose
own requests are short must not promise a lane that a long session holds. The store is read off
the event loop.
"""

from __future__ import annotations

import asyncio

from ..estimate import KEPT, ahead, holders_medians, journal_typical, median, until_lane


class RetryAfter:
    def __init__(self, gate):
        self.gate = gate
        self.holds: list[float] = []   # this proxy's recent holds, in seconds

    def held(self, seconds: float) -> None:
        """A turn of this proxy held the lane this long (the lane taken to the answer's end)."""
        self.holds = (self.holds + [seconds])[-KEPT:]

    async def seconds(self, holder: dict | None, priority: str) -> int:
        holder = holder or {}
        seated = holder.get("holders") if isinstance(holder.get("holders"), list) else [holder]
        medians = await asyncio.to_thread(holders_medians, self.gate.store, self.gate.lane,
                                          seated)
        typical = median(self.holds) if self.holds else \
            await asyncio.to_thread(journal_typical, self.gate.store, self.gate.lane)
        if typical is None:
            if not any(medians):
                return 1
            typical = 0.0   # the holders' own medians are all that is known
        queue = await asyncio.to_thread(self._queue)
        held = [(one or {}).get("held_for") or 0.0 for one in seated] or [0.0]
        return until_lane(typical, held[0], ahead(queue, priority),
                          holder.get("seats") or 1, tuple(held[1:]), medians)

    def _queue(self) -> list[dict]:
        try:   # as a turn asks: never /proc/locks on a busy answer's path (client_process.py)
            return self.gate.store.waiting(self.gate.lane)
        except Exception:  # noqa: BLE001 - an estimate is a nicety
            return []
