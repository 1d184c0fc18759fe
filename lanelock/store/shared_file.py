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


def open_existing(dir_fd: int, name: str) -> int:
    """A read-write descriptor on name under dir_fd, which must exist (OSError otherwise:
    FileNotFoundError when it does not)."""
    return checked(os.open(name, FLAGS, dir_fd=dir_fd), name)


def open_shared(dir_fd: int, name: str) -> int:
    """A read-write descriptor on name under dir_fd, made when missing (OSError otherwise)."""
    try:
        return open_existing(dir_fd, name)
    except FileNotFoundError:
        pass
    try:
        fd = os.open(name, FLAGS | os.O_CREAT | os.O_EXCL, 0o666, dir_fd=dir_fd)
    except FileExistsError:   # another process made it first: open theirs
        return open_existing(dir_fd, name)
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


def owners(dir_fd: int) -> frozenset:
    """Who may make the files that decide how many turns hold a lane (the seats): root and the
    lock root's owner, as for the kept values (kept.py)."""
    return frozenset({0, os.fstat(dir_fd).st_uid})


def open_made_by(dir_fd: int, name: str, made_by: frozenset, *, directory: bool = False) -> int:
    """A read-only descriptor on name, a directory or a single-named regular file that one of
    made_by owns: nothing followed, type, links and owner checked before it is used.
    FileNotFoundError when nothing is there; OSError(EPERM) saying what was found otherwise
    (a symlink, another user's 0600 file or 0700 folder, a FIFO)."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(name, flags | (os.O_DIRECTORY if directory else 0), dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as error:
        raise OSError(errno.EPERM, _found(dir_fd, name, error)) from None
    st = os.fstat(fd)
    if directory:
        why = None if stat.S_ISDIR(st.st_mode) else f"{name} is not a directory"
        if why is None and st.st_mode & 0o002 and not st.st_mode & stat.S_ISVTX:
            why = f"{name} is writable by every user without the sticky bit"
    else:
        why = unsafe(st, name)
    if why is None and st.st_uid not in made_by:
        why = (f"{name} belongs to uid {st.st_uid}, neither root nor the lock root's owner "
               f"(mode {stat.S_IMODE(st.st_mode):04o})")
    if why is not None:
        os.close(fd)
        raise OSError(errno.EPERM, why)
    return fd


def _found(dir_fd: int, name: str, error: OSError) -> str:
    """What is at name, that open() refused (error)."""
    try:
        st = os.lstat(name, dir_fd=dir_fd)
    except OSError:
        return f"{name} cannot be opened: {error.strerror}"
    if stat.S_ISLNK(st.st_mode):
        return f"{name} is a symlink (uid {st.st_uid}); not following it"
    if not stat.S_ISREG(st.st_mode) and not stat.S_ISDIR(st.st_mode):
        return f"{name} is not a regular file"
    return (f"{name} is mode {stat.S_IMODE(st.st_mode):04o} of uid {st.st_uid}: other users "
            f"cannot open it ({error.strerror})")
