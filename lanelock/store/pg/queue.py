"""The waiting turns of a PostgreSQL lane, kept by the server for every host's waiters; who goes
next among them is store/order.py's (this module is the medium: the rows, and the waits on them).

A waiting turn is a row of lanelock_queue (lane, a ticket from a sequence, class, the server's
clock_timestamp() at arrival, who) and a session advisory lock on (QUEUE_NAMESPACE, ticket) that
its connection holds while it waits. The row becomes visible only with its lock held (one
transaction), so a row whose lock nobody holds is a waiter that is gone -- its session ended
(kill -9, or a vanished host after the keepalive bound) -- and whoever sees it skips and deletes
it. One clock, the server's, orders arrivals and ages waits on every host. No waiter blocks in
the server: a statement that waits must end at a moment (an aging step, a look for a waiter
stopped ahead, the turn's --wait) or on a cancel, and each such end was an ERROR line in the
server's log. A waiter LISTENs on the lane's channel when first, on CHANNEL when behind another,
and tries the lock (the lane's, or the ticket lock of the one ahead) when woken: by the
notification of whoever lets go, in the statement that unlocks; by the death of the process
ahead, when it is of this host; at its moments; and every RECHECK (until_taken).
"""

from __future__ import annotations

import json
import os

from ...priority import next_step
from .. import order

QUEUE_NAMESPACE = 0x4C4E5155   # "LNQU": never a lane's key (store/pg/store.py NAMESPACE)
CHANNEL = "lanelock_queue"     # a waiter left (its ticket is the payload)
LANE_CHANNEL = "lanelock_lane_{:08x}"   # the lane's lock let go (by its key2, unsigned)
RECHECK = 1.0                  # one that died elsewhere notified no one: asked again this often
AFTER_DEATH = 0.005            # a death seen: asked again this soon, then twice as late each time
CANCEL_LOOK = 0.1              # how soon a cancelled wait behind notices (no query: a flag)
LIVE = """
SELECT q.ticket, q.rank, extract(epoch FROM q.arrival)::float8,
       extract(epoch FROM statement_timestamp() - q.arrival)::float8, q.facts, l.pid IS NOT NULL
FROM lanelock_queue q
LEFT JOIN pg_locks l ON l.locktype = 'advisory' AND l.granted AND l.mode = 'ExclusiveLock'
     AND l.classid = %s
     AND l.objid = (q.ticket %% 2147483647)::oid AND l.objsubid = 2
     AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
WHERE q.lane = %s
"""


def key(ticket: int) -> tuple[int, int]:
    return QUEUE_NAMESPACE, ticket % 2147483647


class Entry:
    """One waiting turn's row, read at one statement_timestamp() (an order.Queued)."""

    __slots__ = ("ticket", "rank", "arrival", "waited", "facts")

    def __init__(self, ticket, rank, arrival, waited, facts):
        self.ticket, self.rank, self.arrival, self.waited = ticket, rank, arrival, waited
        self.facts = facts if isinstance(facts, dict) else {}

    @property
    def tiebreak(self) -> int:
        return self.ticket

    def here(self) -> bool:
        """Is the waiter a process of this host (one whose state can be read)?"""
        from ...facts import hostname

        return self.facts.get("hostname") == hostname()


class _Rows:
    """The server's rows as the order's rules ask about them (order.Entries): every row live()
    returns still waits (its ticket lock is held); a waiter of this host can be seen stopped, and
    another host's cannot (None: waited for, and `status` says it cannot tell)."""

    def waits(self, entry: Entry) -> bool:
        return True

    def stopped(self, entry: Entry) -> bool | None:
        from ...proc import is_stopped

        if not entry.here():
            return None
        pid = entry.facts.get("pid")
        return isinstance(pid, int) and is_stopped(pid)

    def who(self, entry: Entry) -> dict:
        return entry.facts


ROWS = _Rows()


def join(conn, lane: str, rank: int, facts: dict, waited: float = 0.0) -> int:
    """Queue a turn: its row, visible only once its ticket lock is held -- one statement (one
    round trip): the lock is taken as the row is inserted, and the row shows when the statement
    commits. waited: seconds it already waited on its host (hostqueue.py): its arrival is the
    server's clock minus those."""
    with conn.cursor() as cursor:
        cursor.execute(JOIN, (lane, rank, json.dumps(facts), max(0.0, waited), QUEUE_NAMESPACE))
        return cursor.fetchone()[0]


JOIN = ("WITH joined AS (INSERT INTO lanelock_queue (lane, rank, facts, arrival) VALUES "
        "(%s, %s, %s, clock_timestamp() - make_interval(secs => %s)) RETURNING ticket) "
        "SELECT ticket, pg_advisory_lock(%s, (ticket %% 2147483647)::int) FROM joined")


# One statement: the row goes first -- the CTE runs before the unlock in the select -- and the
# waiter behind, woken, reads it gone once this commits.
LEAVE = ("WITH gone AS (DELETE FROM lanelock_queue WHERE ticket = %s RETURNING 1) "
         "SELECT pg_advisory_unlock(%s, %s), pg_notify(%s, %s), (SELECT count(*) FROM gone)")


def leave_params(ticket: int) -> tuple:
    return ticket, *key(ticket), CHANNEL, str(ticket)


def leave(conn, ticket: int, listening: bool = False) -> None:
    with conn.cursor() as cursor:
        cursor.execute(LEAVE, leave_params(ticket))
        if listening:   # a holder's session is not woken by the queue for the rest of its turn
            cursor.execute(f"UNLISTEN {CHANNEL}")


def listen(conn, channel: str = CHANNEL) -> None:
    conn.execute(f"LISTEN {channel}")


def lane_channel(lane_key: tuple) -> str:
    return LANE_CHANNEL.format(lane_key[1] & 0xFFFFFFFF)


def live(conn, lane: str, rows: list | None = None) -> list[Entry]:
    """The lane's waiting turns; the rows of turns gone are deleted on the way. rows: LIVE's,
    when read already (with the try that took the lock: handoff.py)."""
    with conn.cursor() as cursor:
        if rows is None:
            cursor.execute(LIVE, (QUEUE_NAMESPACE, lane))
            rows = cursor.fetchall()
        gone = [row[0] for row in rows if not row[5]]
        if gone:
            cursor.execute("DELETE FROM lanelock_queue q WHERE q.ticket = ANY(%s) AND NOT EXISTS ("
                           "SELECT 1 FROM pg_locks l WHERE l.locktype = 'advisory' AND l.granted "
                           "AND l.mode = 'ExclusiveLock' "
                           "AND l.classid = %s AND l.objid = (q.ticket %% 2147483647)::oid "
                           "AND l.objsubid = 2)", (gone, QUEUE_NAMESPACE))
    return [Entry(*row[:5]) for row in rows if row[5]]


def ahead_and_step(conn, lane: str, ticket: int, aging: float, rows: list | None = None) -> tuple:
    """(the live entry just ahead of this ticket's, or None when it is first; seconds until this
    ticket's class rises a step, or None), both from ONE reading: one query, in which every
    row's wait is measured from the one statement_timestamp() (store/order.py says why one).
    rows: that query's, read already (live())."""
    entries = live(conn, lane, rows)
    mine = next((entry for entry in entries if entry.ticket == ticket), None)
    if mine is None:
        return None, None
    # A stopped waiter holds nothing in the server (no waiter blocks there: until_taken), so
    # nothing can be granted to it while the order passes it over.
    return order.just_ahead(mine, entries, aging, ROWS), next_step(mine.rank, mine.waited, aging)


def waiting_at_or_above(conn, lane: str, rank: int, aging: float,
                        rows: list | None = None) -> bool:
    return order.waiting_at_or_above(live(conn, lane, rows), rank, aging, ROWS)


def wait_behind(conn, entry: Entry, timeout: float | None, cancelled=None) -> None:
    """Until the entry's waiter leaves (or dies), timeout passes (None: never) or the wait is
    cancelled: a try of its ticket lock, then a sleep on the session's LISTEN (the caller's
    listen()) -- until_taken, never a statement that blocks, so neither a timeout nor a cancel
    is an ERROR in the server's log, and no cycle of waits can form through it."""
    import time

    def free() -> bool:
        with conn.cursor() as cursor:
            cursor.execute("SELECT pg_try_advisory_lock_shared(%s, %s)", key(entry.ticket))
            if not cursor.fetchone()[0]:
                return False
            cursor.execute("SELECT pg_advisory_unlock_shared(%s, %s)", key(entry.ticket))
            return True

    deadline = None if timeout is None else time.monotonic() + timeout
    death = death_of(entry.facts.get("pid") if entry.here() else None)
    try:
        until_taken(conn, free, deadline, lambda: death, cancelled)
    finally:
        if death is not None:
            os.close(death)


def until_taken(conn, attempt, deadline: float | None, death, cancelled) -> bool:
    """The one way a lanelock session waits in the server, for the lane's own lock (store.py
    _lock_lane_once) or for the entry ahead to leave: attempt() -- a try that never blocks --
    and, while it fails, a sleep on the session's LISTEN with no statement running. Woken by a
    notification (whoever lets go notifies in the statement that unlocks), by death() -- a pidfd
    (or None) readable once the process holding what is waited for has died: its session's lock then goes
    as the server reads the closed socket, asked again at AFTER_DEATH, doubling -- and every
    RECHECK (one that died elsewhere notified no one). True once attempt() succeeds; False at
    the deadline (None: never) or once cancelled() (a flag, looked at every CANCEL_LOOK: a
    cancel is never a server-side cancel, an ERROR in its log)."""
    import time

    pauses = Pauses()
    while True:
        if attempt():
            return True
        if (cancelled is not None and cancelled()) or \
                (deadline is not None and time.monotonic() >= deadline):
            return False
        pauses.sleep(conn, deadline, death, cancelled)


class Pauses:
    """until_taken's sleeps between tries, for any wait that tries on its own (the seat walk:
    store/seating.py): on the session's LISTEN, at most RECHECK; after the watched death,
    AFTER_DEATH, doubling back up to RECHECK."""

    def __init__(self):
        self.pause, self.dead = RECHECK, False

    def sleep(self, conn, deadline: float | None, death, cancelled) -> None:
        """One sleep, until a wake-up, the deadline (None: none) or the pause's end."""
        import time

        now = time.monotonic()
        until = now + self.pause if deadline is None else min(deadline, now + self.pause)
        if _woken(conn, until, None if self.dead else death(), cancelled):
            self.dead, self.pause = True, AFTER_DEATH
        elif self.pause < RECHECK:
            self.pause = min(RECHECK, self.pause * 2)


def death_of(pid, ticks=None) -> int | None:
    """A descriptor readable once the process pid of this host has died (a pidfd); None for
    another host's (asked every RECHECK), this process itself (a proxy's request shares its
    proxy's pid, and leaving notifies), or a pid reused since ticks (its start time) was read."""
    if not isinstance(pid, int) or pid == os.getpid():
        return None
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None
    if ticks is not None:
        from ...proc import start_ticks

        if start_ticks(pid) != ticks:   # read after the open: the pidfd is of the right process
            os.close(fd)
            return None
    return fd


def _woken(conn, until: float, death: int | None, cancelled) -> bool:
    """Wait until the session has something to read -- a notification, or its end (False: the
    caller tries, and a session that ended says so then) --, the moment until (False), a cancel
    (False) or the death watched (True), without a statement: no query runs meanwhile. A
    notification that came in with a statement's answer is already read off the socket: taken
    first. poll(), not select(): a proxy's descriptors go past select()'s 1024."""
    import select
    import time

    if any(True for _ in conn.notifies(timeout=0)):
        return False
    poller = select.poll()
    poller.register(conn.fileno(), select.POLLIN)
    if death is not None:
        poller.register(death, select.POLLIN)
    while (left := until - time.monotonic()) > 0:
        if cancelled is not None and cancelled():
            return False
        ready = {fd for fd, _ in poller.poll(min(left, CANCEL_LOOK) * 1000)}
        if death is not None and death in ready:
            return True
        if ready:
            for _ in conn.notifies(timeout=0):   # read now: not woken by it a second time
                pass
            return False
    return False
