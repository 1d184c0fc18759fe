"""Who goes next on a PostgreSQL lane: the order of store/flock/queue.py -- class, aging, arrival --
kept by the server for every host's waiters (issue 26).

A waiting turn is a row of lanelock_queue (lane, a ticket from a sequence, class, the server's
clock_timestamp() at arrival, who) and a session advisory lock on (QUEUE_NAMESPACE, ticket) that
its connection holds while it waits. The row becomes visible only with its lock held (one
transaction), so a row whose lock nobody holds is a waiter that is gone -- its session ended
(kill -9, or a vanished host after the keepalive bound) -- and whoever sees it skips and deletes
it. One clock, the server's, orders arrivals and ages waits on every host. A waiter blocks in the
server on the ticket lock of the one ahead (pg_advisory_lock_shared), or on the lane's own lock
when it is first. A wait behind that must end at a moment (its next aging step, its next look for
a waiter stopped ahead) is not a statement under a lock_timeout -- each of those ended as an ERROR
line in the server's log, every second for every such waiter -- but LISTEN on CHANNEL: a leaving
waiter notifies it, and the waiter behind asks the ticket lock without blocking (a try) when
woken, at its moment, and every RECHECK (a waiter ahead killed notifies no one).
"""

from __future__ import annotations

import json
import os

from ...priority import CLASSES, effective, next_step, order_key

QUEUE_NAMESPACE = 0x4C4E5155   # "LNQU": never a lane's key (store/pg/store.py NAMESPACE)
CHANNEL = "lanelock_queue"     # a waiter left (its ticket is the payload)
RECHECK = 1.0                  # a waiter ahead that died notified no one: asked again this often
CANCEL_LOOK = 0.1              # how soon a cancelled wait behind notices (no query: a flag)
_LIVE = """
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
    __slots__ = ("ticket", "rank", "arrival", "waited", "facts")

    def __init__(self, ticket, rank, arrival, waited, facts):
        self.ticket, self.rank, self.arrival, self.waited = ticket, rank, arrival, waited
        self.facts = facts if isinstance(facts, dict) else {}

    def stopped_here(self) -> bool:
        """A waiter of this host stopped (kill -STOP, ^Z): passed over while it is stopped, as on
        the flock store. Another host's cannot be seen: it is waited for, and `status` names it
        and how long it has waited."""
        from ...proc import is_stopped

        pid = self.facts.get("pid")
        return self.here() and isinstance(pid, int) and is_stopped(pid)

    def here(self) -> bool:
        """Is the waiter a process of this host (one whose state can be read)?"""
        from ...facts import hostname

        return self.facts.get("hostname") == hostname()

    def effective(self, aging: float) -> int:
        return effective(self.rank, 0, int(self.waited * 1e9), aging)

    def order(self, aging: float) -> tuple:
        return order_key(self.rank, self.arrival, self.waited, aging, self.ticket)


def join(conn, lane: str, rank: int, facts: dict) -> int:
    """Queue a turn: its row, visible only once its ticket lock is held."""
    with conn.transaction(), conn.cursor() as cursor:
        cursor.execute("INSERT INTO lanelock_queue (lane, rank, facts) VALUES (%s, %s, %s) "
                       "RETURNING ticket", (lane, rank, json.dumps(facts)))
        ticket = cursor.fetchone()[0]
        cursor.execute("SELECT pg_advisory_lock(%s, %s)", key(ticket))
    return ticket


def leave(conn, ticket: int, listening: bool = False) -> None:
    with conn.cursor() as cursor:
        cursor.execute("DELETE FROM lanelock_queue WHERE ticket = %s", (ticket,))
        cursor.execute("SELECT pg_advisory_unlock(%s, %s), pg_notify(%s, %s)",
                       (*key(ticket), CHANNEL, str(ticket)))
        if listening:   # a holder's session is not woken by the queue for the rest of its turn
            cursor.execute(f"UNLISTEN {CHANNEL}")


def listen(conn) -> None:
    conn.execute(f"LISTEN {CHANNEL}")


def live(conn, lane: str) -> list[Entry]:
    """The lane's waiting turns; the rows of turns gone are deleted on the way."""
    with conn.cursor() as cursor:
        cursor.execute(_LIVE, (QUEUE_NAMESPACE, lane))
        rows = cursor.fetchall()
        gone = [row[0] for row in rows if not row[5]]
        if gone:
            cursor.execute("DELETE FROM lanelock_queue q WHERE q.ticket = ANY(%s) AND NOT EXISTS ("
                           "SELECT 1 FROM pg_locks l WHERE l.locktype = 'advisory' AND l.granted "
                           "AND l.mode = 'ExclusiveLock' "
                           "AND l.classid = %s AND l.objid = (q.ticket %% 2147483647)::oid "
                           "AND l.objsubid = 2)", (gone, QUEUE_NAMESPACE))
    return [Entry(*row[:5]) for row in rows if row[5]]


def ahead_and_step(conn, lane: str, ticket: int, aging: float, lane_key=None) -> tuple:
    """(the live entry just ahead of this ticket's, or None when it is first; seconds until this
    ticket's class rises a step, or None), both from ONE reading: one query, in which every
    row's wait is measured from the one statement_timestamp() (PITFALLS 24). Asked in two
    queries, a step taken between them left a waiter waiting with no timeout on an entry by
    then behind it, while that entry waited on it: the server's deadlock detector ended one of
    the waits, and its turn failed open beside the holder."""
    entries = live(conn, lane)
    mine = next((entry for entry in entries if entry.ticket == ticket), None)
    if mine is None:
        return None, None
    before = [entry for entry in entries if entry.order(aging) < mine.order(aging)]
    stopped = [entry for entry in before if entry.stopped_here()]
    if stopped and lane_key is not None:
        _unblock(conn, stopped, lane_key)
    before = [entry for entry in before if entry not in stopped]
    ahead = max(before, key=lambda entry: entry.order(aging), default=None)
    return ahead, next_step(mine.rank, mine.waited, aging)


def _unblock(conn, stopped: list, lane_key: tuple) -> None:
    """A stopped waiter passed over may already wait in the server for the lane's own lock: the
    server would grant it there, stopped, at the release, and every turn would wait for it
    again. Its blocked statement is cancelled (its session, ticket and place stay); continued, it
    asks again (store.py _lock_lane)."""
    backends = [entry.facts.get("backend") for entry in stopped
                if isinstance(entry.facts.get("backend"), int)]
    if not backends:
        return
    with conn.cursor() as cursor:
        cursor.execute("SELECT pg_cancel_backend(l.pid) FROM pg_locks l WHERE l.locktype = "
                       "'advisory' AND NOT l.granted AND l.pid = ANY(%s) AND l.classid = %s "
                       "AND l.objid = %s AND l.objsubid = 2",
                       (backends, lane_key[0] & 0xFFFFFFFF, lane_key[1] & 0xFFFFFFFF))


def queued_at_or_above(conn, lane: str, rank: int, aging: float) -> bool:
    return any(entry.effective(aging) >= rank and not entry.stopped_here()
               for entry in live(conn, lane))


def describe(conn, lane: str, aging: float) -> list[dict]:
    """The live entries in order, as store/flock/queue.py describes them for `status`."""
    entries = sorted(live(conn, lane), key=lambda entry: entry.order(aging))
    return [{"position": position, "class": CLASSES[entry.rank],
             "effective_class": CLASSES[entry.effective(aging)], "pid": entry.facts.get("pid"),
             "session": entry.facts.get("session"), "host": entry.facts.get("hostname"),
             "waited": round(entry.waited, 3),
             # another host's waiter cannot be seen stopped: None, "cannot tell", never "no"
             "stopped": entry.stopped_here() if entry.here() else None}
            for position, entry in enumerate(entries, 1)]


def wait_behind(conn, entry: Entry, timeout: float | None, psycopg, cancelled=None) -> None:
    """Until the entry's waiter leaves (or dies) or timeout passes. With no timeout: blocked in
    the server on its ticket lock (woken by the server, its death included); a cycle of waits
    through this one that the server's detector ends is the order changed under a wait, never a
    broken queue (a look that returned late leaves a waiter on an entry by then behind it): it
    ends the wait, and the waiter looks again. With a timeout: on the session's LISTEN (the
    caller's listen()), a try of the ticket lock when notified, at timeout, and every RECHECK --
    no statement that times out (an ERROR in the server's log each time), and no cycle.
    cancelled(): the wait was given up (looked at every CANCEL_LOOK)."""
    import time

    with conn.cursor() as cursor:
        if timeout is None:
            try:
                cursor.execute("SELECT pg_advisory_lock_shared(%s, %s)", key(entry.ticket))
                cursor.execute("SELECT pg_advisory_unlock_shared(%s, %s)", key(entry.ticket))
            except psycopg.errors.DeadlockDetected:
                pass
            return
        deadline = time.monotonic() + timeout
        death = _death(entry)
        try:
            while True:
                cursor.execute("SELECT pg_try_advisory_lock_shared(%s, %s)", key(entry.ticket))
                if cursor.fetchone()[0]:
                    cursor.execute("SELECT pg_advisory_unlock_shared(%s, %s)",
                                   key(entry.ticket))
                    return
                if _woken(conn, min(deadline, time.monotonic() + RECHECK), death, cancelled):
                    # Its process is gone: its session's lock goes as the server notices the
                    # closed socket -- a wait with no timeout, ended by the server.
                    cursor.execute("SELECT pg_advisory_lock_shared(%s, %s)", key(entry.ticket))
                    cursor.execute("SELECT pg_advisory_unlock_shared(%s, %s)",
                                   key(entry.ticket))
                    return
                if time.monotonic() >= deadline or (cancelled is not None and cancelled()):
                    return
        finally:
            if death is not None:
                os.close(death)


def _death(entry: Entry) -> int | None:
    """A descriptor readable once the entry's waiter has died, for a waiter of this host that is
    a process of its own (a pidfd; a proxy's request shares its proxy's pid, and leaving it
    notifies); None when there is none (another host's waiter: asked every RECHECK)."""
    pid = entry.facts.get("pid")
    if not entry.here() or not isinstance(pid, int) or pid == os.getpid():
        return None
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _woken(conn, until: float, death: int | None, cancelled) -> bool:
    """Wait until a notification (False), the moment until (False), a cancel (False) or the
    death of the waiter ahead (True), without a statement: no query runs meanwhile."""
    import select
    import time

    watched = [conn.fileno()] + ([death] if death is not None else [])
    while (left := until - time.monotonic()) > 0:
        if cancelled is not None and cancelled():
            return False
        ready, _, _ = select.select(watched, [], [], min(left, CANCEL_LOOK))
        if death is not None and death in ready:
            return True
        if ready and any(True for _ in conn.notifies(timeout=0, stop_after=1)):
            return False
    return False
