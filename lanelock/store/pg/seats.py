"""The seats of a PostgreSQL lane: up to N turns hold it at once, N kept with the lanes (the
lanelock_kept table, one value every host reads).

Seat 1 is the lane's advisory lock and holder row as ever (a one-seat lane, and every tool that
watches its key, see nothing new). Seat K >= 2 is an advisory lock of its own, (NAMESPACE,
the first four bytes of sha256("LANE\\0K") as a signed int), with a holder row of its own under
that key (its lane column the lane's name, its record's "seat" K): a generation -- the fence --
per seat. Each seat is a session lock the server drops with its holder's session: no counter
anyone must decrement.

The count is read as the turn connects, in the statement that asks the session's backend
(store._session); a lane of one seat whose rows never named another seat then takes the
one-lock path of old, statement for statement. A lane of more seats reads its rows (who held
which seat last) and tries the seats in the turn's order in ONE statement that stops at the
first it gets: the seat its session held last, then the least recently released (the seats other
sessions just used stay theirs), the ones held now last.

A smaller count never evicts a turn: seats past the count whose rows exist (they were held) count
against it while held, and a seat is kept only while fewer than N hold.

The head of the queue waits for ANY seat without polling: it LISTENs on the channel of every seat
(each seat's unlock notifies its own, in the statement that unlocks: store.unlock_lane), and
watches the death of every holder of this host (one epoll over their pidfds); a holder that died
elsewhere notified no one and is asked after every queue.RECHECK, as for one lock
(queue.until_taken).
"""

from __future__ import annotations

import hashlib
import json

from . import queue as pg_queue
from .session import NAMESPACE, driver, keeps

KEY = "seats/"
MOST = 256   # as seat_count.MOST: a count past this is a typo, not an engine
# The count and the highest seat any row of the lane names, in the statement a new session runs
# anyway (store._session): a probe of the kept values' key and a look over the holder rows (one
# per lane and seat), no round trip of their own.
COUNT_COLUMNS = (
    "(SELECT value FROM lanelock_kept WHERE name = %(seats)s), "
    "(SELECT max((record->'seat')::numeric) FROM lanelock_holders "
    "WHERE lane = %(lane)s AND jsonb_typeof(record->'seat') = 'number')")
# The count and every row of the lane, in one statement (a look of a seated turn).
_LOOK = ("SELECT (SELECT value FROM lanelock_kept WHERE name = %s), "
         "(SELECT coalesce(jsonb_agg(jsonb_build_array(key2, record)), '[]') "
         "FROM lanelock_holders WHERE lane = %s)")
# The first free seat of a list, in its order: the scan stops at the first lock taken (LIMIT 1
# over the array's rows, no sort), so no seat after it is touched.
_TRY = ("SELECT t.seat, pg_backend_pid() FROM unnest(%s::int[], %s::int[]) AS t(key2, seat) "
        "WHERE pg_try_advisory_lock(%s::int, t.key2) LIMIT 1")
_OTHERS = ("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted "
           "AND classid = %s AND objsubid = 2 AND objid::bigint = ANY(%s::bigint[]) "
           "AND pid <> pg_backend_pid()")
_HERE = ("SELECT h.record->'pid', h.record->'start_ticks' FROM lanelock_holders h "
         "JOIN pg_locks l ON l.pid = h.backend_pid AND l.locktype = 'advisory' AND l.granted "
         "AND l.classid = %s AND l.objsubid = 2 "
         "AND l.objid::bigint = (h.key2::bigint & 4294967295) "
         "WHERE h.lane = %s AND h.record->>'hostname' = %s")


def key(lane_name: str) -> str:
    """The lane's count's name among the kept values (seat_count.key)."""
    return KEY + lane_name


def seat_key(lane_name: str, seat: int) -> tuple[int, int]:
    """The advisory key of a seat: seat 1's is the lane's own (store.lane_key)."""
    text = lane_name if seat == 1 else f"{lane_name}\0{seat}"
    return NAMESPACE, int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big",
                                     signed=True)


def count_of(value) -> int | None:
    """A kept count, checked (None: not a count a lane can have)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MOST:
        return None
    return value


def reckon(value, highest) -> tuple[int, tuple]:
    """(the count, the seats past it), from COUNT_COLUMNS' two values: a kept value that is no
    count is one seat (fewer seats can only make a turn wait, never run beside one too many)."""
    seats = count_of(value) or 1
    top = int(highest) if highest is not None and 1 <= highest <= MOST else 1
    return seats, tuple(range(seats + 1, top + 1))


def counted(handle, value, highest) -> None:
    """The handle's count and seats past it, from COUNT_COLUMNS' two values."""
    handle.seats, handle.past = reckon(value, highest)


def count_params(conn, lane: str) -> dict | None:
    """The parameters of COUNT_COLUMNS, or None where the database keeps no values."""
    return {"seats": key(lane), "lane": lane} if keeps(conn) else None


def survey_count(conn, lane: str) -> tuple[int, int]:
    """(the lane's count, the highest seat to describe: the count, or a seat past it some row
    names) for `status`; (1, 1) where the database keeps no values."""
    params = count_params(conn, lane)
    if params is None:
        return 1, 1
    with conn.cursor() as cursor:
        cursor.execute("SELECT " + COUNT_COLUMNS, params)
        value, highest = cursor.fetchone()

    seats, past = reckon(value, highest)
    return seats, max((seats, *past))


# -- the kept values (the PostgreSQL store's kept/keep) -----------------------------------------
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


# -- taking a seat --------------------------------------------------------------------------------
def preference(records: dict, seats: int, session: str | None) -> list[int]:
    """The seats 1..seats in the order a turn of session tries them (records: seat -> its row's
    record): the one its session held last first, then the least recently released (never held
    first), the ones not released (held now, or their holder killed) last."""
    from ...holder import released_ago

    ranked = []
    for seat in range(1, seats + 1):
        record = records.get(seat)
        ago = released_ago(record)
        if record is None:
            ranked.append(((1, 0.0), seat))
        elif ago is None:
            ranked.append(((3, 0.0), seat))
        elif session is not None and record.get("session") == session:
            ranked.append(((0, ago), seat))
        else:
            ranked.append(((2, -ago), seat))
    return [seat for _, seat in sorted(ranked)]


def _look(handle) -> dict:
    """The count (handle.seats, handle.past) and the lane's rows by seat, read in one statement."""
    with handle.conn.cursor() as cursor:
        cursor.execute(_LOOK, (key(handle.lane), handle.lane))
        value, rows = cursor.fetchone()
    by_key = {}
    highest = 1
    for key2, record in rows or []:
        if isinstance(record, dict):
            by_key[key2] = record
            seat = record.get("seat")
            if isinstance(seat, int) and not isinstance(seat, bool) and 1 <= seat <= MOST:
                highest = max(highest, seat)
    counted(handle, value, highest)
    top = max(handle.seats, highest)
    return {seat: by_key.get(seat_key(handle.lane, seat)[1]) for seat in range(1, top + 1)}


def try_seats(store, handle) -> bool:
    """_try_seats for a try (try_lock): a server error is GateUnavailable."""
    from ...errors import GateUnavailable
    from .session import first_line

    try:
        return _try_seats(store, handle)
    except driver().Error as error:
        raise GateUnavailable(f"lane store: {first_line(error)}") from None


def _try_seats(store, handle, listened: set | None = None) -> bool:
    """One try of every seat, in the turn's order: True with the handle on the seat taken (its key,
    its seat, held; checked as a single lock's take is); False when none is free, the one got is
    claimed by a turn taking it back after a restart, or as many as the count hold (seats past
    it). listened: the channels this session LISTENs on (a wait's: every seat's is added before
    the try, so a release after it is a notification)."""
    lane = handle.lane
    records = _look(handle)
    top = max((handle.seats, *handle.past))
    if listened is not None:
        for seat in range(1, top + 1):
            channel = pg_queue.lane_channel(seat_key(lane, seat))
            if channel not in listened:
                pg_queue.listen(handle.conn, channel)
                listened.add(channel)
    order = preference(records, handle.seats, (handle.asker or {}).get("session"))
    with handle.conn.cursor() as cursor:
        cursor.execute(_TRY, ([seat_key(lane, seat)[1] for seat in order], order, NAMESPACE))
        row = cursor.fetchone()
    if row is None:
        return False
    seat, backend = row
    handle.key, handle.seat, handle.held = seat_key(lane, seat), seat, True
    handle.taken = None   # nothing read with this try (handoff.py): the checks read the seat's
    store._same_session(handle, backend)   # the pooler check; the seat's row: a claim, a command
    # A turn that held the seat as the server went down is taking it back (outage.py): let go
    # without a wake-up, as below, and ask again.
    if handle.claimed is not None or (handle.past and _too_many(handle, top)):
        let_go(handle)
        return False
    return True


def _too_many(handle, top: int) -> bool:
    """Holding a seat, does this turn make more holders than the count (seats past it held)?"""
    keys = [seat_key(handle.lane, seat)[1] & 0xFFFFFFFF for seat in range(1, top + 1)]
    with handle.conn.cursor() as cursor:
        cursor.execute(_OTHERS, (NAMESPACE, keys))
        others = cursor.fetchone()[0]
    return others + 1 > handle.seats


def let_go(handle) -> None:
    """The seat just taken let go again without a wake-up: it frees nothing a waiter could have
    (as many as the count hold), and a notification would only wake the next to find the same."""
    handle.conn.execute("SELECT pg_advisory_unlock(%s, %s)", handle.key)
    on_lane(handle)


def on_lane(handle) -> None:
    """The handle back on the lane's own key, holding nothing."""
    handle.key, handle.seat, handle.held = handle.ident[2], 1, False


# -- waiting for any seat --------------------------------------------------------------------------
def lock_any(store, handle, timeout: float | None, cancelled=None) -> bool:
    """The queue's head: block until one of the lane's seats is this turn's (True, the handle on
    it), timeout passes (None: never) or the wait is cancelled (False). A try of every seat, then
    a sleep on the session's LISTEN (every seat's channel), woken by any seat's unlock, by the
    death of a holder of this host, and every queue.RECHECK -- queue.until_taken, the one way a
    lanelock session waits; no statement waits in the server."""
    import time

    from ...errors import GateUnavailable
    from .session import first_line

    psycopg = driver()
    store.connected(handle)
    deadline = None if timeout is None else time.monotonic() + timeout
    listened: set = set()
    deaths = None

    def attempt() -> bool:
        nonlocal deaths
        if _try_seats(store, handle, listened):
            return True
        if deaths is None:
            deaths = _deaths(handle)
        return False

    given_up = (lambda: handle.cancelled or (cancelled is not None and cancelled()))
    try:
        got = pg_queue.until_taken(handle.conn, attempt, deadline,
                                   lambda: None if deaths is None else deaths.fileno(), given_up)
        if got and listened:
            # A holder hears no other seat's release: each would wake its lane watch, which
            # watches this socket for the session's end (lanewatch.py).
            handle.conn.execute("; ".join(f"UNLISTEN {channel}" for channel in listened))
        return got
    except psycopg.Error as error:
        if handle.cancelled:
            return False
        raise GateUnavailable(f"lane store: {first_line(error)}") from None
    finally:
        if deaths is not None:
            deaths.close()


def _deaths(handle):
    """One descriptor readable once any holder of the lane's seats that is a process of this host
    has died (_Deaths: an epoll over their pidfds), or None when none is of this host."""
    from ...facts import hostname

    try:
        with handle.conn.cursor() as cursor:
            cursor.execute(_HERE, (NAMESPACE, handle.lane, hostname()))
            rows = cursor.fetchall()
    except driver().Error:
        return None
    fds = [fd for fd in (pg_queue.death_of(pid, ticks) for pid, ticks in rows) if fd is not None]
    return _Deaths(fds) if fds else None


class _Deaths:
    """Several pidfds as one descriptor: an epoll set is readable while any of them is. The
    pidfds stay open while it watches (closing one takes it out of the set)."""

    def __init__(self, fds: list[int]):
        import select

        self.fds = fds
        self.watch = select.epoll()
        for fd in fds:
            self.watch.register(fd, select.EPOLLIN)

    def fileno(self) -> int:
        return self.watch.fileno()

    def close(self) -> None:
        import os

        self.watch.close()
        for fd in self.fds:
            os.close(fd)
