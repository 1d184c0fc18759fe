"""A lane split in two: its lock file removed (or replaced) while a turn held it.

The holder's lock stays on the old inode, and the next turn creates and locks a new file: two
gates. Whoever owns a lock file can remove it (the first user of a lane, in a sticky root), and
the holder record beside it with it, so the record alone cannot be trusted to tell. The kernel
can: the holder still has the removed file open, which /proc shows as a descriptor whose link
reads 'ROOT/STEM.lock (deleted)', and the descriptor's fdinfo lists the flock it holds.

Looked for only when a turn creates a lock file -- a removed one is created again by the next
turn, so that is when a split begins to matter -- never on every turn: a pass over every process's
descriptors costs milliseconds. /proc shows the descriptors of our own user's processes (all of
them to root): a split under another user's holder is found by root's turns and root's `status`.
"""

from __future__ import annotations

import os

DELETED = " (deleted)"


def orphan_holder(root: str, name: str) -> tuple[int, int] | None:
    """(pid, inode) of a live process holding the flock of a removed file root/name, else None."""
    target = os.path.join(os.path.realpath(root), name) + DELETED
    try:
        pids = [entry for entry in os.listdir("/proc") if entry.isdigit()]
    except OSError:
        return None
    me = str(os.getpid())
    for pid in pids:
        if pid == me:
            continue
        folder = f"/proc/{pid}/fd"
        try:
            fds = os.listdir(folder)
        except OSError:   # another user's, or gone
            continue
        for fd in fds:
            try:
                if os.readlink(f"{folder}/{fd}") != target:
                    continue
            except OSError:
                continue
            inode = _flock_held(pid, fd)
            if inode is not None:
                return int(pid), inode
    return None


def _flock_held(pid: str, fd: str) -> int | None:
    """The inode of the file descriptor fd of pid when it holds a flock on it (fdinfo lists a
    description's own locks; a waiter blocked on one lists none)."""
    try:
        with open(f"/proc/{pid}/fdinfo/{fd}", "rb") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return None
    inode = None
    holds = False
    for line in lines:
        if line.startswith(b"ino:"):
            try:
                inode = int(line.split()[1])
            except (IndexError, ValueError):
                return None
        elif line.startswith(b"lock:") and b"FLOCK" in line and b"->" not in line:
            holds = True
    return inode if holds else None


def inode_holder(device: int, inode: int) -> int | None:
    """The pid holding a flock on the file (device, inode) wherever it now is (a seat's lock file
    moved aside or removed under its holder: seats.make), from the kernel's lock table; None when
    nobody holds it or the table cannot be read. Never on a turn's path (each read of
    /proc/locks stalls every flock() on the machine): the count's setter and `status` ask."""
    import types

    from ...locks import flock_entries, view_of

    view = view_of(types.SimpleNamespace(st_dev=device, st_ino=inode), flock_entries())
    return view.holders[0] if view is not None and view.holders else None


def moved_holder(device: int, inode: int | None, stamp: int | None) -> int | None:
    """The pid holding a flock on a seat's lock file as its setter made it (its inode and mtime
    stamp as kept: seats.identity; stamp None when kept before there was one) wherever it now
    is -- moved aside or removed under its holder -- else None. The kernel's lock table names an inode only, and once the seat file is
    removed its number goes to the next file made on the filesystem: a flock on that file (any
    program's) is told apart by the holder's descriptor on it, whose mtime is not the stamp.
    A holder whose descriptors this reader cannot see (another user's, to a non-root reader)
    is believed: refusing to make a seat again is the side that never splits it."""
    pid = None if inode is None else inode_holder(device, inode)
    if pid is None or stamp is None:
        return pid
    seen = _descriptor_on(pid, device, inode)
    return None if seen is not None and seen.st_mtime_ns != stamp else pid


def _descriptor_on(pid: int, device: int, inode: int) -> os.stat_result | None:
    """The stat of pid's open descriptor on (device, inode); None when it has none this reader
    can see."""
    folder = f"/proc/{pid}/fd"
    try:
        names = os.listdir(folder)
    except OSError:
        return None
    for name in names:
        try:
            st = os.stat(os.path.join(folder, name))
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == (device, inode):
            return st
    return None
