"""Who holds and who waits on a lock file, from the kernel's /proc/locks.

The sidecar says who *claimed* the lane; /proc/locks says who *holds* it. They disagree after a
kill -9 (the kernel dropped the lock, the sidecar still names the dead holder) and after PID reuse,
so readers trust the kernel and use the sidecar only for labels. Plain reads: the run path must
not import psutil.
"""

from __future__ import annotations

import os

PROC_LOCKS = "/proc/locks"


class KernelView:
    """The kernel's view of one lock (a plain class: `typing` costs the run path milliseconds)."""

    __slots__ = ("holders", "waiters")

    def __init__(self, holders: tuple[int, ...], waiters: tuple[int, ...]):
        self.holders = holders   # pids that hold an FLOCK on the file (the process that took it)
        self.waiters = waiters   # pids blocked in flock() on it

    def __eq__(self, other) -> bool:
        return isinstance(other, KernelView) and (self.holders, self.waiters) == (
            other.holders, other.waiters)

    def __repr__(self) -> str:
        return f"KernelView(holders={self.holders}, waiters={self.waiters})"


def flock_entries() -> list[tuple[int, str, int, bool]] | None:
    """(pid, "maj:min", inode, blocked) for every FLOCK in /proc/locks; None when unreadable."""
    try:
        with open(PROC_LOCKS, "rb") as handle:
            text = handle.read().decode("ascii", "replace")
    except OSError:
        return None
    entries = []
    for line in text.splitlines():
        words = line.split()
        blocked = len(words) > 1 and words[1] == "->"
        if blocked:
            words = words[:1] + words[2:]
        # "1: FLOCK  ADVISORY  WRITE 1234 fe:00:2146329 0 EOF"
        if len(words) < 6 or words[1] != "FLOCK":
            continue
        device, _, inode = words[5].rpartition(":")
        try:
            entries.append((int(words[4]), device, int(inode), blocked))
        except ValueError:
            continue
    return entries


def _device(st: os.stat_result) -> str:
    return f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}"


def kernel_view(st: os.stat_result) -> KernelView | None:
    """Holders and waiters of the file with st's device and inode; None when /proc/locks is unreadable."""
    return view_of(st, flock_entries())


def view_of(st: os.stat_result, entries: list | None) -> KernelView | None:
    """kernel_view from flock_entries() already read (one read for several files)."""
    if entries is None:
        return None
    device = _device(st)
    mine = [(pid, blocked) for pid, dev, ino, blocked in entries if dev == device and ino == st.st_ino]
    return KernelView(tuple(pid for pid, blocked in mine if not blocked),
                      tuple(pid for pid, blocked in mine if blocked))


def held_files() -> set[tuple[str, int]] | None:
    """(device, inode) of every file someone holds an FLOCK on; None when unreadable."""
    entries = flock_entries()
    if entries is None:
        return None
    return {(device, inode) for _, device, inode, blocked in entries if not blocked}


def device_of(st: os.stat_result) -> str:
    return _device(st)


def holds_other_inode(pid: int, st: os.stat_result, inode: int | None = None) -> int | None:
    """An inode on st's device, other than st's (or exactly `inode`), that pid holds an FLOCK on:
    the sign of a lock file that was removed or replaced under a live holder."""
    device = _device(st)
    for holder, dev, ino, blocked in flock_entries() or ():
        if holder == pid and dev == device and not blocked and ino != st.st_ino \
                and (inode is None or ino == inode):
            return ino
    return None
