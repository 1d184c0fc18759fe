"""Who goes first among waiting turns: the classes and their aging, defined once (a leaf: the
run path, every store, the settings, the proxy and the metrics read them from here).

A waiting turn's class rises one step per `aging` seconds waited, up to the top, so a batch
turn waits at most about two steps plus the holds of those ahead of it; then arrival decides.
"""

from __future__ import annotations

CLASSES = ("batch", "normal", "interactive")   # rank = index: higher goes first
DEFAULT_CLASS = "normal"
DEFAULT_RANK = CLASSES.index(DEFAULT_CLASS)
TOP = len(CLASSES) - 1
DEFAULT_AGING = 30.0   # seconds a waiting turn's class takes to rise one step
SPELLED = tuple(reversed(CLASSES))   # as help and choices list them: first goes first


def class_named(value) -> str | None:
    """The class a text names, whatever its case and surrounding blanks ('Interactive',
    ' BATCH '); None when it names none."""
    if not isinstance(value, str):
        return None
    folded = value.strip().lower()
    return folded if folded in CLASSES else None


def effective(rank: int, arrival_ns: int, now_ns: int, aging: float) -> int:
    """The class a waiter counts as now: one step up per `aging` seconds waited."""
    if aging <= 0:
        return rank
    return min(TOP, rank + int((now_ns - arrival_ns) / 1e9 // aging))


def order_key(rank: int, arrival: float, waited: float, aging: float, tiebreak) -> tuple:
    """Where a waiter stands at one moment (smaller goes first): effective class, then arrival
    (in the medium's own clock), then the medium's tiebreak (a name, a ticket). waited: seconds
    it has waited at that moment."""
    return (-effective(rank, 0, int(waited * 1e9), aging), arrival, tiebreak)


def next_step(rank: int, waited: float, aging: float) -> float | None:
    """Seconds until a waiter's class rises a step, from the moment it had waited `waited`
    seconds (None: at the top, or no aging). Read at the same moment as the order: a step taken
    between two readings left a waiter waiting, without a timeout, on one by then behind it."""
    if aging <= 0 or effective(rank, 0, int(waited * 1e9), aging) >= TOP:
        return None
    return aging - waited % aging + 0.001
