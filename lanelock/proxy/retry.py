"""Retry-After of a busy answer: about when the lane comes to this request's place.

A typical hold -- the median of this proxy's recent holds, else of the lane's journal -- counts
what is left of the holder's turn, then one hold for each waiter that goes before a request of
this class: the waiters of its class and higher (a retry queues behind those of its own class).
Holds only: a request's time in the queue is the others' holds, already counted once (a median
of whole request times, waits included, said 7 s for a lane free 2.7 s later, and the SDKs
obey it). At least 1 s; the store is read off the event loop.
"""

from __future__ import annotations

import asyncio
import math
import time

from ..priority import CLASSES

KEPT = 20   # recent holds kept


class RetryAfter:
    def __init__(self, gate):
        self.gate = gate
        self.holds: list[float] = []   # this proxy's recent holds, in seconds

    def held(self, seconds: float) -> None:
        """A turn of this proxy held the lane this long (the lane taken to the answer's end)."""
        self.holds = (self.holds + [seconds])[-KEPT:]

    async def seconds(self, holder: dict | None, priority: str) -> int:
        typical = median(self.holds) if self.holds else \
            await asyncio.to_thread(self._journal_typical)
        if typical is None:
            return 1
        queue = await asyncio.to_thread(self._queue)
        return estimate(typical, (holder or {}).get("held_for") or 0.0, ahead(queue, priority))

    def _queue(self) -> list[dict]:
        try:
            [facts] = self.gate.store.survey(self.gate.lane)
        except Exception:  # noqa: BLE001 - an estimate is a nicety
            return []
        return facts.queue

    def _journal_typical(self) -> float | None:
        try:
            events, _ = self.gate.store.events(self.gate.lane, time.time() - 3600)
        except Exception:  # noqa: BLE001 - an estimate is a nicety; 1 s is always honest
            return None
        durations = [event["duration"] for event in events[-200:] if event.get("event") ==
                     "released" and isinstance(event.get("duration"), (int, float))]
        return median(durations[-KEPT:])


def estimate(typical: float, held_for: float, waiters_ahead: int) -> int:
    """Seconds until the lane likely comes to a request: the rest of the holder's typical hold
    (none once it has held longer), then a typical hold per waiter ahead; at least 1."""
    return max(1, math.ceil(max(0.0, typical - held_for) + typical * waiters_ahead))


def ahead(queue: list[dict], priority: str) -> int:
    """The waiters (status's queue rows) that go before a request of this class arriving now:
    those whose class, as it counts now (aged), is the same or higher."""
    rank = CLASSES.index(priority)
    return sum(1 for entry in queue if CLASSES.index(entry["effective_class"]) >= rank)


def median(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
