"""A restart of the PostgreSQL server is an outage, not a release: every session ends with it, and
the lane's advisory lock too. The holder takes its lane back as soon as the server answers (its
row is its claim: other takers defer to it for a grace), says how long the lane was ungated, and
journals it; waiters whose sessions ended connect again and wait on, they never run beside the
holder's command. A real server stopped mid-turn (a fast shutdown, or kill -9 of the postmaster)
and started again on the same data and port, real `lanelock run` turns.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from support.cli import LANELOCK, TIMEOUT, environ
from support.processes import read_line, wait_for

pg_server = pytest.importorskip("support.pg_server")
psycopg = pytest.importorskip("psycopg")

WAITERS = 5
# A waiter's command stamps its own start and end (ns since the epoch) into the file named by $1.
STAMP = 's=$(date +%s%N); sleep 0.1; e=$(date +%s%N); echo "$s $e" >> "$1"'
# The holder's: says "ready" once it runs, and ends when told (a line on its stdin).
HOLD = 's=$(date +%s%N); echo ready; read go; e=$(date +%s%N); echo "$s $e" > "$1"'


def waiting(server) -> int:
    """Turns waiting in the lane's queue: sessions holding a ticket lock (store/pg/queue.py)."""
    from lanelock.store.pg.queue import QUEUE_NAMESPACE

    with psycopg.connect(server.dsn, autocommit=True) as conn:
        return conn.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND "
                            "granted AND mode = 'ExclusiveLock' AND classid = %s",
                            (QUEUE_NAMESPACE,)).fetchone()[0]


@pytest.mark.parametrize("kill", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["fast-shutdown", "kill-9-postmaster"])
def test_a_restart_mid_turn_never_lets_a_waiter_run_beside_the_holder(kill, procs,
                                                                      private_postgres, tmp_path):
    server = private_postgres
    dsn, run = server.dsn, [*LANELOCK, "run", "--store", server.dsn, "-b", "localhost:7030"]
    held_at, stamps = tmp_path / "held", tmp_path / "stamps"
    stamps.touch()
    holder = procs.start([*run, "--", "sh", "-c", HOLD, "sh", str(held_at)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=environ())
    assert read_line(holder.stdout) == "ready\n"
    # Each waiter on a host of its own (a lock root of its own: one host lane each), so that
    # every one waits in the server's queue and loses its session in the restart.
    waiters = [procs.start([*run, "--wait", "60", "--", "sh", "-c", STAMP, "sh", str(stamps)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           env=environ({"LANELOCK_DIR": str(tmp_path / f"host-{index}")}))
               for index in range(WAITERS)]
    wait_for(lambda: waiting(server) == WAITERS, "the waiters queued")

    server.restart(kill=kill)

    # The holder says the lane is lost, then that it took it back; the waiters, connected again,
    # wait behind it (none of them may have run meanwhile).
    lines = []
    try:
        while not lines or "taken back after" not in lines[-1]:
            lines.append(read_line(holder.stderr))
    except TimeoutError:
        pytest.fail(f"the holder never took its lane back (it said {lines}); waiters' commands "
                    f"run meanwhile: {len(stamps.read_text().splitlines())}")
    assert all("lost" in line for line in lines[:-1]), lines
    wait_for(lambda: waiting(server) == WAITERS, "the waiters waiting again", TIMEOUT * 2)
    assert stamps.read_text() == "", "a waiter ran while the holder's command ran"
    status = subprocess.run([*LANELOCK, "status", "--store", dsn, "-b", "localhost:7030",
                             "--json"], capture_output=True, text=True, env=environ(),
                            timeout=TIMEOUT)
    assert '"ungated_seconds"' in status.stdout, status.stdout   # the holder's record says it

    holder.stdin.write(b"go\n")
    holder.stdin.close()
    assert holder.wait(timeout=TIMEOUT) == 0
    results = [(waiter.wait(timeout=TIMEOUT * 2), waiter.stderr.read().decode())
               for waiter in waiters]
    assert [status for status, _ in results] == [0] * WAITERS, results
    assert not [err for _, err in results if "running without it" in err], results
    held_end = int(held_at.read_text().split()[1])
    intervals = sorted(tuple(map(int, line.split())) for line in stamps.read_text().splitlines())
    assert len(intervals) == WAITERS
    assert intervals[0][0] >= held_end, "a waiter's command started before the holder's ended"
    assert all(b[0] >= a[1] for a, b in zip(intervals, intervals[1:])), intervals

    # The ungated interval is journaled (history) and was in the holder's record.
    events = json.loads(subprocess.run([*LANELOCK, "history", "--store", dsn, "-b",
                                        "localhost:7030", "--json"], capture_output=True,
                                       text=True, env=environ(), timeout=TIMEOUT).stdout)
    regained = [event for event in _events(events) if event.get("event") == "regained"]
    assert len(regained) == 1 and 0 < regained[0]["ungated"] < TIMEOUT, regained
    said = subprocess.run([*LANELOCK, "history", "--store", dsn, "-b", "localhost:7030"],
                          capture_output=True, text=True, env=environ(), timeout=TIMEOUT).stdout
    assert "the lane store restarted under this turn: the lane was ungated" in said, said


def _events(history) -> list:
    """The raw events of `history --json`, whatever its envelope."""
    if isinstance(history, list):
        return history
    for value in history.values():
        if isinstance(value, list) and value and isinstance(value[0], dict):
            return value
    return []
