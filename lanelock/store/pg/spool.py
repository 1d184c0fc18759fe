"""What a PostgreSQL turn could not tell its server, kept on its host until a turn that reaches
the server carries it there: the `fail-open` events and `fail_open` counts of turns that ran
ungated while the server could not be reached (a turn asks an unreachable server once: the
record goes here, not to a second connect that would wait out its timeout again).

One file per store under the lock root (SPOOL_PREFIX + a digest of the redacted DSN: a hidden
name, as the host lanes'), opened the one way shared files are (store/shared_file.py), one JSON
line per record, appended under the file's flock. A turn that released the lane on a live
session carries the spool after its own count (off the hand-off's path): every line in one
transaction, then the file emptied, under the same flock -- a carrier that dies between the
commit and the emptying leaves the lines to be carried twice (counts are metrics; the events are
stamped, and read as two).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os

SPOOL_PREFIX = ".pg-spool-"


def name(dsn: str) -> str:
    from .session import redact

    return SPOOL_PREFIX + hashlib.sha256(redact(dsn).encode()).hexdigest()[:16]


def keep(store, lane: str, event: dict | None = None, count: dict | None = None) -> None:
    """One record (an event, a count, or both) appended to the store's spool; never raises (a
    record that cannot be kept is lost, as it was before)."""
    line = (json.dumps({"lane": lane, "event": event, "count": count}) + "\n").encode()
    fd = _open(store)
    if fd is None:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.lseek(fd, 0, os.SEEK_END)
        os.write(fd, line)
    except OSError:
        pass
    finally:
        os.close(fd)


def carry(store, conn) -> None:
    """The spool's records into the server on conn, when there are any and no other turn is
    carrying them; never raises (what cannot be carried stays for the next turn)."""
    from .records import add_count
    from .session import driver

    fd = _open(store, create=False)
    if fd is None:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        data = b""
        while chunk := os.pread(fd, 1 << 20, len(data)):
            data += chunk
        records = [record for line in data.splitlines() if (record := _parsed(line))]
        if not records:
            return
        events = [(record["lane"], record["event"].get("ts", 0.0), json.dumps(record["event"]))
                  for record in records if isinstance(record.get("event"), dict)]
        with conn.transaction():
            if events:
                with conn.cursor() as cursor:
                    cursor.execute("INSERT INTO lanelock_events (lane, ts, event) VALUES " +
                                   ", ".join(["(%s, %s, %s)"] * len(events)),
                                   [value for row in events for value in row])
            for record in records:
                if isinstance(record.get("count"), dict):
                    add_count(conn, record["lane"], record["count"])
        os.ftruncate(fd, 0)
    except (OSError, driver().Error):
        pass
    finally:
        os.close(fd)


def _parsed(line: bytes) -> dict | None:
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) and isinstance(record.get("lane"), str) else None


def _open(store, create: bool = True) -> int | None:
    """The spool's descriptor (None: no lock root, no spool, or not a file to write)."""
    from ..shared_file import open_existing, open_shared
    from ...errors import GateUnavailable
    from ...paths import open_root

    try:
        root_fd = open_root(store._root(), create=False)   # the root as every turn opens it
    except (OSError, GateUnavailable):
        return None
    try:
        return (open_shared if create else open_existing)(root_fd, name(store.dsn))
    except OSError:
        return None
    finally:
        os.close(root_fd)
