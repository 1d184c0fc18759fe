"""A PostgreSQL restart is an outage, not a release (store.py): every session ends with it, the
holder's advisory lock too, and nothing said who held the lane once the server was back.

- The claim: the holder's row (lanelock_holders), written before the server started and not
  released, names a turn that held the lane as it went down. For CLAIM_GRACE after the server's
  start, a taker that gets the lock while such a row stands lets it go and asks again every
  CLAIM_PAUSE (taken.unreleased, store.lock_lane): the holder comes first.
- retake(): the holder, told its session ended (lanewatch.py), opens a new session;
  a changed server start time says it was a restart, and it takes the lock outside the queue.
  The same start time says the server ended the session itself (pg_terminate_backend, a
  partition's keepalives): that is a release, as it always was. So is a session whose link
  timed out (a partition seen from the holder's side): lost at once, without asking.
- reconnect(): a waiter whose session ended connects again and waits on, within its wait.
"""

from __future__ import annotations

import time

from ...duration import backoff
from ...errors import GateUnavailable
from .session import driver

# How long after the server starts a turn that held the lane when it went down may take it back
# before anyone else: the holder asks again within about a second of the server answering.
CLAIM_GRACE = 10.0
CLAIM_PAUSE = 0.1   # a taker that deferred to a claim asks again after this


def reconnect(store, handle, deadline: float | None, cancel=None) -> bool:
    """A new session for a waiter whose session ended, asked again after growing pauses
    until the server answers (True) or the wait is over or cancelled (False)."""
    tries = 0
    while not handle.cancelled and not (cancel is not None and cancel.is_set()):
        try:
            store.reopen(handle)
            return True
        except GateUnavailable:
            pass
        pause = backoff(tries)   # a waiter whose session ended connects again, within its wait
        if deadline is not None and deadline - time.monotonic() <= pause:
            return False
        tries += 1
        time.sleep(pause)
    return False


def retake(store, handle) -> bool | None:
    """After lost(): take the lane back when the server restarted under the turn. True: held
    again (the caller rewrites the row, which renews the claim); False: the server ended
    this session itself (pg_terminate_backend, a partition's keepalives) and kept running --
    the lane stays lost; None: not yet (the server does not answer, or a turn holds the
    lane). Its claim (CLAIM_GRACE) keeps every other taker off meanwhile: no queue here.
    A session whose link timed out (handle.cut_off: a partition, or a server host that stopped
    answering) is lost at once: the server ends it for its silence within the keepalive bound
    and hands the lane on, and this host cannot tell that from an outage until it can ask."""
    if handle.cut_off:
        return False
    before = handle.started
    try:
        store.reopen(handle)
    except GateUnavailable:
        return None
    if before is not None and handle.started is not None and \
            abs(handle.started - before) < 0.001:
        return False
    psycopg = driver()
    try:
        with handle.conn.cursor() as cursor:
            cursor.execute("SET lock_timeout = 1000")   # a taker deferring lets go at once
            try:
                cursor.execute("SELECT pg_advisory_lock(%s, %s)", handle.key)
                handle.held = True
            except psycopg.errors.LockNotAvailable:
                return None
            finally:
                cursor.execute("SET lock_timeout = 0")
    except psycopg.Error:
        return None   # the server went again: asked again
    return True
