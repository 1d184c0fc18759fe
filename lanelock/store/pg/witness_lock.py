"""The PostgreSQL store's witness claim: one witness per lane across every host. A session advisory
lock on (WITNESS_NAMESPACE, the lane's key) in a connection of its own, held while the witness
runs; the server lets go of it when that session ends, however the witness ends. The flock
store's twin is flock/witness_file.py."""

from __future__ import annotations

import os

from ...errors import GateUnavailable
from .handle import PgHandle, lane_key
from .session import driver, first_line, redact
from .survey import lockers

WITNESS_NAMESPACE = 0x4C4E5754   # "LNWT": the lane's one witness, never a lane's or a queue's key


def claim(store, lane, who: str | None = None) -> tuple:
    """(a handle holding the lane's witness lock, None), or (None, who holds it)."""
    from ...facts import hostname

    psycopg = driver()
    key = (WITNESS_NAMESPACE, lane_key(lane.name)[1])
    conn = store.connect(f"lanelock witness {who or f'pid {os.getpid()} on {hostname()}'}"[:63])
    try:
        with conn.cursor() as cursor:
            cursor.execute("SELECT pg_try_advisory_lock(%s, %s)", key)
            if cursor.fetchone()[0]:
                return PgHandle(conn, lane.name, key, 0), None
            names = [app for _, granted, app, _ in lockers(cursor, key) if granted and app]
        conn.close()
        return None, (names[0].removeprefix("lanelock witness ") if names
                      else "another session")
    except psycopg.Error as error:
        conn.close()
        raise GateUnavailable(f"lane store {redact(store.dsn)}: {first_line(error)}") from None
