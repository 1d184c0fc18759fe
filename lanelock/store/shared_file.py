"""A file every user of the lock root shares (the counts, the witness's claim): opened, or made
mode 0666 whatever the umask, never through a symlink."""

from __future__ import annotations

import os

FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def open_shared(dir_fd: int, name: str) -> int:
    """A read-write descriptor on name under dir_fd, made when missing (OSError otherwise)."""
    try:
        return os.open(name, FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    try:
        fd = os.open(name, FLAGS | os.O_CREAT | os.O_EXCL, 0o666, dir_fd=dir_fd)
    except FileExistsError:   # another process made it first: open theirs
        return os.open(name, FLAGS, dir_fd=dir_fd)
    try:
        os.fchmod(fd, 0o666)   # every user's turns (and witnesses) write it
    except OSError:
        os.close(fd)
        raise
    return fd
