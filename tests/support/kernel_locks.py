"""What the kernel says of a lane's lock file: /proc/locks' holders and waiters, a lock of our
own taken without waiting, and the queue's entries beside it."""

from __future__ import annotations

import fcntl
import os
import stat
from pathlib import Path


def flock_entries(path) -> tuple[list[int], list[int]]:
    """(holders, waiters): the pids /proc/locks shows on this file's flock (empty when unreadable)."""
    try:
        st = os.stat(path)
        with open("/proc/locks") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return [], []
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    holding, waiting = [], []
    for line in lines:
        words = line.split()
        blocked = words[1:2] == ["->"]
        words = words[2:] if blocked else words[1:]
        if len(words) >= 5 and words[0] == "FLOCK" and words[4] == inode:
            (waiting if blocked else holding).append(int(words[3]))
    return holding, waiting


def is_waiting(lock_path, pid: int) -> bool:
    """Is pid blocked in flock() on this lock file (a '->' entry in /proc/locks)?"""
    return pid in flock_entries(lock_path)[1]


def is_queued(lock_path, pid: int) -> bool:
    """Does pid wait in the lane's queue (store/flock/queue.py: a file ARRIVAL.RANK.PID.RANDOM in
    STEM.queue/ beside the lock, there only while its turn waits)? The first in the queue blocks
    in flock() on the lock itself (is_waiting); the others on the entry ahead of them.

    Only an entry the order reads counts (the queue's own parser says which): a turn joining
    makes its file under a temporary name (.new.PID.RANDOM) and renames it into the queue once
    locked. Counted from that temporary file, a waiter was "queued" before any other turn could
    see it, and a seat freed then went to the turn already waiting -- a test's race, not a rule."""
    from lanelock.store.flock.queue import Entry

    try:
        names = os.listdir(Path(lock_path).with_suffix(".queue"))
    except OSError:
        return False
    return any((entry := Entry.parse(name, 0)) is not None and entry.pid == pid
               for name in names)


def lane_held(lock: Path) -> bool:
    """Does anyone hold this lock file's flock? Asked with a lock of our own, taken without waiting
    on a descriptor of our own (so a lane this very process holds, a leaked API turn, is seen too)
    and let go at once. A planted symlink, FIFO or directory is no lane."""
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
