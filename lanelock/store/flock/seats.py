"""The seats of a flock lane: up to N turns hold it at once, N kept with the lanes (kept.py).

Seat 1 is the lane's lock file as ever (STEM.lock, its record STEM.json): a one-seat lane, and
flock(1) or lslocks on it, see nothing new. Seat K >= 2 is STEM.seats/K.lock with its record
STEM.seats/K.json, in a directory every user may add to (1777, like the queue's). Each seat is
a flock of its own, dropped by the kernel with its holder: no counter anyone must decrement.

A smaller count never evicts a turn: seats past the count that are still held (set 2, then 1,
with two holding) count against it, and a seat is taken only while fewer than N hold. Seats past
the count are never taken again, so asking whether one is held (a shared lock tried and let go)
disturbs nobody.

Which free seat a turn takes: the one its session held last (the engine's slot keeps that
session's cache), else the one held least recently, so the seats other sessions just used stay
theirs.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat

from .sidecar import read as read_record

KEY = "seats/"
MOST = 256   # a count past this is a typo, not an engine


def key(lane_name: str) -> str:
    """The lane's count's name among the kept values."""
    return KEY + lane_name


def folder(stem: str) -> str:
    return f"{stem}.seats"


def lock_name(stem: str, seat: int) -> str:
    """The lock file of the seat, relative to the lock root."""
    return f"{stem}.lock" if seat == 1 else f"{stem}.seats/{seat}.lock"


def record_name(lock: str) -> str:
    """The holder record beside a seat's lock file."""
    return lock[:-len(".lock")] + ".json"


def count_of(value) -> int | None:
    """A kept count, checked (None: not a count a lane can have)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MOST:
        return None
    return value


def made(dir_fd: int, stem: str) -> list[int]:
    """The seats >= 2 whose lock files exist, in order ([] with no seats folder)."""
    try:
        fd = os.open(folder(stem), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                     dir_fd=dir_fd)
    except (FileNotFoundError, NotADirectoryError):
        return []
    try:
        names = os.listdir(fd)
    finally:
        os.close(fd)
    return sorted(int(name[:-5]) for name in names
                  if name.endswith(".lock") and name[:-5].isdigit() and int(name[:-5]) >= 2)


def make_folder(dir_fd: int, stem: str) -> None:
    """The seats folder, mode 1777 whatever the umask (every user's turns take seats)."""
    try:
        os.mkdir(folder(stem), 0o1777, dir_fd=dir_fd)
        os.chmod(folder(stem), 0o1777 | stat.S_ISVTX, dir_fd=dir_fd)
    except FileExistsError:
        pass


def held(dir_fd: int, stem: str, seat: int) -> bool:
    """Does a turn hold the seat now? A shared lock tried and let go at once: asked only of
    seats nobody takes any more (past the count), or of seats this turn could not take."""
    try:
        fd = os.open(lock_name(stem, seat), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
                     | os.O_NONBLOCK, dir_fd=dir_fd)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as error:
        return error.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
    finally:
        os.close(fd)
    return False


def preference(dir_fd: int, stem: str, seats: int, session: str | None) -> list[int]:
    """The seats 1..seats in the order a turn of session tries them: the one its session held
    last first, then the least recently held (never held first), the ones held now last."""
    from ...holder import released_ago

    ranked = []
    for seat in range(1, seats + 1):
        record, _ = read_record(record_name(lock_name(stem, seat)), dir_fd=dir_fd)
        ago = released_ago(record)
        if record is None:
            ranked.append(((1, 0.0), seat))          # never held: as least recent as can be
        elif ago is None:
            ranked.append(((3, 0.0), seat))          # held now (or unreadable): tried last
        elif session is not None and record.get("session") == session:
            ranked.append(((0, ago), seat))          # this session's: the latest first
        else:
            ranked.append(((2, -ago), seat))         # least recently released first
    return [seat for _, seat in sorted(ranked)]
