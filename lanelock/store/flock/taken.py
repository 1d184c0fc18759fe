"""Is a flock lock just taken really the lane's (store.py takes it, through taking.py for a seat)?
A flock on a file removed or replaced meanwhile is on an orphan inode: the next turn would open
the new file, two gates. So every lock taken is checked: on a replaced file the new one is
locked instead; a live turn still holding an old inode (its file replaced or moved under it)
keeps the lane -- we let go and say busy; a killed turn's command that still runs is found for
the order to wait on (outlived.py); and the turn's record is claimed before anything runs
(record_claim.py).
"""

from __future__ import annotations

import fcntl
import os

from ... import locks, proc
from ...errors import GateUnavailable
from .. import outlived
from . import sidecar
from .handle import Handle
from .lock_file import open_file
from .record_claim import Refused, claim


def checked(store, handle: Handle, got: bool, claim: bool) -> bool | None:
    """After a lock was tried: True (the lane is ours), False (busy), None (the file was
    replaced under it: the new one is open, lock again). claim: the record claimed now too."""
    if not got:
        return False
    if _current(store, handle):
        # A seat's record is claimed as its lock is taken (a refused one: the next seat); a
        # one-seat lane's once the lane is kept (seating.OneLock.kept), after the queue's look:
        # one descriptor fewer at once, for a turn at a low open-file limit.
        if claim and not record_claimed(store, handle):
            fcntl.flock(handle.fd, fcntl.LOCK_UN)
            return False
        # The record, read only when its turn never released (the usual hand-off skips it).
        record, _ = sidecar.read(handle.record_name, dir_fd=handle.dir_fd,
                                 live_only=True)
        if _orphan_holds(store, handle, record) or _split_found(store, handle, record):
            fcntl.flock(handle.fd, fcntl.LOCK_UN)
            return False
        handle.outlived = outlived.running_command(record)
        if handle.outlived is not None and not sidecar.turns_command(
                handle.outlived, store.path(handle.name), record):
            handle.outlived = None   # the record names it; the process does not say so
        handle.locked = True
        return True
    os.close(handle.fd)   # our lock is on an orphan inode: let it go, open the lane's file
    handle.fd, handle.st = None, None
    try:
        open_file(store, handle, create=True)
    except OSError as error:
        raise GateUnavailable(f"cannot open {store.path(handle.name)}: {error.strerror}") from None
    return None


def record_claimed(store, handle: Handle) -> bool:
    """The lock just taken: this turn's record opened writable before anything runs
    (record_claim.py). False, the reason in handle.refused, when another user controls it:
    the turn must not run unrecorded (a kill -9 would leave its command unseen)."""
    if handle.record_fd is not None:
        os.close(handle.record_fd)
        handle.record_fd = None
    try:
        handle.record_fd = claim(handle.dir_fd, handle.record_name)
    except Refused as why:
        handle.refused = f"{store.path(str(why))}: remove it"
        if handle.seat > 1:
            handle.seat_refused.append(handle.refused)
        return False
    handle.refused = None
    return True


def _current(store, handle: Handle) -> bool:
    """Is the locked file still the lane's file (not removed, not replaced)?"""
    try:
        now = os.lstat(handle.name, dir_fd=handle.dir_fd)
    except OSError:
        return False
    return (now.st_dev, now.st_ino) == (handle.st.st_dev, handle.st.st_ino)


def _split_found(store, handle: Handle, record: dict | None) -> bool:
    """This turn created the lock file, and a live process holds the removed one (split.py):
    the lane is held. What was found is written as that holder's record (its own, if any,
    went with the file), so every later turn finds it as _orphan_holds does, and `status`
    says the lane is split."""
    if handle.split is None:
        return False
    pid, inode = handle.split
    ticks = proc.start_ticks(pid)
    if ticks is None:
        return False
    from ...facts import boot_id, hostname

    try:
        written = sidecar.write(handle.dir_fd, handle.record_name, {
            "schema": sidecar.SCHEMA, "pid": pid, "start_ticks": ticks, "boot_id": boot_id(),
            "hostname": hostname(), "lock_inode": inode, "session": "?",
            "argv": (proc.command_words(pid) or [])[:64],
            "note": "found holding the removed lock file"})
        written.close()
    except OSError:
        pass   # this turn still deflects; the next to create the file looks again
    return True


def _orphan_holds(store, handle: Handle, record: dict | None) -> bool:
    """Does a live turn hold a removed or replaced lock file of this lane? Its lock is on the
    old inode, ours on the new one: taking the lane now would make two gates. The sidecar
    names it (pid, start time, lock_inode); the kernel confirms it."""
    inode = sidecar.field(record, "lock_inode", int)
    pid = sidecar.field(record, "pid", int)
    if record is None or "released_at" in record or inode is None or pid is None \
            or inode == handle.st.st_ino or pid == os.getpid():
        return False
    if proc.start_ticks(pid) != sidecar.field(record, "start_ticks", int):
        return False
    if sidecar.opens_lock(pid, handle.st, inode) is False:
        return False   # it has no such file open: a forged record (the lock table unread)
    return locks.holds_other_inode(pid, handle.st, inode) is not None
