"""Values kept with the lanes of a lock root (a lane's seat count, the model map): one file,
ROOT/kept.json, that every process of the machine reads -- cron under `env -i`, every HOME, every
user -- so they all agree, or there would be two gates.

Its trust is the root's: a value changes how many turns may hold a lane at once, so a file
another unprivileged user planted in a shared (sticky) root could switch the gate off for
everyone by raising a count. The file is believed only when it belongs to root or to the lock
root's owner (not the reader's own: she could not have set it, so someone planted it); else it is
ignored (the defaults: one seat), which can
only make the reader more careful, never less. Setting a value is refused to anyone else for the
same reason.

Writes replace the file whole (a temp file renamed over it), under a flock on ROOT/.kept.lock
so two setters never lose each other's keys; a reader needs no lock: a rename is atomic.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import stat

NAME = "kept.json"
GUARD = ".kept.lock"   # dot: never listed as a lane (survey.lane_stems)
MAX_BYTES = 1 << 20


class Untrusted(Exception):
    """The file is there but not to be believed (words for people)."""


def read(dir_fd: int) -> dict | None:
    """Every kept value; None when none was ever set (no file). Untrusted for a file of another
    user; OSError when it cannot be read."""
    try:
        fd = os.open(NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
                     dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    try:
        st = os.fstat(fd)
        why = _distrust(st, os.fstat(dir_fd))
        if why:
            raise Untrusted(why)
        data = os.read(fd, MAX_BYTES + 1)
    finally:
        os.close(fd)
    try:
        values = json.loads(data) if len(data) <= MAX_BYTES else None
    except ValueError:
        values = None
    if not isinstance(values, dict):
        raise OSError(errno.EINVAL, f"{NAME} is not a JSON object")
    return values


def write(dir_fd: int, name: str, value) -> None:
    """Keep value under name (None: forget it). OSError when it cannot be written; PermissionError
    when this user may not set values in this root."""
    may_set(dir_fd)
    guard = os.open(GUARD, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                    dir_fd=dir_fd)
    try:
        fcntl.flock(guard, fcntl.LOCK_EX)
        try:
            values = read(dir_fd) or {}
        except (Untrusted, OSError):
            values = {}   # replaced whole below: a bad or planted file is not kept
        if value is None:
            values.pop(name, None)
        else:
            values[name] = value
        temp = f".{NAME}.{os.getpid()}.{os.urandom(4).hex()}"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o644, dir_fd=dir_fd)
        try:
            os.fchmod(fd, 0o644)   # every user reads it, whatever the umask
            os.write(fd, (json.dumps(values, indent=1, sort_keys=True) + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.rename(temp, NAME, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except OSError:
            os.unlink(temp, dir_fd=dir_fd)
            raise
    finally:
        os.close(guard)


def may_set(dir_fd: int) -> None:
    """PermissionError unless this user may set values every user reads (root, the lock root's
    owner)."""
    root = os.fstat(dir_fd)
    if os.geteuid() not in (0, root.st_uid):
        raise PermissionError(errno.EPERM, f"only root or uid {root.st_uid} (the lock root's "
                                           "owner) may set values every user reads")


def _distrust(st: os.stat_result, root: os.stat_result) -> str | None:
    if not stat.S_ISREG(st.st_mode):
        return f"{NAME} is not a regular file"
    if st.st_uid not in (0, root.st_uid):   # the reader's own is no better: she may not set
        return (f"{NAME} belongs to uid {st.st_uid}, neither root nor the lock root's owner "
                f"(uid {root.st_uid}): its values are ignored")
    if st.st_mode & 0o022:
        return f"{NAME} is writable by others: its values are ignored"
    return None
