"""The seats of a flock lane: up to N turns hold it at once, N kept with the lanes (kept.py).

Seat 1 is the lane's lock file as ever (STEM.lock, its record STEM.json): a one-seat lane, and
flock(1) or lslocks on it, see nothing new. Seat K >= 2 is STEM.seats/K.lock with its record
STEM.seats/K.json. Each seat is a flock of its own, dropped by the kernel with its holder: no
counter anyone must decrement.

The folder and the seats' files are made by whoever sets the count (make(): root or the lock
root's owner, as kept.py allows), never by a turn: in the 1777 sticky folder no turn's user can
move or chmod them. A turn opens them as every shared file is opened (shared_file.open_made_by:
nothing followed, type, links and owner checked); anything another user made or changed there
makes that seat unusable (Planted: the words say what to remove), never the gate off.

A smaller count never evicts a turn: seats past the count that are still held (set 2, then 1,
with two holding) count against it, and a seat is taken only while fewer than N hold. Seats past
the count are never taken again, so asking whether one is held (a shared lock tried and let go)
disturbs nobody.

Which seat a turn takes, never one too many, the head's wait on any seat: store/seating.py's,
for every store; this module is the files only.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import time

from ..seating import seat_number
from ..shared_file import open_made_by, owners

FILES = "seat-files/"   # kept: the inode of each seat's lock file as make() made it


def files_key(lane_name: str) -> str:
    """The kept name of the lane's seat files' identities ({"2": [inode, mtime_ns], ...}): a
    seat file moved or removed under its holder is found by its inode in the kernel's lock
    table, and told from a file that took its number by its mtime (split.moved_holder)."""
    return FILES + lane_name


def identity(st: os.stat_result) -> list[int]:
    """What a seat's lock file is kept as: its inode, and the mtime make() stamped on it. An
    inode number alone is reused by the next file made on the filesystem once the seat file is
    removed (any file: another program's lock held there would read as the seat's holder); the
    pair is not, and a seat's lock file is never written, so its mtime stays as stamped."""
    return [st.st_ino, st.st_mtime_ns]


def identity_of(kept_value) -> tuple[int | None, int | None]:
    """(inode, mtime_ns) of a kept seat file ([inode, mtime_ns]; an inode alone as kept before
    the mtime was: mtime None); (None, None) for anything else."""
    if isinstance(kept_value, int) and not isinstance(kept_value, bool):
        return kept_value, None
    if isinstance(kept_value, list) and len(kept_value) == 2 \
            and all(isinstance(part, int) and not isinstance(part, bool) for part in kept_value):
        return kept_value[0], kept_value[1]
    return None, None


def is_file(st: os.stat_result, kept_value) -> bool:
    """Is the file at a seat's name (st) the one its setter made (kept_value: identity's)?"""
    inode, stamp = identity_of(kept_value)
    return st.st_ino == inode and stamp in (None, st.st_mtime_ns)


def folder(stem: str) -> str:
    return f"{stem}.seats"


def lock_name(stem: str, seat: int) -> str:
    """The lock file of the seat, relative to the lock root."""
    return f"{stem}.lock" if seat == 1 else f"{stem}.seats/{seat}.lock"


def record_name(lock: str) -> str:
    """The holder record beside a seat's lock file."""
    return lock[:-len(".lock")] + ".json"


class Planted(Exception):
    """A seat's folder or lock file that no turn may use (planted, or changed by another user):
    the words say what is there and what to do; the seat counts as held until it is fixed."""


def open_folder(dir_fd: int, stem: str) -> int | None:
    """The seats folder, checked as every shared file is (shared_file.open_made_by): a directory
    root or the lock root's owner made. None when there is none; Planted otherwise."""
    try:
        return open_made_by(dir_fd, folder(stem), owners(dir_fd), directory=True)
    except FileNotFoundError:
        return None
    except OSError as error:
        raise Planted(f"{error.strerror or error}: remove it, then set the count again "
                      "(lanelock seats)") from None


def open_seat(dir_fd: int, stem: str, seat: int) -> int:
    """A read-only descriptor on seat K's (K >= 2) lock file, made by whoever set the count
    (make()): never created by a turn, never followed, its owner checked. Planted when it cannot
    be used (the words name it and the fix); flock(2) needs no more than read access."""
    folder_fd = open_folder(dir_fd, stem)
    if folder_fd is None:
        raise Planted(f"{folder(stem)} is missing: set the count again (lanelock seats)")
    try:
        return open_made_by(folder_fd, f"{seat}.lock", owners(dir_fd))
    except FileNotFoundError:
        raise Planted(f"{lock_name(stem, seat)} is missing: set the count again "
                      "(lanelock seats)") from None
    except OSError as error:
        raise Planted(f"{folder(stem)}/{error.strerror or error}: remove it, then set the count "
                      "again (lanelock seats)") from None
    finally:
        os.close(folder_fd)


def made(values: dict | None, lane_name: str) -> list[int]:
    """The seats >= 2 whoever set the count made, in order, from the kept values (values: kept.
    read's): the seats of the kept map of their inodes (seat-files/LANE), never a listing of
    the folder -- a 1777 folder any user may fill: a turn and `status` look at the seats the
    setter made and no others, however many files are planted beside them."""
    files = (values or {}).get(files_key(lane_name))
    if not isinstance(files, dict):
        return []
    return sorted({seat for seat in map(seat_number, files) if seat is not None and seat >= 2})


def made_here(dir_fd: int, lane_name: str) -> list[int]:
    """made() of the lock root's kept values as they stand ([] when they cannot be believed)."""
    from . import kept

    try:
        return made(kept.read(dir_fd), lane_name)
    except (kept.Untrusted, OSError):
        return []


def make(dir_fd: int, stem: str, count: int, made_before: dict | None = None) -> dict:
    """Seats 2..count made by whoever sets the count (root or the lock root's owner: kept.py
    refuses anyone else): the folder (1777 with the sticky bit, so no turn's user can move a
    seat's files), each seat's lock file (0644: flock needs only read access) and its record
    (0666: every user's turns write it in place). Anything else at those names -- planted before
    the count was set -- is replaced. A seat whose file was moved or removed while a turn still
    holds it (made_before: {"K": identity}, found in the kernel's lock table) is not made again:
    that would be two gates (OSError says who holds it). Returns {"K": identity} of every seat
    made."""
    from .split import moved_holder

    root_dev = os.fstat(dir_fd).st_dev
    for seat, made_as in (made_before or {}).items():
        try:
            there = is_file(os.lstat(lock_name(stem, int(seat)), dir_fd=dir_fd), made_as)
        except (OSError, ValueError):
            there = False
        pid = None if there else moved_holder(root_dev, *identity_of(made_as))
        if pid is not None:
            raise OSError(errno.EBUSY, f"seat {seat}'s lock file was moved or removed under its "
                                       f"holder (pid {pid}): set the count again once it ends")
    name = folder(stem)
    try:
        st = os.lstat(name, dir_fd=dir_fd)
    except FileNotFoundError:
        st = None
    if st is not None and (not stat.S_ISDIR(st.st_mode) or st.st_uid not in owners(dir_fd)):
        _remove(dir_fd, name, st)
        st = None
    if st is None:
        os.mkdir(name, 0o700, dir_fd=dir_fd)
    folder_fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                        dir_fd=dir_fd)
    inodes = {}
    try:
        os.fchmod(folder_fd, 0o1777)
        for seat in range(2, count + 1):
            for file, mode in ((f"{seat}.lock", 0o644), (f"{seat}.json", 0o666)):
                _make_file(folder_fd, file, mode, owners(dir_fd))
            inodes[str(seat)] = identity(os.lstat(f"{seat}.lock", dir_fd=folder_fd))
    finally:
        os.close(folder_fd)
    return inodes


def _make_file(folder_fd: int, name: str, mode: int, made_by: frozenset) -> None:
    try:
        st = os.lstat(name, dir_fd=folder_fd)
    except FileNotFoundError:
        st = None
    if st is not None and stat.S_ISREG(st.st_mode) and st.st_nlink == 1 \
            and st.st_uid in made_by:
        if stat.S_IMODE(st.st_mode) != mode:
            os.chmod(name, mode, dir_fd=folder_fd, follow_symlinks=False)
        return
    if st is not None:
        _remove(folder_fd, name, st)
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode,
                 dir_fd=folder_fd)
    try:
        os.fchmod(fd, mode)
        # The clock's own nanoseconds, where a file made now gets the kernel's coarse tick that
        # any file made in the same tick shares: the stamp tells this file from one that takes
        # its inode number later (identity).
        stamp = time.time_ns()
        os.utime(fd, ns=(stamp, stamp))
    finally:
        os.close(fd)


def _remove(dir_fd: int, name: str, st: os.stat_result) -> None:
    """Something planted at a seat's name: gone before the seat is made."""
    if stat.S_ISDIR(st.st_mode):
        import shutil

        shutil.rmtree(name, dir_fd=dir_fd)
    else:
        os.unlink(name, dir_fd=dir_fd)


def held(dir_fd: int, stem: str, seat: int) -> bool:
    """Does a turn hold the seat now? A shared lock tried and let go at once: asked only of
    seats nobody takes any more (past the count), or of seats this turn could not take. A seat
    file nobody trusted made holds nothing (a plain flock on a planted file keeps no one out)."""
    try:
        fd = open_seat(dir_fd, stem, seat)
    except (Planted, OSError):
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as error:
        return error.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
    finally:
        os.close(fd)
    return False
