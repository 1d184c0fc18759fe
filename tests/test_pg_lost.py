"""A holder that loses its PostgreSQL lane: `run` and the proxy, on a real server.

Lost for good (the server ended the session itself: pg_terminate_backend, a partition's
keepalives): `run --on-lost stop` stops the command's process group and exits 75; the default
`run` goes on with one warning; the proxy cuts the request (its relay stops, the engine's
connection is closed, the client's answer ends). A restart is an outage, not a loss: the holder --
the proxy too -- takes the lane back, and nobody runs beside it once the server is back.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from conftest import LANELOCK, TIMEOUT, environ, read_line, wait_for

pg_server = pytest.importorskip("pg_server")
psycopg = pytest.importorskip("psycopg")

# The command of a turn: says "ready", then runs until told; a SIGTERM to its group is noted in
# the file named by $1 (the group was stopped, not the shell alone).
STOPPABLE = ('trap \'echo stopped >> "$1"; exit 0\' TERM; echo ready; '
             'while :; do sleep 0.05; done')


def sql(dsn: str, query: str, *params) -> list:
    with psycopg.connect(dsn, autocommit=True,
                         options=f"-c statement_timeout={int(TIMEOUT * 1000)}") as conn:
        return conn.execute(query, params).fetchall()


def lane_holders(dsn: str) -> list[int]:
    """The server pids holding a lane's advisory lock (lanelock's namespace, two-int key)."""
    from lanelock.store.pg.session import NAMESPACE

    return [row[0] for row in sql(dsn, "SELECT pid FROM pg_locks WHERE locktype = 'advisory' "
                                       "AND granted AND objsubid = 2 AND classid = %s",
                                  NAMESPACE & 0xFFFFFFFF)]


def terminate_holder(dsn: str) -> int:
    pids = lane_holders(dsn)
    assert len(pids) == 1, pids
    sql(dsn, "SELECT pg_terminate_backend(%s)", pids[0])
    return pids[0]


def history(dsn: str, backend: str) -> list[dict]:
    result = subprocess.run([*LANELOCK, "history", "--store", dsn, "-b", backend, "--json"],
                            capture_output=True, text=True, env=environ(), timeout=TIMEOUT)
    data = json.loads(result.stdout)
    if isinstance(data, dict):
        data = next((value for value in data.values() if isinstance(value, list)), [])
    return [event for event in data if isinstance(event, dict)]


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def store(postgres, lock_roots) -> str:
    lock_roots.watch_store(postgres.dsn)
    return postgres.dsn


def test_on_lost_stop_stops_the_commands_group_when_its_session_is_terminated(store, procs,
                                                                             tmp_path):
    backend = "localhost:7041"
    noted = tmp_path / "noted"
    turn = procs.start([*LANELOCK, "run", "--store", store, "-b", backend, "--on-lost", "stop",
                        "--", "sh", "-c", STOPPABLE, "sh", str(noted)],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=environ())
    assert read_line(turn.stdout) == "ready\n"
    group = os.getpgid(int(subprocess.run(["pgrep", "-P", str(turn.pid)], capture_output=True,
                                          text=True).stdout.split()[0]))

    terminate_holder(store)

    assert turn.wait(timeout=TIMEOUT) == 75   # exitcodes.LOST: stopped, not done
    assert noted.read_text() == "stopped\n"   # the command's group had SIGTERM
    assert not group_alive(group)
    err = turn.stderr.read().decode()
    warnings = [line for line in err.splitlines() if line.startswith("lanelock: warning:")]
    assert len(warnings) == 1, err
    assert "lost: the lane store ended this turn's session; stopping the command" in warnings[0]
    lost = [event for event in history(store, backend) if event.get("event") == "lost"]
    assert len(lost) == 1 and lost[0]["ungated"] >= 0, lost


def test_on_lost_stop_kills_a_group_that_ignores_sigterm_after_kill_after(store, procs):
    backend = "localhost:7042"
    turn = procs.start([*LANELOCK, "run", "--store", store, "-b", backend, "--on-lost", "stop",
                        "--kill-after", "0.5", "--", "sh", "-c",
                        "trap '' TERM; echo ready; while :; do sleep 0.05; done"],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=environ())
    assert read_line(turn.stdout) == "ready\n"
    terminate_holder(store)
    assert turn.wait(timeout=TIMEOUT) == 75


def test_the_default_goes_on_after_a_loss_and_status_does_not_name_it_the_holder(store, procs):
    backend = "localhost:7043"
    turn = procs.start([*LANELOCK, "run", "--store", store, "-b", backend, "--", "sh", "-c",
                        "echo ready; read go; exit 4"],
                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       env=environ())
    assert read_line(turn.stdout) == "ready\n"
    terminate_holder(store)
    warning = read_line(turn.stderr)
    assert "the command goes on, no longer gated" in warning, warning
    status = json.loads(subprocess.run(
        [*LANELOCK, "status", "--store", store, "-b", backend, "--json"], capture_output=True,
        text=True, env=environ(), timeout=TIMEOUT).stdout)["lanes"][0]
    assert status["state"] == "free" and status["holder"] is None, status
    turn.stdin.write(b"go\n")
    turn.stdin.close()
    assert turn.wait(timeout=TIMEOUT) == 4   # the command's own status: it was not stopped
