"""Values kept with the lanes on a PostgreSQL server (the lanelock_kept table: one value every host
reads -- a lane's seat count, a backend's model map): the PostgreSQL store's kept/keep, each on a
short connection (shared.py), never a turn's own. The flock store's twin is flock/kept.py."""

from __future__ import annotations

import json

from ...errors import GateUnavailable
from . import shared
from .session import NOT_KEPT, driver, first_line, keeps, redact


def read(store, name: str):
    """The value kept under name, or None."""
    return _asked(store, f"lanelock kept {name}", lambda conn: read_kept(conn, name))


def write(store, name: str, value) -> None:
    """value kept under name (None: forgotten)."""
    _asked(store, f"lanelock keep {name}", lambda conn: write_kept(conn, name, value))


def _asked(store, application_name: str, function):
    """function(a connection of its own) on the table of kept values; GateUnavailable when the
    server cannot be reached or the table cannot be made or read."""
    with shared.asking(store, application_name) as (conn, problem):
        if not keeps(conn):   # never a statement on a missing table: an ERROR in the log
            raise GateUnavailable(f"lane store {redact(store.dsn)}: {problem or NOT_KEPT}")
        try:
            return function(conn)
        except driver().Error as error:
            raise GateUnavailable(f"lane store {redact(store.dsn)}: "
                                  f"{problem or first_line(error)}") from None


def read_kept(conn, name: str):
    row = conn.execute("SELECT value FROM lanelock_kept WHERE name = %s", (name,)).fetchone()
    return None if row is None else row[0]


def write_kept(conn, name: str, value) -> None:
    if value is None:
        conn.execute("DELETE FROM lanelock_kept WHERE name = %s", (name,))
        return
    conn.execute("INSERT INTO lanelock_kept (name, value) VALUES (%s, %s::jsonb) "
                 "ON CONFLICT (name) DO UPDATE SET value = EXCLUDED.value",
                 (name, json.dumps(value)))
