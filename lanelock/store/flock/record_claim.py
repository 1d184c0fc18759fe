"""A holder record this turn can write, made sure of the moment the lock is taken, before the
turn runs anything.

The record is what finds a killed turn's command (outlived.py): a turn that holds the lane but
cannot write its record leaves no trace, and when it is killed -9 the next turn runs beside its
still-running command. The lane's first user owns STEM.json (0666, see sidecar.MODE) and may
chmod it 0644, or plant a symlink or a FIFO there; in a sticky root nobody else can replace it.
So the record is opened for writing as the lock is taken (claim): a descriptor opened is
writable whatever its owner does to the file later, and a file this user can neither write nor
replace makes the lane busy with the reason and what to remove -- the turn deflects or waits,
never runs unrecorded. Root, the record's owner, and a user who owns the folder (or a folder
without the sticky bit, where any file can be replaced) are never refused.
"""

from __future__ import annotations

import os
import stat

from .sidecar import MODE

_FLAGS = os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


class Refused(Exception):
    """The record is another user's to control: the words name it (relative to the root)."""


def claim(dir_fd: int, name: str) -> int | None:
    """A writable descriptor on the single-named regular record at name (made here, 0666, when
    there is none); None when this user may replace whatever is there (sidecar.write does).
    Refused when it may do neither."""
    for _ in range(4):
        try:
            fd = os.open(name, _FLAGS, dir_fd=dir_fd)
        except FileNotFoundError:
            try:
                fd = os.open(name, _FLAGS | os.O_CREAT | os.O_EXCL, MODE, dir_fd=dir_fd)
            except FileExistsError:
                continue   # made meanwhile (by another turn, or planted): look at it
            except OSError:
                return None   # e.g. a read-only root: sidecar.write says why
            os.fchmod(fd, MODE)
            return fd
        except OSError:
            fd = None
        if fd is not None:
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
                return fd
            os.close(fd)
        why = controlled(dir_fd, name)
        if why is not None:
            raise Refused(why)
        return None
    return None


def controlled(dir_fd: int, name: str, me: int | None = None) -> str | None:
    """Why user me (this process's) can neither write the record at name in place nor replace
    it, in words naming it; None when it can (or there is nothing there). me=-1: any user but
    the record's owner and root, of a record another unprivileged user controls (status asks
    so: root's or the root owner's own odd file is theirs to keep)."""
    me = os.geteuid() if me is None else me
    try:
        st = os.lstat(name, dir_fd=dir_fd)
    except OSError:
        return None
    if me == 0 or st.st_uid == me:
        return None
    if stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and st.st_mode & 0o002:
        return None   # shared, as a record is: anyone writes it in place
    folder = os.path.dirname(name)
    try:
        parent = os.stat(folder, dir_fd=dir_fd) if folder else os.fstat(dir_fd)
    except OSError:
        return None
    if parent.st_uid == me or not parent.st_mode & stat.S_ISVTX:
        return None   # this user may replace it (sidecar.write does)
    if me == -1 and st.st_uid in (0, parent.st_uid):
        return None
    if not stat.S_ISREG(st.st_mode):
        kind = "not a regular file"
    elif st.st_nlink != 1:
        kind = f"a file with {st.st_nlink} names"
    else:
        kind = f"mode {stat.S_IMODE(st.st_mode):04o}"
    return (f"{name} (the holder record) is {kind} of uid {st.st_uid}: other users' turns "
            "cannot record themselves there (a killed turn's command would go unseen)")
