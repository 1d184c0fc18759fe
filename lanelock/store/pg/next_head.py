"""The release on the PostgreSQL store: no gap for another host's later waiter.

A holder that lets the lane go while a turn of its host waits first makes sure that turn's head
(its host's first live waiter: hostqueue.py) has its row in the lane's server queue: otherwise
another host's later waiter would find the lane free and take it in the gap (no barging across
hosts). The wait is woken by the head's ring (it rings its entry once joined: flock/queue.py
Ticket.ring) and is bounded (NEXT_JOIN). A head that gives the lane way (hostqueue.give_way)
waits the same way for the turn it stands aside for.
"""

from __future__ import annotations

import threading
import time

NEXT_JOIN = 2.0     # how long a releasing holder waits for its host's next head to join
NEXT_LOOK = 0.1     # at the latest, it looks again meanwhile (a ring wakes it at once)


def head_queued(store, handle, head: str) -> bool:
    """Is this host's head (its entry on its host: head) in the lane's server queue?"""
    from ...errors import GateUnavailable
    from . import queue as pg_queue

    try:
        return any(entry.facts.get("entry") == head for entry in
                   store.queue_call(handle, pg_queue.live, handle.lane))
    except GateUnavailable:
        return True   # nothing to wait for that can be seen


def await_next_head(local, joined) -> None:
    """Before a holder lets the lane go: while a turn of this host waits and its head -- its
    first live waiter -- is not in the server's queue yet (joined(the head's entry name): one
    look; a row of its next does not count), wait for it to join, at most NEXT_JOIN
    -- woken by the ring of this host's first waiter (a head rings its entry once joined:
    Ticket.ring), looking again every NEXT_LOOK at the latest. It was a look every 10 ms: up to
    10 ms in a hand-off whose head joined a moment after the holder looked."""
    end = time.monotonic() + NEXT_JOIN
    while True:
        first = _first_here(local)
        if first is None:
            return
        with _RingWait(local, first) as ring:   # before the look: a ring after it wakes this
            if joined(first.name):
                return
            left = end - time.monotonic()
            if left <= 0:
                return
            ring.wait(min(left, NEXT_LOOK))


def _first_here(local):
    """The first live turn of this host (another than this one) in its host's queue, or None."""
    from .. import order

    found = local.flock.queue_of(local.handle)
    if found is None:
        return None
    own = local.ticket.entry.name if local.ticket is not None else None
    try:
        # in the order's order: a listing's is the directory's
        return found.first_alive(sorted((entry for entry in found.listed() if entry.name != own),
                                        key=lambda entry: order.place(entry, found.aging)))
    except OSError:
        return None


class _RingWait:
    """A wait for an entry's ring or leave, set up before the look it follows, so that one
    that comes between the look and the wait still wakes it: a descriptor on the entry's file
    of now (a ring lets that file go), or for an entry of this very process its wake-up
    registered (flock/queue.py: this process's tickets)."""

    def __init__(self, local, entry):
        from ..flock import queue

        self.entry, self.event, self.file = entry, None, None
        if queue.is_mine(entry):
            self.event = threading.Event()
            if not queue._listen(entry, self.event.set):
                self.event.set()   # left already
            return
        found = local.flock.queue_of(local.handle)
        try:
            self.file = None if found is None else queue.EntryWait(found, entry)
        except OSError:
            self.file = None   # gone already: looked at again at once

    def wait(self, timeout: float) -> None:
        from ..flock import waiting

        if self.event is not None:
            self.event.wait(timeout)
        elif self.file is not None:
            try:
                waiting.wait(self.file, timeout)
            except OSError:
                pass   # looked at again

    def __enter__(self) -> "_RingWait":
        return self

    def __exit__(self, *exc) -> None:
        from ..flock import queue

        if self.event is not None:
            queue._forget(self.entry, self.event.set)
        if self.file is not None:
            self.file.close()
