"""The flock store's medium for the seats (store/seating.py keeps every rule of them): the count
read as a turn opens the lane, each seat's record, a try of seats in the order the policy gives,
which seats are held, and a kernel wait on several seats' files at once. The store (store.py)
keeps the lock's own rules -- a seat's lock taken is checked like the lane's (a replaced file, a
live holder of a removed one, a killed turn's command) -- and store/order.py who goes next.
"""

from __future__ import annotations

import os

from .. import seating
from ..order import AGAIN_TRIES
from ..seating import Medium
from . import seats, waiting
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
    handle.seats, problem = seating.reckon(values.get(seating.key(lane.name)), lane.name)
    if problem:
        store.seat_warning(f"{store.path(kept.NAME)}: {problem}")
    handle.past = tuple(seat for seat in seats.made(values, lane.name) if seat > handle.seats)


class FlockSeats(Medium):
    """The flock store's medium for the seat walk (seating.py): each seat a lock file, each
    record a sidecar beside it, every wait a kernel wait on the seats' files at once."""

    def __init__(self, store, handle):
        self.store, self.handle = store, handle

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
                ours = store.checked(handle, store.try_lane_lock(handle))
                if ours is not None:
                    break
            else:
                raise store.keeps_being_replaced(handle)
            if ours:
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
        return busy[got]

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


def take(store, handle, timeout: float | None, cancel=None) -> bool:
    """A seat of the lane this turn's (True, the handle on it), within timeout (0: a try)."""
    return seating.wait(FlockSeats(store, handle), _session(handle), timeout, cancel) is not None


async def take_async(store, handle, timeout: float | None) -> bool:
    return await seating.wait_async(FlockSeats(store, handle), _session(handle),
                                    timeout) is not None


def _session(handle) -> str | None:
    return (handle.asker or {}).get("session")


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
