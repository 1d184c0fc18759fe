"""A file every user of the lock root shares (the counts, the witness's claim): opened, or made
mode 0666 whatever the umask, never through a symlink, a hard link or anything but a regular file.

Another user may plant anything at a name in the shared root: a symlink or (where
fs.protected_hardlinks is off) a hard link to a file of ours, which a write would change; a FIFO
or a directory. So every writer opens with O_NOFOLLOW|O_NONBLOCK (a FIFO must not hang it) and
checks what it got with fstat before its first write (checked()).
"""

from __future__ import annotations

import errno
import os
import stat

FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def open_shared(dir_fd: int, name: str) -> int:
    """A read-write descriptor on name under dir_fd, made when missing (OSError otherwise)."""
    try:
        return checked(os.open(name, FLAGS, dir_fd=dir_fd), name)
    except FileNotFoundError:
        pass
    try:
        fd = os.open(name, FLAGS | os.O_CREAT | os.O_EXCL, 0o666, dir_fd=dir_fd)
    except FileExistsError:   # another process made it first: open theirs
        return checked(os.open(name, FLAGS, dir_fd=dir_fd), name)
    try:
        os.fchmod(fd, 0o666)   # every user's turns (and witnesses) write it
    except OSError:
        os.close(fd)
        raise
    return fd


def checked(fd: int, name: str) -> int:
    """fd, when it is a regular file with no other name; else fd is closed and OSError(EPERM)
    says what was found."""
    why = unsafe(os.fstat(fd), name)
    if why is None:
        return fd
    os.close(fd)
    raise OSError(errno.EPERM, why)


def unsafe(st: os.stat_result, name: str) -> str | None:
    """Why a writer must not write to the file st describes (None: it may)."""
    if stat.S_ISLNK(st.st_mode):
        return f"{name} is a symlink; not writing through it"
    if not stat.S_ISREG(st.st_mode):
        return f"{name} is not a regular file; not writing to it"
    if st.st_nlink != 1:
        return f"{name} has {st.st_nlink} names (a hard link); not writing through it"
    return None
