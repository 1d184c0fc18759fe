"""What `status` and a deflection read of a PostgreSQL lane (store.py asks it): pg_locks joined
with pg_stat_activity is the truth of who holds and waits; the holder row only labels it, and a
row that names another lane is a hash collision said, never silent."""

from __future__ import annotations

from .. import order
from ..base import LaneFacts
from . import queue as pg_queue
from . import shared
from .session import BOUND, driver, first_line, redact
from ...errors import GateUnavailable

NO_ROW = "no holder row yet"
COLLISION = "advisory key collision"


def survey(store, lane=None, handle=None) -> list:
    """Facts for one lane (or every lane the store knows). handle: read through the turn's own
    connection (a deflection asks on the busy path: no second connection)."""
    # a handle with no session (a waiter behind another of its host): a short one of its own
    # (the process's shared one in a proxy: shared.py)
    if handle is None or lane is None or handle.conn is None:
        with shared.asking(store, "lanelock status") as (conn, _):
            return _survey(store, conn, lane)
    return _survey(store, handle.conn, lane)


def _survey(store, conn, lane) -> list:
    try:
        lanes = lanes_of(conn) if lane is None else [lane.name]
        return [_facts(store, conn, name) for name in lanes]
    except driver().Error as error:
        raise GateUnavailable(f"lane store {redact(store.dsn)}: {first_line(error)}") from None


def survey_all(store, most: int) -> tuple[list, int]:
    """(facts of at most `most` lanes, those whose holder rows changed last, in name order; how
    many more the server knows): status --all and metrics --all judge a bounded number of lanes
    whatever anyone with the server's password made, and ask for no more rows than they judge."""
    with shared.asking(store, "lanelock status") as (conn, _):
        try:
            with conn.cursor() as cursor:
                cursor.execute("SELECT lane FROM lanelock_holders GROUP BY lane "
                               "ORDER BY max(updated_at) DESC, lane LIMIT %s", (most,))
                names = sorted(row[0] for row in cursor.fetchall())
                cursor.execute("SELECT count(DISTINCT lane) FROM lanelock_holders")
                known = cursor.fetchone()[0]
            return [_facts(store, conn, name) for name in names], max(0, known - len(names))
        except driver().Error as error:
            raise GateUnavailable(f"lane store {redact(store.dsn)}: "
                                  f"{first_line(error)}") from None


def lane_names(store) -> list[str]:
    with shared.asking(store, "lanelock status") as (conn, _):
        try:
            return lanes_of(conn)
        except driver().Error as error:
            raise GateUnavailable(f"lane store {redact(store.dsn)}: "
                                  f"{first_line(error)}") from None


def lanes_of(conn) -> list[str]:
    with conn.cursor() as cursor:
        cursor.execute("SELECT DISTINCT lane FROM lanelock_holders ORDER BY lane")
        return [row[0] for row in cursor.fetchall()]


def _facts(store, conn, lane: str) -> LaneFacts:
    """The lane's facts (seat 1's), with its count and every other seat's (seats.py): 2..the
    count, and a seat past it while held."""
    from . import seats

    facts = _seat_facts(store, conn, lane)
    facts.seats, top = seats.survey_count(conn, lane)
    for seat in range(2, top + 1):
        other = _seat_facts(store, conn, lane, seat)
        if seat <= facts.seats or other.held:
            facts.other_seats.append(other)
    return facts


def _seat_facts(store, conn, lane: str, seat: int = 1) -> LaneFacts:
    from .seats import seat_key

    key = seat_key(lane, seat)
    facts = LaneFacts(lane, store.locator(lane) if seat == 1 else
                      f"{redact(store.dsn)}#advisory({key[0]},{key[1]})")
    facts.seat = seat
    facts.kernel_source = "pg_locks"
    facts.bound = BOUND
    with conn.cursor() as cursor:
        rows = lockers(cursor, key)
    for pid, granted, app, addr in rows:
        entry = {"pid": pid, "command": f"{app or '?'} from {addr or 'local socket'}",
                 "lanelock": bool(app and app.startswith("lanelock"))}
        (facts.holders if granted else facts.waiters).append(entry)
    facts.held = bool(facts.holders)
    if seat > 1:   # the lane's queue is seat 1's facts'
        return _row_facts(conn, facts, key, lane)
    # One reading of the server's queue gives both its rows and the heads to leave out of the
    # hosts' own (a second reading a moment later could miss a head that left meanwhile and
    # list it twice).
    try:
        live = pg_queue.live(conn, lane)
    except driver().Error:
        live = []   # no queue table (no CREATE privilege): nobody queues here
    facts.queue = order.status_rows(live, store.aging, pg_queue.ROWS)
    from . import hostqueue

    # the waiters of this host still on its host lane (only its head is in the server's)
    heads = {entry.facts.get("entry") for entry in live}
    facts.queue = order.merged(facts.queue, hostqueue.local_rows(
        store._root().path, store.dsn, lane, store.aging, heads))
    return _row_facts(conn, facts, key, lane)


def _row_facts(conn, facts: LaneFacts, key, lane: str) -> LaneFacts:
    """The facts of the seat's holder row (who holds, or held last)."""
    from ...facts import hostname
    from ..record_facts import read_record

    record, problem = holder_row(conn, key, lane)
    facts.record, facts.record_problem = record, problem
    facts.record_absent = problem == NO_ROW
    facts.collision = bool(problem and problem.startswith(COLLISION))
    facts.exists = record is not None or facts.held or facts.collision
    if record is None:
        return facts
    facts.matches = facts.held and record.get("backend_pid") == facts.holders[0]["pid"]
    if not facts.matches and facts.held:
        facts.store_stale = "the holder row describes an earlier turn"
    # another host's turn is alive while its session holds the lane: not alive here
    read_record(facts, record, record.get("hostname") == hostname())
    return facts


def holder_row(conn, key, lane) -> tuple[dict | None, str | None]:
    try:
        with conn.cursor() as cursor:
            # to_jsonb: the generation of tables an earlier lanelock made has no column
            cursor.execute("SELECT lane, record, backend_pid, "
                           "(to_jsonb(held)->>'generation')::bigint "
                           "FROM lanelock_holders AS held WHERE key2 = %s", (key[1],))
            row = cursor.fetchone()
    except Exception as error:
        return None, f"holder row unreadable: {first_line(error)}"
    if row is None:
        return None, NO_ROW
    row_lane, record, backend, generation = row
    if row_lane != lane:
        return None, (f"{COLLISION}: lane {lane!r} and lane {row_lane!r} hash to "
                      f"the same key {key}; one of them must change its name")
    if not isinstance(record, dict):
        return None, "holder row is not a JSON object"
    record = dict(record, backend_pid=backend)
    if generation:   # 0: written by a lanelock before fences (the column's default)
        record["fence"] = generation
    return record, None


def lockers(cursor, key: tuple[int, int]) -> list[tuple]:
    """[(backend pid, granted, application_name, client address)] of the sessions holding or
    waiting for an advisory key (two-int form)."""
    cursor.execute(
        "SELECT l.pid, l.granted, a.application_name, host(a.client_addr) FROM pg_locks l "
        "LEFT JOIN pg_stat_activity a ON a.pid = l.pid WHERE l.locktype = 'advisory' "
        "AND l.classid = %s AND l.objid = %s AND l.objsubid = 2",
        (key[0] & 0xFFFFFFFF, key[1] & 0xFFFFFFFF))
    return cursor.fetchall()
