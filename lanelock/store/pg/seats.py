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
one-lock path of old, statement for statement (seating.taker chooses, once per session). Every
rule of the seats -- the count's bound and validity, which seat a turn takes, never one too
many, the head's wait on any seat -- is store/seating.py's, as for the flock store; this module
is the medium (PgSeats): the lane's own lock (the store's), or the lane's rows
and which seats the server holds, read in one statement; the seats tried in the policy's order
in ONE statement that stops at the first it gets; which seats are held; and the head's sleep on
the session's LISTEN (every seat's channel: each seat's unlock notifies its own, in the
statement that unlocks: store.unlock_lane), woken too by the death of every holder of this host
(one epoll over their pidfds); a holder that died elsewhere notified no one and is asked after
every queue.RECHECK, as for one lock (queue.until_taken). A seat whose row was never released
and that the server no longer holds: its holder died (its session ended), wherever it ran.
"""

from __future__ import annotations

import hashlib
from contextlib import contextmanager

from .. import seating
from ..seating import AGAIN, MOST, Medium
from . import queue as pg_queue
from .session import NAMESPACE, driver, keeps
# The count and the highest seat any row of the lane names, in the statement a new session runs
# anyway (store._session): a probe of the kept values' key and a look over the holder rows (one
# per lane and seat), no round trip of their own.
COUNT_COLUMNS = (
    "(SELECT value FROM lanelock_kept WHERE name = %(seats)s), "
    "(SELECT max((record->'seat')::numeric) FROM lanelock_holders "
    "WHERE lane = %(lane)s AND jsonb_typeof(record->'seat') = 'number')")
# The count, every row of the lane and which of their seats the server holds, in one statement
# (a look of a seated turn): a row never released whose seat nobody holds is a dead holder's.
_LOOK = ("SELECT (SELECT value FROM lanelock_kept WHERE name = %s), "
         "(SELECT coalesce(jsonb_agg(jsonb_build_array(key2, record)), '[]') "
         "FROM lanelock_holders WHERE lane = %s), "
         "(SELECT coalesce(array_agg(objid::bigint), '{}') FROM pg_locks "
         "WHERE locktype = 'advisory' AND granted AND classid = %s AND objsubid = 2 "
         "AND objid::bigint IN (SELECT key2::bigint & 4294967295 FROM lanelock_holders "
         "WHERE lane = %s))")
# The first free seat of a list, in its order: the scan stops at the first lock taken (LIMIT 1
# over the array's rows, no sort), so no seat after it is touched.
_TRY = ("SELECT t.seat, pg_backend_pid() FROM unnest(%s::int[], %s::int[]) AS t(key2, seat) "
        "WHERE pg_try_advisory_lock(%s::int, t.key2) LIMIT 1")
_HELD = ("SELECT objid::bigint FROM pg_locks WHERE locktype = 'advisory' AND granted "
         "AND classid = %s AND objsubid = 2 AND objid::bigint = ANY(%s::bigint[])")
_HERE = ("SELECT h.record->'pid', h.record->'start_ticks' FROM lanelock_holders h "
         "JOIN pg_locks l ON l.pid = h.backend_pid AND l.locktype = 'advisory' AND l.granted "
         "AND l.classid = %s AND l.objsubid = 2 "
         "AND l.objid::bigint = (h.key2::bigint & 4294967295) "
         "WHERE h.lane = %s AND h.record->>'hostname' = %s")


def seat_key(lane_name: str, seat: int) -> tuple[int, int]:
    """The advisory key of a seat: seat 1's is the lane's own (handle.lane_key)."""
    text = lane_name if seat == 1 else f"{lane_name}\0{seat}"
    return NAMESPACE, int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big",
                                     signed=True)


def reckon(value, highest, lane: str = "") -> tuple[int, tuple, str | None]:
    """(the count, the seats past it, why the kept value was not believed), from COUNT_COLUMNS'
    two values (seating.reckon: a kept value that is no count is one seat)."""
    seats, problem = seating.reckon(value, lane)
    top = int(highest) if highest is not None and 1 <= highest <= MOST else 1
    return seats, tuple(range(seats + 1, top + 1)), problem


def counted(handle, value, highest) -> str | None:
    """The handle's count and seats past it, from COUNT_COLUMNS' two values; why the kept value
    was not believed (the store says it once), or None."""
    handle.seats, handle.past, problem = reckon(value, highest, handle.lane)
    return problem


def count_params(conn, lane: str) -> dict | None:
    """The parameters of COUNT_COLUMNS, or None where the database keeps no values."""
    return {"seats": seating.key(lane), "lane": lane} if keeps(conn) else None


def survey_count(conn, lane: str) -> tuple[int, int]:
    """(the lane's count, the highest seat to describe: the count, or a seat past it some row
    names) for `status`; (1, 1) where the database keeps no values."""
    params = count_params(conn, lane)
    if params is None:
        return 1, 1
    with conn.cursor() as cursor:
        cursor.execute("SELECT " + COUNT_COLUMNS, params)
        value, highest = cursor.fetchone()

    seats, past, _ = reckon(value, highest)
    return seats, max((seats, *past))


# -- the medium for taking the lane (store/seating.py: its one lock, or the seat walk) -----------
class PgSeats(Medium):
    """A turn's handle as seating.py asks it: the lane's own lock (the store's try and wait), or
    the seats. listened: the channels this session LISTENs on during a wait (every seat's is
    added before each try, so a release after it is a notification); None for a try."""

    listened: set | None = None
    deaths = None

    # -- the lane's own lock (seating.OneLock) -----------------------------------------------------
    def try_lane(self) -> bool:
        return self.store._try_lane(self.handle)

    def lock_lane(self, timeout: float | None, cancel=None) -> bool:
        # the pooler check included; a cancel is a flag the wait looks at
        return self.store.lock_lane(self.handle, timeout,
                                    None if cancel is None else cancel.is_set)

    # -- the seats (seating.AnySeat) ---------------------------------------------------------------
    @contextmanager
    def walking(self, waits: bool, cancel=None):
        """One walk: a try (its server error GateUnavailable), or the queue's head waiting
        (woken by the seats' channels, and by the death of a holder of this host: _deaths) --
        queue.until_taken's sleeps, the one way a lanelock session waits; no statement waits in
        the server. A wait's error once it was cancelled ends it with no seat."""
        from ...errors import GateUnavailable
        from .session import first_line

        psycopg = driver()
        handle = self.handle
        if waits:
            self.store.connected(handle)
        self.listened, self.deaths, self.pauses = (set() if waits else None), None, \
            pg_queue.Pauses()
        try:
            yield
            if handle.held and self.listened:
                # A holder hears no other seat's release: each would wake its lane watch, which
                # watches this socket for the session's end (lanewatch.py). Said with the
                # session's next statement, the turn's record (handoff.py), not in a round trip
                # of its own on the hand-off's path.
                handle.unlisten = tuple(sorted(self.listened))
        except psycopg.Error as error:
            if waits and handle.cancelled:
                return
            raise GateUnavailable(f"lane store: {first_line(error)}") from None
        finally:
            if self.deaths:
                self.deaths.close()
            self.listened, self.deaths = None, None

    def records(self) -> tuple:
        """The count (handle.seats, handle.past), the rows by seat and which seats the server
        holds, read in one statement."""
        handle = self.handle
        lane = handle.lane
        with handle.conn.cursor() as cursor:
            cursor.execute(_LOOK, (seating.key(lane), lane, NAMESPACE, lane))
            value, rows, locked = cursor.fetchone()
        by_key = {}
        highest = 1
        for key2, record in rows or []:
            if isinstance(record, dict):
                by_key[key2] = record
                seat = seating.seat_number(record.get("seat"))
                if seat is not None:
                    highest = max(highest, seat)
        problem = counted(handle, value, highest)
        if problem:
            self.store.seat_warning(f"lane store: {problem}")
        top = max(handle.seats, highest)
        if self.listened is not None:
            for seat in range(1, top + 1):
                channel = pg_queue.lane_channel(seat_key(lane, seat))
                if channel not in self.listened:
                    pg_queue.listen(handle.conn, channel)
                    self.listened.add(channel)
        locked = set(locked or ())
        records = {seat: by_key.get(seat_key(lane, seat)[1]) for seat in range(1, handle.seats + 1)}
        held = {seat for seat in range(1, top + 1)
                if seat_key(lane, seat)[1] & 0xFFFFFFFF in locked}
        return handle.seats, handle.past, records, held

    def try_seats(self, order: list) -> int | None:
        """The seats tried in order in ONE statement that stops at the first it gets: that seat,
        the handle on it (checked as a single lock's take is), or None -- also when the one got
        is claimed by a turn taking it back after a restart (outage.py: let go, no wake-up)."""
        handle = self.handle
        lane = handle.lane
        with handle.conn.cursor() as cursor:
            cursor.execute(_TRY, ([seat_key(lane, seat)[1] for seat in order], order, NAMESPACE))
            row = cursor.fetchone()
        if row is None:
            return None
        seat, backend = row
        handle.key, handle.seat, handle.held = seat_key(lane, seat), seat, True
        handle.taken = None   # nothing read with this try (handoff.py): the checks read the seat's
        self.store._same_session(handle, backend)   # the pooler check; the row: a claim, a command
        if handle.claimed is not None:
            let_go(handle)
            return None
        return seat

    def held(self, seats) -> set:
        keys = {seat_key(self.handle.lane, seat)[1] & 0xFFFFFFFF: seat for seat in seats}
        with self.handle.conn.cursor() as cursor:
            cursor.execute(_HELD, (NAMESPACE, list(keys)))
            return {keys[row[0]] for row in cursor.fetchall() if row[0] in keys}

    def let_go(self) -> None:
        let_go(self.handle)

    def wait_any(self, seats: list, timeout: float | None, cancel=None):
        """A sleep on the session's LISTEN (every seat's channel), woken by any seat's unlock,
        by the death of a holder of this host, and every queue.RECHECK: AGAIN (look again), or
        None once the wait is given up (cancel_wait, cancel set). No statement waits in the
        server."""
        import time

        if self.deaths is None:
            self.deaths = _deaths(self.handle) or False

        def given_up() -> bool:
            return self.handle.cancelled or (cancel is not None and cancel.is_set())

        if given_up():
            return None
        self.pauses.sleep(self.handle.conn, None if timeout is None else
                          time.monotonic() + timeout,
                          lambda: self.deaths.fileno() if self.deaths else None, given_up)
        return None if given_up() else AGAIN


def let_go(handle) -> None:
    """The seat just taken let go again without a wake-up: it frees nothing a waiter could have
    (as many as the count hold), and a notification would only wake the next to find the same."""
    handle.conn.execute("SELECT pg_advisory_unlock(%s, %s)", handle.key)
    on_lane(handle)


def on_lane(handle) -> None:
    """The handle back on the lane's own key, holding nothing."""
    handle.key, handle.seat, handle.held = handle.ident[2], 1, False


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
