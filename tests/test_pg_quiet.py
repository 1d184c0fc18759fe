"""The server log stays free of lanelock's ERROR lines in normal operation: a waiter behind
another on the PostgreSQL store looks again every second (to pass over one stopped ahead) and at
its class's aging steps. It did so by blocking on the ticket lock of the one ahead under a
lock_timeout, and every look was an "ERROR: canceling statement due to lock timeout" in the
server's log (1,120 lines in 20 s for 50 proxied waiters). Real server, real `lanelock run`.
"""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from support.cli import LANELOCK, TIMEOUT, environ
from support.processes import wait_for

psycopg = pytest.importorskip("psycopg")
BACKEND = "localhost:7032"


def queued(postgres) -> int:
    """Waiters in the lane queue: sessions holding a ticket lock (store/pg/queue.py)."""
    from lanelock.store.pg.queue import QUEUE_NAMESPACE

    with psycopg.connect(postgres.dsn, autocommit=True) as conn:
        return conn.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND "
                            "granted AND mode = 'ExclusiveLock' AND classid = %s",
                            (QUEUE_NAMESPACE,)).fetchone()[0]


def test_waiters_behind_one_another_leave_no_error_in_the_server_log(postgres, procs, holder,
                                                                     lock_roots):
    lock_roots.watch_store(postgres.dsn)
    start = os.path.getsize(postgres.log_path)
    held = holder("--store", postgres.dsn, "-b", BACKEND)
    # Each waiter on a host of its own (a lock root of its own: one host lane each), so that
    # they wait behind one another in the server's queue.
    waiters = [procs.start([*LANELOCK, "run", "--store", postgres.dsn, "--wait", "60", "-b",
                            BACKEND, "--", "true"], stderr=subprocess.PIPE,
                           env=environ({"LANELOCK_DIR": str(lock_roots.tmp_path / f"host-{index}")}))
               for index in range(3)]
    wait_for(lambda: queued(postgres) == 3, "the three waiters queued")
    # What is under test is what the waiters do while time passes: each one behind another
    # looks again every second; two and a half seconds give each two or three looks.
    time.sleep(2.5)
    assert held.release() == 0
    for waiter in waiters:
        assert waiter.wait(timeout=TIMEOUT) == 0, waiter.stderr.read()
    with open(postgres.log_path, "rb") as log:
        log.seek(start)
        errors = [line for line in log.read().decode(errors="replace").splitlines()
                  if "ERROR:" in line]
    assert errors == [], errors[:5]
