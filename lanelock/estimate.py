"""When the lane likely comes to a place in its queue: one rule for the proxy's Retry-After and
for `status`'s estimate beside each waiter.

A typical hold -- the median of recent holds (a proxy's own, else the lane's journal) -- counts
what is left of the holder's turn, then one hold for each waiter that goes first. Holds only: a
turn's time in the queue is the others' holds, already counted once (a median of whole request
times, waits included, said 7 s for a lane free 2.7 s later). At least 1 s.
"""

from __future__ import annotations

import math
import time

from .priority import CLASSES

KEPT = 20   # recent holds a typical hold is the median of
RECENT = 3600.0   # seconds of the journal a typical hold is read from


def until_lane(typical: float, held_for: float | None, waiters_ahead: int, seats: int = 1,
               others: tuple = (), medians: tuple = ()) -> int:
    """Seconds until the lane likely comes to a place: the rest of the holder's typical hold
    (none once it has held longer, or with no holder: held_for None), then a typical hold per
    waiter ahead; at least 1. On a lane of several seats (others: how long each other holder
    has held), each waiter ahead takes the seat that frees first, and so does the place; while
    more hold than the count (made smaller under them), the first to end free no seat.
    medians: each holder's own session's median hold (holder first, then others; None: none
    known), which its rest never promises less than -- a lane's typical hold of short turns
    said 2 s while the holder's session went on 5 s and more."""
    import heapq

    own = list(medians) + [None] * (1 + len(others) - len(medians))
    frees = sorted(max(0.0, max(typical, mine or 0.0) - held)
                   for held, mine in zip((held_for, *others), own) if held is not None)
    frees = frees[max(0, len(frees) - seats):]    # those past the count free no seat
    frees = [0.0] * (seats - len(frees)) + frees   # seats free now
    heapq.heapify(frees)
    for _ in range(waiters_ahead):
        heapq.heappush(frees, heapq.heappop(frees) + typical)
    return max(1, math.ceil(frees[0]))


def ahead(queue: list[dict], priority: str) -> int:
    """The waiters (status's queue rows) that go before a turn of this class arriving now:
    those whose class, as it counts now (aged), is the same or higher."""
    rank = CLASSES.index(priority)
    return sum(1 for entry in queue if CLASSES.index(entry["effective_class"]) >= rank)


def typical_hold(events: list[dict]) -> float | None:
    """The median of the last KEPT holds the journal's events say (`released` durations), or
    None when none is known."""
    durations = [event["duration"] for event in events[-200:] if event.get("event") == "released"
                 and isinstance(event.get("duration"), (int, float))
                 and not isinstance(event.get("duration"), bool)]
    return median(durations[-KEPT:])


def session_typical(events: list[dict]) -> dict:
    """{session: the median of its last KEPT holds} from the journal's `released` events."""
    durations: dict = {}
    for event in events[-1000:]:
        value = event.get("duration")
        if event.get("event") == "released" and isinstance(value, (int, float)) \
                and not isinstance(value, bool) and isinstance(event.get("session"), str):
            durations.setdefault(event["session"], []).append(value)
    return {session: median(values[-KEPT:]) for session, values in durations.items()}


def holders_medians(store, lane, holders: list) -> tuple:
    """Each holder's own session's median hold of the last hour (None where none is known or
    the journal cannot be read), in the holders' order."""
    try:
        events, _ = store.events(lane, time.time() - RECENT)
    except Exception:  # noqa: BLE001 - any store's failure; an estimate is a nicety
        return ()
    typical = session_typical(events)
    return tuple(typical.get((one or {}).get("session")) for one in holders)


def journal_figures(store, lane) -> tuple:
    """(typical_hold, session_typical) of the lane's journal over the last hour, from one read;
    (None, {}) when it cannot be read."""
    try:
        events, _ = store.events(lane, time.time() - RECENT)
    except Exception:  # noqa: BLE001 - any store's failure; an estimate is a nicety
        return None, {}
    return typical_hold(events), session_typical(events)


def journal_typical(store, lane) -> float | None:
    """typical_hold() of the lane's journal over the last hour; None when it cannot be read
    (an estimate is a nicety: none is always honest)."""
    try:
        events, _ = store.events(lane, time.time() - RECENT)
    except Exception:  # noqa: BLE001 - any store's failure; the caller shows no estimate
        return None
    return typical_hold(events)


def median(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
