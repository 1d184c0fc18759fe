"""Taking a seat of a flock lane (seats.py says what the seats are): the count read as a turn
opens the lane, one try of every seat in the turn's order, and the queue head's wait on every
seat at once. The store (store.py) keeps the lock's own rules -- a seat's lock taken is checked
like the lane's (a replaced file, a live holder of a removed one, a killed turn's command) --
and store/order.py keeps who goes next: this module only finds a seat.

A smaller count never evicts: seats past it that are still held count against it, so a turn
takes a seat only while fewer than the count hold (too_many).
"""

from __future__ import annotations

import fcntl
import os
import time

from .. import order
from . import seats, waiting

_OPEN = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def count(store, handle, lane) -> None:
    """The lane's seat count and the seats past it that exist, into the handle, as the turn
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
    raw = values.get(seats.key(lane.name))
    number = seats.count_of(raw)
    if raw is not None and number is None:
        store.seat_warning(f"{store.path(kept.NAME)}: {raw!r} is not a seat count; taking "
                           f"{lane.name} as one seat")
    handle.seats = number or 1
    handle.past = tuple(seat for seat in seats.made(handle.dir_fd, lane.stem)
                        if seat > handle.seats)


def too_many(handle) -> bool:
    """Holding a seat, would this turn make more holders than the count? Only while seats past
    the count are still held (a count made smaller under its holders)."""
    past = [seat for seat in handle.past if seats.held(handle.dir_fd, handle.stem, seat)]
    if not past:
        return False
    others = [seat for seat in range(1, handle.seats + 1)
              if seat != handle.seat and seats.held(handle.dir_fd, handle.stem, seat)]
    return len(past) + len(others) + 1 > handle.seats


def try_seats(store, handle) -> bool | None:
    """One try of every seat, in the turn's order (seats.preference): True with the handle on the
    seat taken (checked: really the seat's file), False when every one is held, None when one
    was free but as many as the count hold (seats past it)."""
    session = (handle.asker or {}).get("session")
    handle.seat_refused = []
    for seat in seats.preference(handle.dir_fd, handle.stem, handle.seats, session):
        store.on_seat(handle, seat)
        for _ in range(order.AGAIN_TRIES):
            ours = store.checked(handle, store.try_lane_lock(handle))
            if ours is not None:
                break
        else:
            raise store.keeps_being_replaced(handle)
        if ours:
            if too_many(handle):
                store.hand_on(handle)
                return None
            return True
    return False


def wait(store, handle, timeout: float | None, cancel=None) -> bool:
    """Block until one of the lane's seats is this turn's (True, the handle on it: the caller
    checks it, as a single lock's wait), timeout passes or cancel is set (False). Each look tries
    every seat, then waits in the kernel on the seats that were held -- whichever frees first
    wakes it."""
    steps = _walk(store, handle, timeout)
    try:
        opened, left = next(steps)
        while True:
            opened, left = steps.send(waiting.wait_any(opened, left, cancel))
    except StopIteration as done:
        return done.value
    finally:
        steps.close()   # a wait that raised (or a cancelled task) closes its seat files now


async def wait_async(store, handle, timeout: float | None) -> bool:
    """wait() for an asyncio task (no thread of its own while it waits)."""
    steps = _walk(store, handle, timeout)
    try:
        opened, left = next(steps)
        while True:
            opened, left = steps.send(await waiting.wait_any_async(opened, left))
    except StopIteration as done:
        return done.value
    finally:
        steps.close()   # a wait that raised (or a cancelled task) closes its seat files now


def _walk(store, handle, timeout: float | None):
    """The seat wait's steps, for either driver: yields (the seat files to wait on, seconds
    left) and is sent the index of the one got (None: timeout or cancel); returns the result."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        busy = _round(store, handle)
        if busy is True:
            return True
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            return False
        if not busy:
            continue
        busy, opened = _openable(handle, busy)
        if not opened:   # every seat planted (each said): nothing a wait could ever get
            return False
        got = None
        try:
            got = yield opened, left
            if got is not None and _keep(store, handle, busy[got], opened[got]):
                return True
        finally:
            _waited(opened, got)
        if got is None:
            return False


def _round(store, handle):
    """One look of a seat wait: True (a seat is the turn's), else the seats to wait on -- every
    one when all are held; when too many hold (seats past the count), the ones that hold (a free
    seat would wake the wait at once, for nothing)."""
    tried = try_seats(store, handle)
    if tried:
        return True
    if tried is False:
        return list(range(1, handle.seats + 1))
    return [seat for seat in (*range(1, handle.seats + 1), *handle.past)
            if seats.held(handle.dir_fd, handle.stem, seat)]


def _keep(store, handle, seat: int, seat_file) -> bool:
    """The wait got the seat's lock: keep it when the seat is within the count and taking it
    makes no more holders than the count -- the usual hand-off, with no second look. The
    descriptor is the handle's then; the walk checks it as any lock taken."""
    if seat > handle.seats:
        return False
    store.on_seat(handle, seat, seat_file.fd)
    seat_file.fd = None
    if too_many(handle):
        store.hand_on(handle)
        return False
    return True


def _waited(opened: list, got: int | None) -> None:
    """After a seat wait: a seat freed and not kept is let go again (the next look takes a seat
    in the turn's order: a seat past the count is never taken), and every file closed."""
    if got is not None and opened[got].fd is not None:
        fcntl.flock(opened[got].fd, fcntl.LOCK_UN)
    for seat_file in opened:
        seat_file.close()


def _openable(handle, busy: list) -> tuple:
    """(the seats, their files) of busy that can be waited on: a seat whose file is planted
    (seats.Planted: its reason is in handle.seat_refused) is left out, never a crash."""
    kept, opened = [], []
    for seat in busy:
        try:
            opened.append(_SeatFile(handle.dir_fd, handle.stem, seat))
        except (seats.Planted, OSError):
            continue
        kept.append(seat)
    return kept, opened


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
