"""A watched holder's lease on the server: a lost link is not a restart.

A holder cut off from a server that is up for everyone else cannot tell that from an outage: both
are a server it cannot reach. The server can: its session of the holder ended (a reset or cut
link) or went silent (a frozen link, whose relay or middlebox still acknowledges the server's
keepalives, so TCP never gives up). So the lane's expiry is the server's and counts from the
holder's last word, and the holder knows that moment from its side:

- A process that watches its holds (run, the proxy: WATCHED) leases each from its row's first
  write, which sets the session's idle limit in the same round trip (arming): a link lost
  before the first renewal was answered leaves a deadline all the same.
- The holder renews every RENEW s (its row's updated_at := now(), from the watch's thread) and
  expects each answer within ANSWER s. The row says it is leased (record 'lease': LEASE s).
  A hold kept unwatched a while (a lingering proxy turn, a stopped `run`) rests: its idle
  limit raised (rest).
- On the server, nobody else takes the lane until LEASE s after the row's last renewal: a taker
  that gets the lock while an unreleased leased row is younger than that lets it go and asks
  again (handoff.UNRELEASED, taken.unreleased), and the holder's own session ends LEASE s after
  its last statement (idle_session_timeout: a frozen link keeps no lane longer than that).
- The holder measures the same interval from when it SENT its last answered renewal (before the
  server stamped it): deadline(). It knows it lost the link within RENEW + ANSWER s of that
  (a reset or cut at once), tries to take the lane back (a restart) until DECIDE s before the
  deadline, then counts the lane lost: `--on-lost stop` sends SIGTERM then and SIGKILL by
  KILL_BY s before the deadline, the proxy cuts its request.

Margin: the decision comes at least LEASE - DECIDE - (RENEW + ANSWER) = 2 s after the holder
can first know, and another turn can start no sooner than KILL_BY = 1 s after the holder's
command is killed. A row of a turn of this host whose process is gone is no lease (it died:
the next turn need not wait); a holder on another host that dies without releasing holds the
lane until its lease runs out (the server cannot tell its death from a cut link).
"""

from __future__ import annotations

import select
import time

LEASE = 10.0    # s after the holder's last renewal before anyone else may take its lane
RENEW = 1.0     # s between renewals
ANSWER = 2.0    # s a renewal may go unanswered before the link counts as lost
DECIDE = 5.0    # s before the deadline: the lane counts as lost if not taken back by then
KILL_BY = 1.0   # s before the deadline: the holder's command killed by then (--on-lost stop)

# The renewal: the row stamped, marked leased, and the session's idle limit set (once is
# enough, but it costs nothing to say again). Only the row this session wrote.
_RENEW = ("UPDATE lanelock_holders SET updated_at = now(), record = record || "
          "jsonb_build_object('lease', %s::float8) WHERE key2 = %d AND backend_pid = "
          "pg_backend_pid(); SELECT set_config('idle_session_timeout', '%d', false)")


# This process watches every hold it takes (run, the proxy: store.lease_holds), on every
# lane -- its fallbacks' and its models' too, each a store of its own: their holds are leased
# from their first write. Other processes (the Python API) lease nothing.
WATCHED = False


def watched() -> None:
    global WATCHED
    WATCHED = True


def arming(conn) -> list:
    """The statements that set a holder's session's idle limit (LEASE s), to go with its first
    write: a server before 14 has none (its frozen links last as long as the link does)."""
    if conn is None or conn.info.server_version < 140000:
        return []
    return [("SELECT set_config('idle_session_timeout', %s, false)", [str(int(LEASE * 1000))])]


def rest(handle, seconds: float | None) -> None:
    """A leased hold kept unwatched for up to seconds (a proxy's turn lingering between a
    session's requests: no renewals meanwhile): its session's idle limit raised to that plus
    LEASE, so the server does not end it for the silence, yet still ends it if it outlasts the
    linger (a frozen link); None: for as long as it takes (a `run` stopped with its command,
    ^Z: a stopped holder keeps its lane, as on flock). The next renewal sets LEASE again.
    Answered within ANSWER s, or the session is not trusted any more (as renew)."""
    conn = handle.conn
    if conn is None or not handle.lease or conn.info.server_version < 140000:
        return
    deadline = time.monotonic() + ANSWER
    if not conn.lock.acquire(timeout=ANSWER):
        _failed(handle)
        return
    try:
        limit = 0 if seconds is None else int((seconds + LEASE) * 1000)
        query = f"SELECT set_config('idle_session_timeout', '{limit}', false)"
        answered = _exchange(conn.pgconn, query.encode(), deadline)
    finally:
        conn.lock.release()
    if not answered:
        _failed(handle)


def renew(handle) -> bool:
    """One renewal on the holder's session, answered within ANSWER s (True), or not: an error,
    a session gone, no answer in time (a frozen link). On False the session is no longer
    trusted: closed, so no thread waits on it. handle.lease_from: the monotonic moment the
    answered renewal was sent. Raw libpq under the connection's own lock: a blocking psycopg
    call on a frozen link would wait for the kernel's tcp_user_timeout, not ANSWER."""
    conn = handle.conn
    if conn is None:
        return False
    sent = time.monotonic()
    if not conn.lock.acquire(timeout=ANSWER):   # a statement of the turn's own is stuck
        return _failed(handle)
    try:
        query = _RENEW % (LEASE, int(handle.key[1]), int(LEASE * 1000))
        if conn.info.server_version < 140000:   # no idle_session_timeout before 14
            query = query.split(";")[0]
        answered = _exchange(conn.pgconn, query.encode(), sent + ANSWER)
    finally:
        conn.lock.release()
    if not answered:
        return _failed(handle)
    handle.lease_from, handle.lease = sent, LEASE
    return True


def _exchange(pgconn, query: bytes, deadline: float) -> bool:
    """Send query, read every result before deadline; True when all were fine."""
    from psycopg import pq

    try:
        pgconn.send_query(query)
        while pgconn.flush() != 0:
            if not _readable(pgconn.socket, deadline, select.POLLOUT):
                return False
        ok = True
        while True:
            while pgconn.is_busy():
                if not _readable(pgconn.socket, deadline):
                    return False
                pgconn.consume_input()
            result = pgconn.get_result()
            if result is None:
                return ok
            ok = ok and result.status in (pq.ExecStatus.COMMAND_OK, pq.ExecStatus.TUPLES_OK)
    except Exception:  # noqa: BLE001 - libpq's errors: the session is gone
        return False


def _readable(fd: int, deadline: float, event: int = select.POLLIN) -> bool:
    left = deadline - time.monotonic()
    if left <= 0:
        return False
    poller = select.poll()
    poller.register(fd, event | select.POLLERR | select.POLLHUP)
    return bool(poller.poll(int(left * 1000) + 1))


def _failed(handle) -> bool:
    """The session is not to be trusted any more: closed, its socket shut first so that a
    thread blocked on it (the turn's own statement) returns now."""
    import os
    import socket

    fd = handle.fd
    if fd is not None:
        try:
            sock = socket.socket(fileno=os.dup(fd))
            try:
                sock.shutdown(socket.SHUT_RDWR)
            finally:
                sock.close()
        except OSError:
            pass
    handle.frozen = True
    return False


def deadline(handle) -> float | None:
    """The monotonic moment after which another turn may hold the lane (None: not leased)."""
    start = getattr(handle, "lease_from", None)
    return None if start is None else start + LEASE


RELEASE_BOUND = ANSWER + 3.0   # the release may wait 2 s for its host's next head (hostqueue)


class Bounded:
    """A leased holder's release given RELEASE_BOUND s (the release at the turn's end: no watch renews
    then): past that, the session is shut, and the blocked statement fails instead of waiting on
    a frozen link for ever (its far end still acknowledges, so no TCP timeout ever fires)."""

    def __init__(self, handle):
        self.handle, self.timer = handle, None

    def __enter__(self):
        import threading

        if self.handle.lease and self.handle.conn is not None:
            self.timer = threading.Timer(RELEASE_BOUND, _failed, (self.handle,))
            self.timer.daemon = True
            self.timer.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.timer is not None:
            self.timer.cancel()
