"""The per-lane history: one JSON line per event, beside the lock.

Each event is one write() on an O_APPEND descriptor, so concurrent turns never interleave or lose a
line (Linux appends a single write to a regular file atomically with respect to other appenders).
Rotation renames the journal to NAME.1 and happens only while holding the lane (open_for_append), so
two rotators can never race; an appender still holding the old descriptor lands its line in NAME.1.
"""

from __future__ import annotations

import errno
import json
import os
import stat

DEFAULT_MAX_BYTES = 1 << 20   # rotate past 1 MiB; one generation (.1) is kept
MAX_LINE = 16 * 1024
_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


class JournalError(OSError):
    """An event could not be appended; the turn goes on and warns."""


def append(dir_fd: int, name: str, events: list[dict], fd: int | None = None) -> None:
    """Events as one write() (a line each). With fd (an open_for_append() descriptor) nothing is
    opened."""
    data = "".join(_line(event) for event in events).encode()
    own = fd is None
    if own:
        fd = _open(dir_fd, name)
    try:
        written = os.write(fd, data)
        if written != len(data):
            raise JournalError(0, f"short write to {name} ({written} of {len(data)} bytes)")
    except OSError as error:
        if isinstance(error, JournalError):
            raise
        raise JournalError(error.errno, f"cannot append to {name}: {error.strerror}") from None
    finally:
        if own:
            os.close(fd)


def _line(event: dict) -> str:
    line = json.dumps(event)   # ASCII; keys in the order built (json's cached C encoder)
    if len(line) >= MAX_LINE:
        event = {k: v for k, v in event.items() if k not in ("argv", "holder")}
        event["truncated"] = True
        line = json.dumps(event)[:MAX_LINE - 2]
    return line + "\n"


def open_for_append(dir_fd: int, name: str, max_bytes: int) -> int:
    """A descriptor for a holder's events, rotating first when the journal is past max_bytes.
    Only a holder calls this, so only one process ever rotates at a time."""
    fd = _open(dir_fd, name)
    if os.fstat(fd).st_size < max_bytes:
        return fd
    os.close(fd)
    try:
        os.rename(name, name + ".1", src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except OSError:
        pass   # could not rotate: keep appending to the old file
    return _open(dir_fd, name)


def _open(dir_fd: int, name: str) -> int:
    # Open an existing journal without O_CREAT: in a sticky directory protected_regular refuses
    # O_CREAT on another user's file even when it is writable.
    try:
        fd = os.open(name, _FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        try:
            fd = os.open(name, _FLAGS | os.O_CREAT | os.O_EXCL, 0o666, dir_fd=dir_fd)
            os.fchmod(fd, 0o666)   # every local user appends to the same history
        except FileExistsError:
            return _open(dir_fd, name)
        except OSError as error:
            raise JournalError(error.errno, f"cannot create {name}: {error.strerror}") from None
    except OSError as error:
        reason = "is a symlink; not writing through it" if error.errno == errno.ELOOP else error.strerror
        raise JournalError(error.errno, f"cannot open {name}: {reason}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):   # a FIFO or device planted at the name
        os.close(fd)
        raise JournalError(0, f"{name} is not a regular file")
    return fd


def read(path: str, *, max_bytes: int = 64 << 20) -> tuple[list[dict], int]:
    """(events, number of unreadable lines), oldest first, from PATH.1 then PATH. Never raises."""
    events: list[dict] = []
    bad = 0
    for candidate in (path + ".1", path):
        try:
            fd = os.open(candidate, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                continue
            with os.fdopen(os.dup(fd), "rb") as handle:
                raw = handle.read(max_bytes)
        except OSError:
            continue
        finally:
            os.close(fd)
        for line in raw.splitlines():
            if not line.strip():
                continue
            try:
                event = json.loads(line.decode("utf-8"))
            except (UnicodeDecodeError, ValueError, RecursionError):
                bad += 1
                continue
            if isinstance(event, dict) and isinstance(event.get("event"), str):
                events.append(event)
            else:
                bad += 1
    return events, bad
