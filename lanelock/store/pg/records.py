"""What a turn writes to a PostgreSQL lane (store.py delegates here): its holder row with the
fence the server counts, its events in one statement, and the lane's counts for metrics --
each in as few round trips as the hand-off allows (handoff.py)."""

from __future__ import annotations

import json
import time

from ...errors import GateUnavailable, RecordNotWritten
from . import lease, shared
from .rows import WRITE_FENCED, WRITE_UNFENCED, holder_params
from .session import driver, fenced, first_line


def write_holder(handle, record: dict) -> None:
    """The turn's row. Its generation (the fence) grows by one when a turn other than the row's
    last one writes it -- counted in the server, in the statement that writes the row, under
    the lane's lock: no two turns can have the same one, and a later turn always has a larger
    one. The same turn writing again (its command, ^Z, a regained lane, its release) keeps its
    fence. handle.fence is the row's generation afterwards."""
    from .handoff import flush_leave, with_leave

    # A watched hold is leased from its first write, its session's idle limit set in the same
    # round trip (lease.py): a link lost before the watch's first renewal was answered still
    # leaves the holder a deadline it knows, the row says it, and the server ends the session.
    front = []
    if lease.WATCHED and not handle.lease:
        handle.lease, front = lease.LEASE, lease.arming(handle.conn)
    params = holder_params(handle, record)
    psycopg = driver()
    sent = time.monotonic()   # the row's updated_at renews a lease too (lease.py)
    try:
        with handle.conn.cursor() as cursor:
            handle.fence = None
            if not fenced(handle.conn):
                # Tables of an earlier lanelock this role may not alter (ensure_schema left
                # them as they are): the record is written, without a fence.
                flush_leave(handle)
                for sql, values in front:
                    cursor.execute(sql, values)
                cursor.execute(WRITE_UNFENCED, params)
            else:
                try:   # the queue left by a turn that took the lane, in the same round trip
                    handle.fence = with_leave(handle, WRITE_FENCED, params, front)
                except psycopg.errors.UndefinedColumn:   # the column dropped since: the same
                    flush_leave(handle)
                    cursor.execute(WRITE_UNFENCED, params)
        if handle.lease:
            handle.lease_from = sent
    except psycopg.Error as error:
        flush_leave(handle)
        raise RecordNotWritten(f"lane store: {first_line(error)}") from None


def append_event(store, handle, *events: dict) -> None:
    if handle.releasing is not None:   # the release's events, written with its row
        handle.releasing.events.extend(events)
        return
    rows = [(handle.lane, event.get("ts", time.time()), json.dumps(event)) for event in events]
    # One statement, one round trip however many events, in their order. Not pipelined: a
    # pipeline's closing Flush leaves the server's session without its idle limit
    # (idle_session_timeout is armed only as it says it is ready for a query), and this is a
    # holder's last word before its watch renews (lease.py).
    try:
        store._call(handle, "INSERT INTO lanelock_events (lane, ts, event) VALUES " +
                    ", ".join(["(%s, %s, %s)"] * len(rows)),
                    [value for row in rows for value in row], fetch=False)
    except GateUnavailable as error:
        raise RecordNotWritten(str(error)) from None


def events(store, lane, since: float | None) -> tuple:
    with shared.asking(store, f"lanelock history {lane.name}") as (conn, _):
        with conn.cursor() as cursor:
            cursor.execute("SELECT event FROM lanelock_events WHERE lane = %s AND ts >= %s "
                           "ORDER BY ts, id", (lane.name, since if since is not None else 0.0))
            rows = cursor.fetchall()
    found = [row[0] for row in rows if isinstance(row[0], dict)]
    return found, len(rows) - len(found)


# -- the lane's counts (metrics) ---------------------------------------------------------------
def count_apart(store, lane: str, count: dict) -> None:
    """A count on a connection of its own (the process's shared one in a proxy)."""
    try:
        with shared.asking(store, f"lanelock count {lane}", False) as (conn, _):
            add_count(conn, lane, count)
    except GateUnavailable:
        return


def add_count(conn, lane: str, count: dict) -> None:
    """Read, add, write in one transaction with the row locked: concurrent turns add up."""
    from .. import counts

    psycopg = driver()
    try:
        with conn.transaction(), conn.cursor() as cursor:
            cursor.execute("INSERT INTO lanelock_counts (lane, counts) VALUES (%s, %s) "
                           "ON CONFLICT (lane) DO NOTHING", (lane, json.dumps(counts.empty())))
            cursor.execute("SELECT counts FROM lanelock_counts WHERE lane = %s FOR UPDATE",
                           (lane,))
            row = cursor.fetchone()
            data = counts.merge(row[0] if row else None, **count)
            cursor.execute("UPDATE lanelock_counts SET counts = %s WHERE lane = %s",
                           (json.dumps(data), lane))
    except psycopg.Error:
        pass   # metrics only: a turn never warns about a count


def counts_of(store, facts) -> dict:
    from .. import counts

    # Counts that cannot be read are unknown, never 0: a 0 would read as a reset to Prometheus
    # (and the next scrape's total as that many new turns).
    try:
        with shared.asking(store, "lanelock metrics", False) as (conn, _):
            row = conn.execute("SELECT counts FROM lanelock_counts WHERE lane = %s",
                               (facts.lane,)).fetchone()
    except GateUnavailable as error:
        return dict(counts.unknown(), problem=str(error))
    except driver().Error as error:
        return dict(counts.unknown(), problem=f"lane store counts: {first_line(error)}")
    return dict(counts.merge(row[0] if row else None, outcome=None), problem=None)
