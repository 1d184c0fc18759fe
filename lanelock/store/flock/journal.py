"""The per-lane history: one JSON line per event, beside the lock.

Each event is one write() on an O_APPEND descriptor, so concurrent turns never interleave or lose a
line (Linux appends a single write to a regular file atomically with respect to other appenders).
Rotation renames the journal to NAME.1 and happens only while holding the lane (open_for_append), so
two rotators can never race; an appender still holding the old descriptor lands its line in NAME.1.

A line is written whole or not at all. A full disk (or a file size limit) can store part of a
write; the part is blanked in place -- spaces and a newline over the very bytes that write was
given, which no other appender can have been given and which need no new block -- so the next
line starts a line of its own. Truncating instead would race with another appender landing a line
after ours. A writer killed between the two leaves the torn part: a reader counts it unreadable
and resynchronises at the next line of ours glued to it (every line starts with '{"event": ').
Long values are cut field by field before serialising (fit()), never the JSON text.
"""

from __future__ import annotations

import errno
import json
import os
import stat

from ..shared_file import checked

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
            _blank(fd, written)
            raise JournalError(0, f"short write to {name} ({written} of {len(data)} bytes; "
                                  "the disk is full?): not written")
    except OSError as error:
        if isinstance(error, JournalError):
            raise
        raise JournalError(error.errno, f"cannot append to {name}: {error.strerror}") from None
    finally:
        if own:
            os.close(fd)


def _blank(fd: int, written: int) -> None:
    """After a short append of `written` bytes: spaces and a newline over exactly those bytes.
    They are ours (O_APPEND gave this write that range, whatever others appended since), and
    they are allocated already, so overwriting them needs no space the disk lacks. pwrite() on
    an O_APPEND descriptor appends on Linux, so O_APPEND is off for the moment (the descriptor
    is this process's own)."""
    if written <= 0:
        return
    import fcntl

    try:
        end = os.lseek(fd, 0, os.SEEK_CUR)   # where this write ended
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_APPEND)
        try:
            os.pwrite(fd, b" " * (written - 1) + b"\n", end - written)
        finally:
            fcntl.fcntl(fd, fcntl.F_SETFL, flags)
    except OSError:
        pass   # the torn part stays: readers count it unreadable and resynchronise after it


FIELD_LIMITS = (1024, 256, 64)   # characters kept of one long value, tried in turn


def _line(event: dict) -> str:
    line = json.dumps(event)   # ASCII; keys in the order built (json's cached C encoder)
    if len(line) >= MAX_LINE:   # rare: serialised a second time only then
        line = json.dumps(fit(event))
    return line + "\n"


def fit(event: dict, max_line: int = MAX_LINE) -> dict:
    """The event as it fits one journal line: when its JSON is too long, its long values are cut
    field by field (strings, and those inside lists and dicts: a holder's command) to 1,024
    characters, then 256, then 64, each ending in '…', and "cut" lists the top-level fields
    that were; a line still too long keeps only what history needs. JSON escapes make a
    character up to 12 bytes ("\\ud83d\\ude00"), so the limit is the serialised length."""
    if len(json.dumps(event)) < max_line:
        return event
    for limit in FIELD_LIMITS:
        cut = [key for key, value in event.items() if _longer(value, limit)]
        fitted = {key: _cut(value, limit) for key, value in event.items()}
        fitted["cut"] = cut
        if len(json.dumps(fitted)) < max_line:
            return fitted
    kept = {key: _cut(value, 64) for key, value in event.items() if key in ESSENTIAL}
    kept["cut"] = [_cut(str(key), 64) for key in sorted(set(event) - set(kept), key=str)[:64]]
    return kept


# What history, metrics and status's estimate read of an event: kept when nothing else fits.
ESSENTIAL = ("event", "time", "ts", "monotonic", "lane", "pid", "turn", "outcome", "priority",
             "duration", "exit_status", "wait", "waited", "of", "start_ticks", "boot_id",
             "hostname", "reason", "via", "ended")


def _longer(value, limit: int) -> bool:
    if isinstance(value, str):
        return len(value) > limit
    if isinstance(value, dict):
        return any(_longer(item, limit) for item in value.values())
    if isinstance(value, (list, tuple)):
        return len(value) > limit or any(_longer(item, limit) for item in value)
    return False


def _cut(value, limit: int):
    if isinstance(value, str):
        return value if len(value) <= limit else value[:limit] + "…"
    if isinstance(value, dict):
        return {key: _cut(item, limit) for key, item in list(value.items())[:limit]}
    if isinstance(value, (list, tuple)):
        return [_cut(item, limit) for item in value[:limit]]
    return value


def open_for_append(dir_fd: int, name: str, max_bytes: int) -> int:
    """A descriptor for a holder's events, rotating first when the journal is past max_bytes.
    Only the holder of a lane's seat 1 calls it with a limit, so only one process ever rotates
    at a time."""
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
    try:   # a FIFO, a directory or a hard link to someone's file planted at the name
        return checked(fd, name)
    except OSError as error:
        raise JournalError(error.errno, error.strerror) from None


# Lines from several processes land a little out of time order (each takes its time, then
# appends): a line this much older than `since` is taken to have none newer than `since` before it.
SLACK = 60.0
CHUNK = 64 * 1024


def read(path: str, *, since: float | None = None,
         max_bytes: int = 64 << 20) -> tuple[list[dict], int]:
    """(events, number of unreadable lines), oldest first, from PATH.1 then PATH. Never raises.
    With since, the events from then on (a ts that is no number counts as 0), and only the
    journal's end is read -- back from its last line to one older than since by SLACK, and
    PATH.1 only when PATH does not go back that far: a status refreshed every half second asks
    for the last hour of a journal that may hold 2 MiB of days."""
    chunks = []
    for candidate in (path, path + ".1"):
        raw, reached = _read_file(candidate, since, max_bytes)
        chunks.insert(0, raw)
        if reached:
            break
    events: list[dict] = []
    bad = 0
    for raw in chunks:
        for line in raw.split(b"\n"):
            event = _event(line)
            if event is None and line.strip():
                bad += 1
                event = _glued(line)
            if event is not None and (since is None or (_ts(event) or 0.0) >= since):
                events.append(event)
    return events, bad


START = b'{"event": '   # how every line of ours starts; inside a JSON string a quote is escaped


def _glued(line: bytes) -> dict | None:
    """A line of ours glued to the end of a torn one (its writer was killed between a short
    write and blanking it): the last start of a line in it that parses."""
    start = line.rfind(START)
    while start > 0:
        event = _event(line[start:])
        if event is not None:
            return event
        start = line.rfind(START, 0, start)
    return None


def _read_file(path: str, since: float | None, max_bytes: int) -> tuple[bytes, bool]:
    """(the file's lines -- with since, whole lines from its end; whether those go back past
    since - SLACK)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return b"", False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return b"", False
        if since is None:
            return os.pread(fd, min(max_bytes, st.st_size), 0), False
        return _tail(fd, st.st_size, since - SLACK, max_bytes)
    except OSError:
        return b"", False
    finally:
        os.close(fd)


def _tail(fd: int, size: int, before: float, max_bytes: int) -> tuple[bytes, bool]:
    """Chunks read back from the end until the first whole line in them is older than
    `before` (then True) or the file's start or max_bytes is reached."""
    chunks: list[bytes] = []   # the earliest last
    start = size
    while start > 0 and size - start < max_bytes:
        step = min(CHUNK, start)
        start -= step
        chunks.append(os.pread(fd, step, start))
        head = 0 if start == 0 else chunks[-1].find(b"\n") + 1
        if head or not start:
            ts = _ts(_event(_line_at(chunks, head)))
            if ts is not None and ts < before:
                return b"".join(reversed(chunks))[head:], True
    data = b"".join(reversed(chunks))
    return (data if start == 0 else data[data.find(b"\n") + 1:]), False


def _line_at(chunks: list[bytes], head: int) -> bytes:
    """The line that begins at `head` of the earliest chunk, up to its newline (or MAX_LINE:
    longer is no line of ours)."""
    parts, length = [], 0
    for index in range(len(chunks) - 1, -1, -1):
        piece = chunks[index][head if index == len(chunks) - 1 else 0:]
        end = piece.find(b"\n")
        parts.append(piece if end < 0 else piece[:end])
        length += len(parts[-1])
        if end >= 0 or length > MAX_LINE:
            break
    return b"".join(parts)


def _event(line: bytes) -> dict | None:
    if not line.strip():
        return None
    try:
        event = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    return event if isinstance(event, dict) and isinstance(event.get("event"), str) else None


def _ts(event: dict | None) -> float | None:
    ts = None if event is None else event.get("ts")
    return float(ts) if isinstance(ts, (int, float)) and not isinstance(ts, bool) else None
