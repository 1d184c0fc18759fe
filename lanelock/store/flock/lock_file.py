"""Opening a flock lane's lock files (store.py takes them): seat 1's, made by the first turn that
needs it; seats 2.. made by whoever set the count (seats.py), never by a turn. Something
planted at a lock file's name that cannot be locked is refused with the reason -- the lane or
the seat counts as busy until it is removed -- never followed, never the gate off. And the one
warning of a lock root on a network filesystem.
"""

from __future__ import annotations

import errno
import os
import stat

from ...errors import GateCrowded, GateUnavailable, crowded
from . import seats
from .handle import Handle

_OPEN = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # O_NONBLOCK: a planted FIFO must not hang us


def on_seat(store, handle: Handle, seat: int, fd: int | None = None) -> None:
    """Point the handle at the seat's lock file: opened here, not locked; or fd, a
    descriptor on it a wait has just locked (the caller checks it, as any lock taken)."""
    if fd is None and handle.seat == seat and (handle.fd is not None
                                                or (handle.refused and seat == 1)):
        return
    if handle.fd is not None:
        os.close(handle.fd)
    handle.fd, handle.st, handle.refused, handle.split = None, None, None, None
    handle.seat, handle.name = seat, seats.lock_name(handle.stem, seat)
    if fd is not None:
        handle.fd, handle.st = fd, os.fstat(fd)
        return
    try:
        if seat == 1:
            open_file(store, handle, create=True)
            return
        # Seats 2.. were made by whoever set the count (seats.make), never by a turn: a
        # seat file or folder another user made or changed is this seat's reason to be
        # busy (said, with what to remove), never a gate switched off or a crash.
        handle.fd = seats.open_seat(handle.dir_fd, handle.stem, seat)
        handle.st = os.fstat(handle.fd)
    except seats.Planted as planted:
        handle.refused = f"seat {seat} of the lane: {store.path(str(planted))}"
        handle.seat_refused.append(handle.refused)
    except GateUnavailable:
        raise
    except OSError as error:
        kind = GateCrowded if crowded(error) else GateUnavailable
        raise kind(f"cannot open {store.path(handle.name)}: {error.strerror}") from None


def open_file(store, handle: Handle, create: bool) -> None:
    """Open (or create) the lock file. Something planted at its name that cannot be locked
    (a FIFO, a directory, another user's file nobody else may open) is refused
    with the reason, and the lane counts as busy until it is removed: failing open there
    would let anyone who may write the root switch the gate off for everyone."""
    handle.fd, handle.refused, created = None, None, False
    try:
        handle.fd, created = open_lock(handle.dir_fd, handle.name, create)
    except _Planted as planted:
        handle.refused = f"lock file {store.path(handle.name)} {planted}: remove it"
        return
    if handle.fd is None:
        return
    handle.st = os.fstat(handle.fd)
    if not stat.S_ISREG(handle.st.st_mode):
        os.close(handle.fd)
        handle.fd, handle.st = None, None
        handle.refused = f"lock file {store.path(handle.name)} is not a regular file: remove it"
    elif created:
        from .split import orphan_holder

        handle.split = orphan_holder(store.root.path, handle.name)


NETWORK_FS = frozenset({"nfs", "nfs4", "cifs", "smb3", "smbfs", "ceph", "glusterfs", "9p",
                        "fuse.sshfs", "afs", "lustre", "gpfs", "beegfs"})


def network_caveat(path: str, st: os.stat_result) -> str | None:
    """A warning when the root is on a network filesystem: flock there does not reliably exclude
    processes on other machines (wake#593, portalocker#92). Local disks have a real device number
    (major != 0), so only anonymous devices pay for a look at mountinfo."""
    if os.major(st.st_dev) != 0:
        return None
    device = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    try:
        with open("/proc/self/mountinfo", "rb") as handle:
            lines = handle.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) > 2 and fields[2] == device and " - " in line:
            fstype = line.split(" - ", 1)[1].split()[0]
            if fstype in NETWORK_FS:
                return (f"lock root {path} is on {fstype}: flock there does not reliably exclude "
                        "other machines; keep the root on a local disk")
            return None
    return None


class _Planted(Exception):
    """Something at the lock file's name that no turn can lock: what it is."""


def open_lock(dir_fd: int, name: str, create: bool) -> tuple:
    """(fd, created): fd None when there is no lock file and create is False. Raises _Planted
    for a directory or a file this user may not open at all."""
    for _ in range(8):
        try:
            return os.open(name, os.O_RDWR | _OPEN, dir_fd=dir_fd), False
        except FileNotFoundError:
            if not create:
                return None, False
            try:
                fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | _OPEN, 0o644, dir_fd=dir_fd)
            except FileExistsError:
                continue  # another turn created it first: open theirs
            # Readable by all is enough: flock(2) works on a read-only descriptor.
            os.fchmod(fd, 0o644)
            return fd, True
        except OSError as error:
            # Another user's 0644 lock file, or a read-only filesystem: a read-only descriptor
            # locks it just as well.
            if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                try:
                    return os.open(name, os.O_RDONLY | _OPEN, dir_fd=dir_fd), False
                except PermissionError:
                    raise _Planted(_unreadable(dir_fd, name)) from None
            if error.errno == errno.ELOOP:
                raise GateUnavailable(f"lock file {name} is a symlink; refusing to follow it") from None
            if error.errno == errno.EISDIR:
                raise _Planted("is not a regular file") from None
            raise
    raise GateUnavailable(f"lock file {name} keeps vanishing")


def _unreadable(dir_fd: int, name: str) -> str:
    try:
        st = os.lstat(name, dir_fd=dir_fd)
    except OSError:
        return "cannot be opened"
    return f"is mode {stat.S_IMODE(st.st_mode):04o} of uid {st.st_uid}: other users cannot lock it"
