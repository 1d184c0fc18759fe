"""The hand-off's round trips on the PostgreSQL store: what a turn reads as it takes the lane and
what a holder writes as it lets the lane go, each in ONE round trip, in an order that keeps what
the separate statements they replace guaranteed.

Taking (try_and_read): the try, and pipelined behind it, each in a statement of its own -- so
each reads after the lock is had, a statement's snapshot being taken as it starts (the session
reads committed: session.py) -- the lane's row when its turn never released (taken.unreleased:
a claim, a command that may run on, a took-over) and the lane's queue (the look the order takes
once the lock is its: PgLine.look, order.keep_free_lane). The queue is read only when the try
took the lock (TAKEN, a session setting the try sets), so a busy try costs the server no more.

Letting go (let_go): the release's row and events (store.write_release and append_event keep
them for it) in a transaction committed BEFORE the unlock, then the unlock and its wake-up: one
simple query of several statements. A turn that takes the lane once it is free reads the row
released; an unlock inside the writes' transaction would free the lane before they commit, and
a taker would read the turn as one that never released (a false took-over). With a waiter of
this host on its host lane, the unlock's statement lets go only once a head of this host is in
the server's queue (hostqueue.await_next_head: no barging across hosts), in the same query.

A taker's queue leave (PgLine.leave) goes with its session's next statement instead of before
its turn begins: the waiters behind it wait on its ticket meanwhile, and would find the lane
held anyway.
"""

from __future__ import annotations

import json

from ...errors import GateUnavailable, RecordNotWritten
from . import queue as pg_queue
from .rows import WRITE_FENCED, WRITE_UNFENCED, holder_params
from .session import driver, ended, fenced, first_line

TAKEN = "lanelock.taken"   # this session's last try took the lane's lock ('true'/'false')
TRY = ("SELECT tried.got, pg_backend_pid(), set_config('" + TAKEN + "', tried.got::text, false) "
       "FROM (SELECT pg_try_advisory_lock(%s, %s) AS got) AS tried")
TRY_ALONE = "SELECT pg_try_advisory_lock(%s, %s), pg_backend_pid()"
# The lane's row while its turn has not released: (record, a turn of this host, the seconds
# left of its claim when it held the lane as the server went down: outage.CLAIM_GRACE, or of
# its lease: lease.py).
# A leased row (lease.py) holds off takers until its lease, counted from its last renewal, ends.
UNRELEASED = ("SELECT record, record->>'hostname' = %s, GREATEST(CASE WHEN updated_at < "
              "pg_postmaster_start_time() THEN %s - extract(epoch FROM "
              "clock_timestamp() - pg_postmaster_start_time())::float8 END, "
              "(record->>'lease')::float8 - extract(epoch FROM clock_timestamp() - "
              "updated_at)::float8) "
              "FROM lanelock_holders WHERE key2 = %s AND NOT record ? 'released_at'")
QUEUE_IF_TAKEN = pg_queue.LIVE + f" AND current_setting('{TAKEN}') = 'true'"
# A live waiter of this host in the lane's server queue (store.host_queued's question).
_HEAD_HERE = ("EXISTS (SELECT 1 FROM lanelock_queue q JOIN pg_locks l ON l.locktype = "
              "'advisory' AND l.granted AND l.mode = 'ExclusiveLock' AND l.classid = %s "
              "AND l.objid = (q.ticket %% 2147483647)::oid AND l.objsubid = 2 AND l.database = "
              "(SELECT oid FROM pg_database WHERE datname = current_database()) "
              "WHERE q.lane = %s AND q.facts->>'hostname' = %s)")
_UNLOCK = "SELECT pg_advisory_unlock(%s, %s), pg_notify(%s, '')"


NOT_READ = object()   # a Taken's row once used


class Taken:
    """What a try that took the lock read after it: the unreleased row (a row, or None) and the
    queue's rows (pg_queue.LIVE's), each used once (taken.unreleased, store.taken_queue)."""

    __slots__ = ("row", "queue")

    def __init__(self, row, queue):
        self.row, self.queue = row, queue


class Releasing:
    """A holder's release kept for let_go: the row to write and the events to append."""

    __slots__ = ("record", "events")

    def __init__(self, record: dict):
        self.record, self.events = record, []


def try_and_read(store, handle) -> tuple[bool, int]:
    """(taken, the backend pid the try ran on), with handle.taken set when taken and the reads
    after it could be made (a Taken; None: the caller reads them itself). A server error of the
    try is GateUnavailable; one of the reads (no tables: records only label turns) is not,
    and the handle tries alone from then on (handle.reads False)."""
    from ...facts import hostname
    from .outage import CLAIM_GRACE

    psycopg = driver()
    handle.taken = None
    store.connected(handle)
    conn = handle.conn
    if not handle.reads or not psycopg.Pipeline.is_supported():
        held, backend = store._call(handle, TRY_ALONE, handle.key, row=True)
        return held, backend
    tried, row, queue = conn.cursor(), conn.cursor(), conn.cursor()
    failed = None
    try:
        with conn.pipeline():
            tried.execute(TRY, handle.key)
            row.execute(UNRELEASED, (hostname(), CLAIM_GRACE, handle.key[1]))
            queue.execute(QUEUE_IF_TAKEN, (pg_queue.QUEUE_NAMESPACE, handle.lane))
    except psycopg.Error as error:
        failed = error
    try:
        held, backend, _ = tried.fetchone()
        if held and failed is None:
            handle.taken = Taken(row.fetchone(), queue.fetchall())
    except (psycopg.Error, TypeError):
        raise GateUnavailable(f"lane store: {first_line(failed or 'no answer')}") from None
    finally:
        for cursor in (tried, row, queue):
            cursor.close()
    if failed is not None and not ended(conn):
        handle.reads = False   # the reads failed, not the session: each read alone from now
    return held, backend


# -- the queue leave of a turn that took the lane -------------------------------------------------
def _leave_sql(handle) -> list[tuple]:
    statements = []
    if handle.leaving is not None:
        ticket, listening = handle.leaving
        statements.append((pg_queue.LEAVE, pg_queue.leave_params(ticket)))
        if listening:   # a holder's session is not woken by the queue for the rest of its turn
            statements.append((f"UNLISTEN {pg_queue.CHANNEL}", None))
    # nor by the seats' channels its wait listened on (seats.py)
    statements += [(f"UNLISTEN {channel}", None) for channel in handle.unlisten]
    return statements


def _left(handle) -> None:
    handle.leaving, handle.unlisten = None, ()


def flush_leave(handle) -> None:
    """The pending queue leave, now (a statement of its own; never raises: a session gone took
    its ticket lock with it)."""
    statements = _leave_sql(handle)
    _left(handle)
    if not statements:
        return
    try:
        _simple(handle.conn, statements)
    except driver().Error:
        pass


def with_leave(handle, sql: str, params, front=()) -> object:
    """sql's one row's first column, the pending queue leave (and the statements front) in
    front of it in the same round trip (the leave kept when the query fails: flush_leave
    then)."""
    statements = [*front, *_leave_sql(handle)]
    if not statements:
        with handle.conn.cursor() as cursor:
            cursor.execute(sql, params)
            return cursor.fetchone()[0]
    row = _simple(handle.conn, [*statements, (sql, params)], fetch=True)
    _left(handle)
    return row[0]


# -- letting go ---------------------------------------------------------------------------------
def let_go(store, handle, head_here: str | None = None) -> bool:
    """The release's writes (committed first), the pending queue leave, then the lane's unlock
    and wake-up, in one round trip. head_here: this host's name -- the unlock only once a head
    of this host is in the lane's server queue (False: not let go, the writes done). True once
    let go. GateUnavailable: the session is gone (and the lock with it)."""
    psycopg = driver()
    releasing, handle.releasing = handle.releasing, None
    statements = []
    if releasing is not None:
        statements += [("BEGIN", None), *_release_sql(handle, releasing), ("COMMIT", None)]
    statements += _leave_sql(handle)
    unlock = (_UNLOCK, [*handle.key, pg_queue.lane_channel(handle.key)])
    if head_here is not None:
        unlock = (_UNLOCK + " WHERE " + _HEAD_HERE,
                  [*unlock[1], pg_queue.QUEUE_NAMESPACE, handle.lane, head_here])
    statements.append(unlock)
    try:
        let = _simple(handle.conn, statements)
    except psycopg.Error as error:
        if ended(handle.conn):
            _left(handle)
            _unwritten(store, releasing, error)
            raise GateUnavailable(f"lane store: {first_line(error)}") from None
        return _one_by_one(store, handle, releasing, head_here)
    _left(handle)
    if let:
        handle.held, handle.taken = False, None
    return let


def _release_sql(handle, releasing: Releasing) -> list[tuple]:

    statements = [(WRITE_FENCED if fenced(handle.conn) else WRITE_UNFENCED,
                   holder_params(handle, releasing.record))]
    if releasing.events:
        statements.append(("INSERT INTO lanelock_events (lane, ts, event) VALUES " +
                           ", ".join(["(%s, %s, %s)"] * len(releasing.events)),
                           [value for event in releasing.events
                            for value in event_row(handle, event)]))
    return statements


def event_row(handle, event: dict) -> tuple:
    import time

    return handle.lane, event.get("ts", time.time()), json.dumps(event)


def _simple(conn, statements: list[tuple], fetch: bool = False):
    """The statements ((sql, its parameters or None), ...) as ONE simple query, each rendered
    with its parameters client-side: whether the last one returned a row (fetch: that row, or
    None). In that protocol the statements run in order, and an error skips the rest."""
    psycopg = driver()
    with psycopg.ClientCursor(conn) as cursor:
        query = "; ".join(sql if params is None else cursor.mogrify(sql, params)
                          for sql, params in statements)
        cursor.execute(query)
        while cursor.nextset():
            pass
        if fetch:
            return cursor.fetchone() if cursor.description is not None else None
        return cursor.description is not None and cursor.rowcount > 0


def _one_by_one(store, handle, releasing: Releasing | None, head_here: str | None) -> bool:
    """let_go's steps each alone, after the query failed on the session's own terms (a table
    gone, a column this role may not write): what can be written is, what cannot is said, as
    the statements before let_go did; then the unlock."""
    psycopg = driver()
    try:
        if handle.conn.info.transaction_status == psycopg.pq.TransactionStatus.INERROR:
            handle.conn.rollback()
    except psycopg.Error:
        pass
    handle.releasing = releasing
    write_alone(store, handle)
    flush_leave(handle)
    if head_here is not None and not store.host_queued(handle):
        return False
    store.unlock_lane(handle)
    return True


def write_alone(store, handle) -> None:
    """The kept release's row and events, each in a statement of its own; what cannot be
    written is said."""
    from ..base import LaneStore

    releasing, handle.releasing = handle.releasing, None
    if releasing is None:
        return
    try:
        LaneStore.write_release(store, handle, lambda: releasing.record, {})
    except RecordNotWritten as error:
        store.warn(f"the holder record's release was not written: {error}")
    if releasing.events:
        try:
            store.append_event(handle, *releasing.events)
        except RecordNotWritten as error:
            store.warn(f"journal not written: {error}")


def _unwritten(store, releasing: Releasing | None, error) -> None:
    if releasing is None:
        return
    store.warn(f"the holder record's release was not written: lane store: {first_line(error)}")
    if releasing.events:
        store.warn(f"journal not written: lane store: {first_line(error)}")
