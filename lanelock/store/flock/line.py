"""The flock store's medium for the order (store/order.py): a waiting turn's entry is a locked file
in the lane's queue directory (queue.py), the clock is CLOCK_MONOTONIC (one for every process of
the machine), and every wait is a kernel wait -- on the lane's lock, or on the lock of the entry
just ahead -- in this thread (waiting.wait) or in the event loop (waiting.wait_async)."""

from __future__ import annotations

import time

from ..order import Line, QueueBroken
from . import queue, waiting

# How often a waiter looks again when the entry ahead cannot be opened to wait on (only a file
# made unreadable by hand: lanelock's own are 0644 whatever the umask).
UNREADABLE_LOOK = 0.1


class FlockLine(Line):
    # -- the order: one reading of the clock for who is ahead and the next step ---------------------
    def look(self, cancel=None) -> tuple:
        now = time.monotonic_ns()
        try:
            return self.ticket.ahead(now), self.ticket.next_step(now)
        except OSError as error:
            raise QueueBroken(error.strerror or str(error)) from None

    async def look_async(self) -> tuple:
        import asyncio

        # a listing and a lock attempt per entry ahead: off the loop's thread
        return await waiting.finished(asyncio.ensure_future(asyncio.to_thread(self.look)))

    # -- the lane's lock: its one lock, or any of its seats (seating.taker) ------------------------
    def lock(self, timeout: float | None, cancel=None) -> bool:
        return self.handle.taker.lock(timeout, cancel)

    async def lock_async(self, timeout: float | None) -> bool:
        return await self.handle.taker.lock_async(timeout)

    def checked(self, got: bool) -> bool | None:
        return self.handle.taker.checked(got)

    def keeps_changing(self):
        return self.store.keeps_being_replaced(self.handle)

    def hand_on(self) -> None:
        self.store.hand_on(self.handle)

    def waiting_at_or_above(self, rank: int) -> bool:
        return self.store.waiting_at_or_above(self.handle, rank)

    def sees_stop(self, entry) -> bool:
        return True   # every waiter is a process of this machine

    # -- the entry ahead ---------------------------------------------------------------------------------
    def behind(self, entry, timeout: float | None, cancel=None) -> None:
        if queue.is_mine(entry):   # a turn of this process: no kernel wait, no thread
            queue.wait_mine(entry, timeout, cancel)
            return
        wait = self._entry_wait(entry)
        if wait is _UNREADABLE:
            time.sleep(_pause(timeout))
        elif wait is not None:
            try:
                waiting.wait(wait, timeout, cancel)
            except OSError:
                pass   # the entry ahead went away as we waited: look again
            finally:
                wait.close()

    async def behind_async(self, entry, timeout: float | None) -> None:
        import asyncio

        if queue.is_mine(entry):
            await queue.wait_mine_async(entry, timeout)
            return
        wait = self._entry_wait(entry)
        if wait is _UNREADABLE:
            await asyncio.sleep(_pause(timeout))
        elif wait is not None:
            try:
                await waiting.wait_async(wait, timeout)
            except OSError:
                pass
            finally:
                wait.close()

    def _entry_wait(self, entry):
        """A descriptor on the entry ahead to wait on; None when it left as we looked (look again
        at once), _UNREADABLE when it cannot be opened (a hand-made 0600: look again soon)."""
        try:
            return queue.EntryWait(self.ticket.queue, entry)
        except FileNotFoundError:
            return None
        except OSError:
            return _UNREADABLE

    def leave(self) -> None:
        if self.ticket is not None:
            self.ticket.leave()


_UNREADABLE = object()


def _pause(timeout: float | None) -> float:
    return UNREADABLE_LOOK if timeout is None else min(timeout, UNREADABLE_LOOK)
