"""The holder record beside each lock: who claimed the lane, for `status` and deflection messages.

Written only by the holder, while it holds the lock, so writers never race each other. Shared by
every user of the lane (mode 0666, see MODE). Written to a temp file (O_EXCL, O_NOFOLLOW) and
renamed into place, or -- when the file at the name is already a single-named record we can write
-- rewritten in place; nothing is ever written through a symlink or a
hard link planted at either name (filelock CVE-2025-68146), and a planted sidecar symlink is refused
with a warning. The release adds its keys in place, through the descriptor the holder kept on its
own record. Both in-place writes are on the hand-off path; a reader that catches one half done sees
invalid JSON and looks again. Reads are tolerant: any bytes yield a record or a reason, never an
exception.
"""

from __future__ import annotations

import errno
import json
import os
import stat

from ... import pidns, proc
from ...holder import SCHEMA, field   # noqa: F401 - sidecar.field, as the stores read it

MAX_BYTES = 64 * 1024
# Every user of a lane writes its turns here (one root is shared by all users, and in a sticky
# directory nobody may replace another user's file): the record is writable by all, like the
# journal. Readers believe the processes it names only where /proc agrees (opens_lock,
# turns_command), so another user can at most mislabel a turn, never make one deflect or run.
MODE = 0o666
_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


class SidecarError(OSError):
    """The record could not be written; the turn keeps its lock and warns."""


class Written:
    """A record just put in place, with a descriptor on its own inode: the release extends it
    through that descriptor (no path lookup, so nothing planted at the name can be written to)."""

    __slots__ = ("fd", "size")

    def __init__(self, fd: int, size: int):
        self.fd, self.size = fd, size

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def write(dir_fd: int, name: str, record: dict, fd: int | None = None) -> Written:
    """Put record at name; returns the open record for extend().

    A record file (a regular file with no other name, which we could open for writing) is
    rewritten in place: a
    pwrite and an ftruncate, where a new file, an unlink and a rename cost ext4 three journalled
    metadata changes on the hand-off path. Anything else at the name -- no file, another user's,
    a hard link -- is replaced by a temp file renamed over it. A symlink or a non-regular file is
    refused."""
    # Keys in the order the record was built (no sort_keys: json.dumps then uses its cached
    # C encoder), so extend() can add keys by appending.
    data = (json.dumps(record) + "\n").encode()
    try:
        # fd: the record opened writable as the lock was taken (record_claim.claim): its owner
        # may have chmod'ed it since, the descriptor writes it all the same
        if fd is None:
            fd = os.open(name, os.O_WRONLY | _FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        fd = None
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise SidecarError(errno.EPERM, f"{name} is a symlink; not writing through it") from None
        if error.errno == errno.ENXIO:   # a FIFO nobody reads
            raise SidecarError(errno.EPERM, f"{name} is not a regular file; not writing through it") from None
        fd = None   # e.g. another user's record: replace it below, if the root allows
    if fd is not None:
        written = _rewrite(fd, name, data)
        if written is not None:
            return written
    return _replace(dir_fd, name, data)


def _rewrite(fd: int, name: str, data: bytes) -> Written | None:
    """In place, when fd is a single-named regular file (any user's: see MODE); None (fd closed)
    otherwise."""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SidecarError(errno.EPERM, f"{name} is not a regular file; not writing through it")
        if st.st_nlink == 1:
            # Longer than the old record: the pwrite covers it all (no truncate: one system
            # call fewer on the way to a request's first byte); shorter: the ftruncate cuts the
            # old tail. A reader between the two sees invalid JSON and read() looks again.
            if os.pwrite(fd, data, 0) == len(data):
                if len(data) < st.st_size:
                    os.ftruncate(fd, len(data))
                if st.st_mode & 0o777 != MODE and os.geteuid() in (0, st.st_uid):
                    os.fchmod(fd, MODE)   # an older lanelock's 0644 record: share it from now on
                return Written(fd, len(data))
    except SidecarError:
        os.close(fd)
        raise
    except OSError:
        pass   # e.g. a read-only descriptor's EBADF: replace it instead
    os.close(fd)
    return None


def _replace(dir_fd: int, name: str, data: bytes) -> Written:
    try:
        st = os.lstat(name, dir_fd=dir_fd)
    except FileNotFoundError:
        st = None
    except OSError as error:
        raise SidecarError(error.errno, f"cannot inspect {name}: {error.strerror}") from None
    if st is not None and not stat.S_ISREG(st.st_mode):
        kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a regular file"
        raise SidecarError(errno.EPERM, f"{name} is {kind}; not writing through it")
    folder, _, base = name.rpartition("/")   # a seat's record lives in the seats folder
    temp = f"{folder}/.{base}.{os.getpid()}.tmp" if folder else f".{name}.{os.getpid()}.tmp"
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _FLAGS, 0o600, dir_fd=dir_fd)
    except FileExistsError:
        # A leftover of a killed writer with our pid, or something planted: remove the name only.
        _unlink(temp, dir_fd)
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _FLAGS, 0o600, dir_fd=dir_fd)
        except OSError as error:
            raise SidecarError(error.errno, f"cannot write {temp}: {error.strerror}") from None
    except OSError as error:
        raise SidecarError(error.errno, f"cannot write {temp}: {error.strerror}") from None
    try:
        os.fchmod(fd, MODE)   # the umask must not narrow it: every user's turns write here
        _write_all(fd, data)
        if st is not None:
            # ext4 flushes a file's data to disk when it is renamed over an existing one
            # (auto_da_alloc): ~150 us per write. Removing the old record first avoids that; a
            # reader may find no record for a moment, never half of one.
            try:
                os.unlink(name, dir_fd=dir_fd)
            except FileNotFoundError:
                pass
        os.rename(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except OSError as error:
        os.close(fd)
        _unlink(temp, dir_fd)
        raise SidecarError(error.errno, f"cannot write {name}: {error.strerror}") from None
    return Written(fd, len(data))


def extend(written: Written, fields: dict) -> None:
    """Add keys to a record written by write(), in place: one pwrite() that replaces its closing
    "}\n" and goes on from there. A reader sees the record before or after (or, if it catches
    the write in the middle, invalid JSON, and read() looks again); never other keys' values."""
    if not fields:
        return
    tail = json.dumps(fields)   # '{"released_at": ..., ...}'
    data = (", " + tail[1:] + "\n").encode()
    try:
        if os.pwrite(written.fd, data, written.size - 2) != len(data):
            raise SidecarError(0, "short write to the sidecar")
    except SidecarError:
        raise
    except OSError as error:
        raise SidecarError(error.errno, f"cannot update the sidecar: {error.strerror}") from None
    written.size += len(data) - 2


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _unlink(name: str, dir_fd: int) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass


# -- what a record says is believed only where the kernel agrees --------------------------------
# Anyone may write the record (MODE), so it names processes, it proves nothing: a forged record
# naming pid 1 as the holder, or as a killed turn's command still running, must deflect no one
# and blame no one. Each name is checked in /proc, cheaply and without /proc/locks (each read
# stalls every flock() on the machine): a holder by its open files, a command by the environment
# its wrapper gave it. Both are readable for processes of our own user (and by root); another
# user's holder is believed when it is a lanelock process of the uid the record names (holds),
# another user's command when it is in the process group lanelock made for it, under that uid
# (turns_command).
def opens_lock(pid: int, st: os.stat_result, inode: int | None = None) -> bool | None:
    """Has pid the lock file open (st's device; st's inode, or `inode`)? None: cannot tell
    (another user's process)."""
    inode = st.st_ino if inode is None else inode
    folder = f"/proc/{pid}/fd"
    try:
        names = os.listdir(folder)
    except PermissionError:
        return None
    except OSError:
        return False   # gone
    for name in names:
        try:
            target = os.stat(f"{folder}/{name}")
        except OSError:
            continue
        if (target.st_dev, target.st_ino) == (st.st_dev, inode):
            return True
    return False


def holds(pid: int, st: os.stat_result, record: dict) -> bool:
    """Is the record's live pid believed to hold the lock file st? When it has the file open;
    for another user's process, whose open files we may not see, when it is a lanelock process
    of the uid the record names -- never pid 1 or any other process a forger picks, and no
    /proc/locks read on a turn's path."""
    seen = opens_lock(pid, st)
    if seen is not None:
        return seen
    return proc.files_uid(pid) == field(record, "uid", int) and \
        proc.describe_process(pid)["lanelock"]


def turns_command(command, lock_path: str, record: dict) -> bool:
    """Is the command a killed turn's record names (outlived.Command; its processes still
    running in .members) that turn's? The wrapper starts its command with LANELOCK_HELD naming
    the lock, and its children inherit it. Another user's environment we may not read: then a
    process of the group lanelock made for the command (its leader leads no session, as pid 1
    and every daemon does) running as the uid the record names is believed -- a forger can name
    only a job of that user, which makes the lane look held as the forger could hold it anyway.
    Anything else (pid 1) is believed to be none. One on its way out (its memory, and so its
    environment, already freed) is believed: waiting for it costs no more than its exit."""
    marker = b"\0LANELOCK_HELD=" + os.fsencode(lock_path) + b"\0"
    grouped = command.pgid == command.pid and command.sid not in (None, command.pid)
    uid = field(record, "uid", int)
    for pid in command.members or [command.pid]:
        environ = _environ(pid)
        if environ is None:   # another user's
            if grouped and uid is not None and proc.files_uid(pid) == uid:
                return True
        elif marker in environ or proc.exiting(pid):
            return True
    return False


def _environ(pid: int) -> bytes | None:
    """The process's environment (NUL-framed), b"" when gone; None when we may not read it."""
    try:
        fd = os.open(f"/proc/{pid}/environ", os.O_RDONLY | os.O_CLOEXEC)
    except PermissionError:
        return None
    except OSError:
        return b""
    chunks = [b"\0"]
    try:
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    except OSError:
        return b""
    finally:
        os.close(fd)
    return b"".join(chunks) + b"\0"


def read(path: str, dir_fd: int | None = None, *,
         live_only: bool = False) -> tuple[dict | None, str | None]:
    """(record, None) or (None, reason a person can read). Never raises. live_only: a record
    whose turn has ended is (None, RELEASED), unparsed -- the acquire path's question is only
    "does a live turn claim this lane?", and a parse costs it a tenth of a millisecond."""
    record, problem = _read_once(path, dir_fd, live_only)
    if problem == NOT_JSON:   # perhaps caught mid-write: one more look
        record, problem = _read_once(path, dir_fd, live_only)
    return record, problem


NOT_JSON = "sidecar is not valid JSON"
MISSING = "no sidecar yet"   # status's "never used", not "sidecar-bad"
RELEASED = "the sidecar's turn has ended"
# json.dumps escapes every quote inside a string, so these bytes can only be a key.
_RELEASED_KEY = b'"released_at": '


def _read_once(path: str, dir_fd: int | None, live_only: bool) -> tuple[dict | None, str | None]:
    try:
        fd = os.open(path, os.O_RDONLY | _FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return None, MISSING
    except OSError as error:
        if error.errno == errno.ELOOP:
            return None, "sidecar is a symlink; not following it"
        return None, f"sidecar unreadable: {error.strerror}"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None, "sidecar is not a regular file"
        if st.st_size > MAX_BYTES:
            return None, f"sidecar is {st.st_size} bytes, over the {MAX_BYTES} byte limit"
        raw = os.read(fd, MAX_BYTES + 1)
    except OSError as error:
        return None, f"sidecar unreadable: {error.strerror}"
    finally:
        os.close(fd)
    if live_only and _RELEASED_KEY in raw:
        return None, RELEASED
    return parse(raw)


def parse(raw: bytes) -> tuple[dict | None, str | None]:
    if len(raw) > MAX_BYTES:
        return None, f"sidecar is over the {MAX_BYTES} byte limit"
    try:
        record = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        return None, "sidecar is not UTF-8 text"
    except (ValueError, RecursionError):
        return None, NOT_JSON
    if not isinstance(record, dict):
        return None, "sidecar is not a JSON object"
    version = record.get("schema")
    if not isinstance(version, int) or isinstance(version, bool):
        return None, "sidecar has no schema version"
    if version > SCHEMA:
        return None, f"sidecar schema {version} is newer than this lanelock understands ({SCHEMA})"
    return pidns.translated({key: value for key, value in record.items() if _plain(value)}), None


def _plain(value: object, depth: int = 0) -> bool:
    """Keep only shallow, sane values: a hostile record must not make renderers work hard.
    json.loads makes exact types, so type() checks suffice (and cost less on every acquire)."""
    kind = type(value)
    if kind is str:
        return len(value) <= 8192
    if kind is int:
        return -(1 << 63) < value < 1 << 63
    if value is None or kind is bool:
        return True
    if kind is float:
        return value == value and -1e300 < value < 1e300
    if kind is list and depth < 1:
        return len(value) <= 1024 and all(_plain(item, depth + 1) for item in value)
    return False
