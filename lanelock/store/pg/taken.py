"""Is a PostgreSQL lock just taken really the lane's to use (store.py takes it)? The session must
be ours (a transaction-mode pooler would hand the next statement to another backend, where the
lock does not live); a row whose turn never released is a claim to wait out (a restart's: the
holder takes its lane back; a lease's: the holder may still be cut off and generating), or the
record of a killed turn whose command may run on (outlived.py); and a holder of this host is
waited for by its death, not by polling."""

from __future__ import annotations

from ...errors import GateUnavailable
from .. import outlived
from . import outage
from . import queue as pg_queue
from .handle import PgHandle
from .session import driver


def holder_death(handle: PgHandle) -> int | None:
    """A pidfd of the lane's holder when it is a process of this host: its row, written by
    the session that holds the lock now (its start time checked), names it."""
    from ...facts import hostname

    try:
        with handle.conn.cursor() as cursor:
            cursor.execute("SELECT h.record->'pid', h.record->'start_ticks' FROM "
                           "lanelock_holders h JOIN pg_locks l ON l.pid = h.backend_pid "
                           "AND l.locktype = 'advisory' AND l.granted AND l.classid = %s "
                           "AND l.objid = %s AND l.objsubid = 2 "
                           "WHERE h.key2 = %s AND h.record->>'hostname' = %s",
                           (handle.key[0] & 0xFFFFFFFF, handle.key[1] & 0xFFFFFFFF,
                            handle.key[1], hostname()))
            row = cursor.fetchone()
    except driver().Error:
        return None   # no holder table (records only label turns): asked every RECHECK
    return None if row is None else pg_queue.death_of(row[0], row[1])


def same_session(store, handle: PgHandle, backend: int | None = None) -> bool:
    """The session (and so the lock) is ours: a transaction-mode pooler would hand later
    statements to another backend, where the session lock does not live. backend: the pid
    the statement that took the lock ran on (asked now when not given)."""
    if backend is None:
        backend = store._call(handle, "SELECT pg_backend_pid()", ())
    if backend != handle.backend_pid:
        raise GateUnavailable("the lane store connection goes through a transaction-mode "
                              "pooler (backend pid changed); connect to PostgreSQL directly")
    record, handle.claimed = unreleased(handle)
    handle.outlived = outlived.running_command(record)
    if handle.outlived is not None and handle.taken is not None:
        handle.taken.queue = None   # the look comes after that command's end: read then
    return True


def unreleased(handle: PgHandle) -> tuple[dict | None, float | None]:
    """The lane's row when its turn never released, in one query (a row only then, so the
    usual hand-off reads nothing back): (its record when the turn was this machine's -- it
    was killed, its command may run on --, the seconds left of its claim when it held the
    lane as the server went down: outage.CLAIM_GRACE from the server's start).
    handle.unreleased: that turn's record (with its fence) when this take stands -- no claim
    holds it off: the lane was taken from a turn that never let it go (lost, or killed)."""
    from ...facts import hostname
    from .handoff import NOT_READ, UNRELEASED

    handle.unreleased = None
    taken = handle.taken
    if taken is not None and taken.row is not NOT_READ:   # read with the try (handoff.py)
        row, taken.row = taken.row, NOT_READ
    else:
        try:
            with handle.conn.cursor() as cursor:
                cursor.execute(UNRELEASED, (hostname(), outage.CLAIM_GRACE, handle.key[1]))
                row = cursor.fetchone()
        except driver().Error:
            return None, None   # no holder table (records only label turns): none to wait for
    if row is None:
        return None, None
    record, here, claim = row
    claim = claim if claim is not None and claim > 0 else None
    if claim is not None and here and ended_here(record):
        claim = None   # its turn died on this host: nothing will take the lane back
    if claim is None and isinstance(record, dict):
        handle.unreleased = record
    return record if here and isinstance(record, dict) else None, claim


def ended_here(record) -> bool:
    """Has the turn of this host a holder row names ended (its process gone, or another process
    since under its pid)? A lease or a restart's claim keeps the lane for a holder that can
    still take it back, never for one that is gone."""
    from ...proc import start_ticks

    if not isinstance(record, dict) or not isinstance(record.get("pid"), int):
        return False
    ticks = record.get("start_ticks")
    now = start_ticks(record["pid"])
    return now is None or (ticks is not None and now != ticks)
