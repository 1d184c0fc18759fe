"""The PostgreSQL store's medium for the order (store/order.py): a waiting turn's entry is a row of
lanelock_queue and a session advisory lock on its ticket (queue.py), the clock is the server's
(one for every host), and every wait -- for the lane's advisory lock, or for the ticket lock of
the entry just ahead -- is a try, then a sleep on the session's LISTEN until a wake-up
(queue.until_taken): no statement waits in the server, so none times out or is cancelled."""

from __future__ import annotations

from ...errors import GateUnavailable
from ..order import Line, QueueBroken
from . import queue as pg_queue
from .session import ended


class PgLine(Line):
    listening = False   # this session LISTENs on the queue's channel (queue.wait_behind)

    def look(self, cancel=None) -> tuple:
        # who is ahead and this ticket's next step: one query, one statement_timestamp()
        # (read with the try when the lock was just taken: store.taken_queue)
        return self._queue(pg_queue.ahead_and_step, self.handle.lane, self.ticket,
                           self.store.aging, self.store.taken_queue(self.handle),
                           default=(None, None))

    def lock(self, timeout: float | None, cancel=None) -> bool:
        if self.handle.cancelled:
            return False
        return self.handle.taker.lock(timeout, cancel)   # its one lock, or any of its seats

    def checked(self, got: bool) -> bool:
        return got

    def hand_on(self) -> None:
        self.store.unlock_lane(self.handle)

    def waiting_at_or_above(self, rank: int) -> bool:
        return self.store.waiting_at_or_above(self.handle, rank)

    def sees_stop(self, entry) -> bool:
        return entry.here()   # a waiter of this host: its state can be read

    def behind(self, entry, timeout: float | None, cancel=None) -> None:
        if not self.listening:
            self._queue(pg_queue.listen, default=None)
            self.listening = True
        self._queue(pg_queue.wait_behind, entry, timeout,
                    lambda: self.handle.cancelled or (cancel is not None and cancel.is_set()),
                    default=None)

    def _queue(self, function, *args, default):
        """A queue statement; its error (a deadlock the server broke, a missing table) is
        QueueBroken -- the walk then waits in the server's order -- unless the wait was cancelled
        (the cancel is the error): then default, and the walk sees the cancel; or the session
        ended (a restart): GateUnavailable, and the wait connects again (store.wait_lock)."""
        if self.handle.cancelled:
            return default
        try:
            return self.store.queue_call(self.handle, function, *args)
        except GateUnavailable as error:
            if self.handle.cancelled:
                return default
            if ended(self.handle.conn):
                raise   # the session is gone, not the queue: the wait connects again
            self.store.queue_unusable(error)
            raise QueueBroken(str(error)) from None

    def leave(self) -> None:
        if self.ticket is None or self.handle.cancelled:
            return   # a cancelled session is closed with its ticket lock
        if self.handle.held:   # the lane is this turn's: left with its next statement (handoff.py)
            self.handle.leaving = (self.ticket, self.listening)
            return
        try:
            self.store.queue_call(self.handle, pg_queue.leave, self.ticket, self.listening)
        except GateUnavailable:
            pass   # the session is gone: its ticket lock with it
