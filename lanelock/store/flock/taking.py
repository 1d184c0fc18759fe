"""The flock store's medium for taking a lane (store/seating.py keeps every rule of the seats, and
chooses once between the lane's one lock and any of its seats): the count read as a turn opens
the lane, each seat's record, a try of seats in the order the policy gives, which seats are held,
a kernel wait on several seats' files at once -- and the lane's own lock, tried or waited on as
a lane of one seat takes it. The store (store.py) keeps the lock's own rules -- a lock taken is
checked (taken.py: a replaced file, a live holder of a removed one, a killed turn's command, the
record claimed) -- and store/order.py who goes next.
"""

from __future__ import annotations

import os

from .. import seating
from ..order import AGAIN_TRIES
from ..seating import Medium
from . import seats, taken, waiting
from .sidecar import read as read_record

_OPEN = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def count(store, handle, lane) -> None:
    """The lane's seat count and the seats past it its setter made, into the handle, as the turn
    opens the lane. A count that cannot be read or believed is said once and taken as 1: fewer
    seats can only make a turn wait longer, never run beside one too many."""
    from . import kept

    try:
        values = kept.read(handle.dir_fd)
    except (kept.Untrusted, OSError) as why:
        store.seat_warning(f"{store.path(kept.NAME)}: {getattr(why, 'strerror', None) or why}; "
                           "taking every lane as one seat")
        values = {}
    if values is None:   # nothing was ever kept: no seats, no folder to look in
        return
    handle.lane = lane.name
    handle.seats, problem = seating.reckon(values.get(seating.key(lane.name)), lane.name)
    if problem:
        store.seat_warning(f"{store.path(kept.NAME)}: {problem}")
    handle.past = tuple(seat for seat in seats.made(values, lane.name) if seat > handle.seats)


class FlockSeats(Medium):
    """The flock store's medium for taking a lane (seating.py): each seat a lock file, each
    record a sidecar beside it, every wait a kernel wait -- on the lane's lock, or on the seats'
    files at once."""

    # -- the lane's own lock (seating.OneLock) -----------------------------------------------------
    def try_lane(self) -> bool:
        store, handle = self.store, self.handle
        for _ in range(AGAIN_TRIES):
            ours = self.checked(store.try_lane_lock(handle), claim=False)
            if ours is not None:
                return ours
        raise store.keeps_being_replaced(handle)

    def lock_lane(self, timeout: float | None, cancel=None) -> bool:
        try:   # a zero timeout: one try without blocking (waiting.wait)
            return waiting.wait(self.handle, timeout, cancel)
        except OSError as error:
            return self.store.contended(self.handle, error)

    async def lock_lane_async(self, timeout: float | None) -> bool:
        if timeout is not None and timeout <= 0:
            return self.store.try_lane_lock(self.handle)
        try:
            return await waiting.wait_async(self.handle, timeout)
        except OSError as error:
            return self.store.contended(self.handle, error)

    def checked(self, got: bool, claim: bool) -> bool | None:
        return taken.checked(self.store, self.handle, got, claim)

    def claim(self) -> bool:
        """The lane just kept by a one-seat turn: its record claimed (taken.record_claimed), else
        the lane let go at once (busy, the reason in handle.refused)."""
        if taken.record_claimed(self.store, self.handle):
            return True
        self.store.hand_on(self.handle)
        return False

    def refused(self) -> bool:
        return self.handle.refused is not None   # a planted file, or a record another user's

    # -- the seats (seating.AnySeat) ---------------------------------------------------------------
    def records(self) -> tuple:
        handle = self.handle
        records = {seat: read_record(seats.record_name(seats.lock_name(handle.stem, seat)),
                                     dir_fd=handle.dir_fd)[0]
                   for seat in range(1, handle.seats + 1)}
        return handle.seats, handle.past, records, None   # held: a lock try each; died_ago asks

    def try_seats(self, order: list) -> int | None:
        store, handle = self.store, self.handle
        handle.seat_refused = []
        for seat in order:
            store.on_seat(handle, seat)
            for _ in range(AGAIN_TRIES):
                ours = self.checked(store.try_lane_lock(handle), claim=True)
                if ours is not None:
                    break
            else:
                raise store.keeps_being_replaced(handle)
            if ours and self._counted(seat):
                return seat
        return None

    def held(self, numbers) -> set:
        handle = self.handle
        return {seat for seat in numbers
                if seat != handle.seat and seats.held(handle.dir_fd, handle.stem, seat)}

    def let_go(self) -> None:
        self.store.hand_on(self.handle)

    def wait_any(self, numbers: list, timeout: float | None, cancel=None):
        busy, opened = self._openable(numbers)
        if not opened:   # every seat planted (each said): nothing a wait could ever get
            return None
        got = None
        try:
            got = waiting.wait_any(opened, timeout, cancel)
            return self._got(busy, opened, got)
        finally:
            _close(opened)

    async def wait_any_async(self, numbers: list, timeout: float | None):
        busy, opened = self._openable(numbers)
        if not opened:
            return None
        try:
            return self._got(busy, opened, await waiting.wait_any_async(opened, timeout))
        finally:
            _close(opened)   # a cancelled task closes its seat files now

    def _got(self, busy: list, opened: list, got: int | None) -> int | None:
        """The seat whose lock the wait got, its descriptor now the handle's (the walk decides
        whether to keep it; the order's take checks it as any lock taken)."""
        if got is None:
            return None
        self.store.on_seat(self.handle, busy[got], opened[got].fd)
        opened[got].fd = None
        return busy[got] if self._counted(busy[got]) else seating.AGAIN

    def _counted(self, seat: int) -> bool:
        """A seat >= 2 just taken: is it within the count as kept now? A count made smaller
        since this turn read it may have had its seats past it forgotten (store.forget_seats,
        which asks who holds them after the new count is kept): such a seat is let go, and the
        handle takes the count as it is now."""
        handle = self.handle
        if seat <= 1 or handle.lane is None:
            return True
        from . import kept

        try:
            values = kept.read(handle.dir_fd) or {}
        except (kept.Untrusted, OSError):
            values = {}
        count = seating.reckon(values.get(seating.key(handle.lane)), handle.lane)[0]
        if seat <= count:
            return True
        handle.seats = count
        handle.past = tuple(other for other in seats.made(values, handle.lane) if other > count)
        self.store.hand_on(handle)
        return False

    def _openable(self, numbers: list) -> tuple:
        """(the seats, their files) that can be waited on: a seat whose file is planted
        (seats.Planted: its reason is in handle.seat_refused) is left out, never a crash."""
        handle = self.handle
        kept, opened = [], []
        for seat in numbers:
            try:
                opened.append(_SeatFile(handle.dir_fd, handle.stem, seat))
            except (seats.Planted, OSError):
                continue
            kept.append(seat)
        return kept, opened


def _close(opened: list) -> None:
    for seat_file in opened:
        seat_file.close()


class _SeatFile:
    """A seat's lock file opened to wait on (waiting.wait_any), never created here: a seat a
    turn waits on exists (it was held)."""

    __slots__ = ("fd",)

    def __init__(self, dir_fd: int, stem: str, seat: int):
        self.fd = None
        if seat == 1:
            self.fd = os.open(seats.lock_name(stem, 1), _OPEN, dir_fd=dir_fd)
        else:
            self.fd = seats.open_seat(dir_fd, stem, seat)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
