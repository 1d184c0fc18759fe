"""The PostgreSQL hand-off's round trips (store/pg/handoff.py), read from the server's own
statement log: the holder's release -- its row, its 'released' event -- is committed BEFORE its
unlock, in the very query that unlocks; a stop point during the release still finds it written
while the lane is held. Real server, real `lanelock run` (no figures here: bench/handoff.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from urllib.parse import quote

import pytest

from support.cli import LANELOCK, TIMEOUT
from support.processes import wait_stopped

psycopg = pytest.importorskip("psycopg")
BACKEND = "localhost:7033"


def logged(dsn: str) -> str:
    """The DSN, its sessions' statements written to the server's log (a superuser's setting)."""
    return f"{dsn}?options={quote('-c log_statement=all')}"


def statements(postgres, start: int) -> list[str]:
    """The statement lines of lanelock's sessions logged since start (a byte offset)."""
    with open(postgres.log_path, "rb") as log:
        log.seek(start)
        text = log.read().decode(errors="replace")
    return [line for line in text.splitlines() if " app=lanelock" in line and
            ("LOG:  statement: " in line or "LOG:  execute " in line)]


def test_the_release_is_committed_before_the_unlock_in_one_query(postgres, lanelock, lock_roots):
    lock_roots.watch_store(postgres.dsn)
    start = os.path.getsize(postgres.log_path)
    done = lanelock("run", "--store", logged(postgres.dsn), "-b", BACKEND, "--", "true")
    assert done.returncode == 0, done.stderr
    unlocks = [line for line in statements(postgres, start) if "pg_advisory_unlock(" in line]
    assert len(unlocks) == 1, unlocks
    query = unlocks[0]
    # the row released and the 'released' event, committed, then the unlock and its wake-up
    assert "INSERT INTO lanelock_holders" in query and "released_at" in query, query
    assert "INSERT INTO lanelock_events" in query and '"event": "released"' in query, query
    assert query.index("BEGIN") < query.index("released_at") < query.index("COMMIT") \
        < query.index("pg_advisory_unlock("), query
    history = json.loads(lanelock("history", "--store", postgres.dsn, "-b", BACKEND,
                                  "--json").stdout)
    assert [event["event"] for event in history["events"]] == ["acquired", "released"]


def test_a_turn_stopped_during_its_release_has_written_it_and_still_holds(postgres, lanelock,
                                                                          procs, lock_roots):
    lock_roots.watch_store(postgres.dsn)
    store = ("--store", postgres.dsn, "-b", BACKEND)
    proc = procs.start([*LANELOCK, "run", *store, "--", "true"], stderr=subprocess.DEVNULL,
                       env=dict(os.environ, LANELOCK_DEBUG_PAUSE="during-release"))
    wait_stopped(proc.pid)
    probe = json.loads(lanelock("probe", *store, "--json").stdout)
    assert probe["state"] == "busy", probe
    history = json.loads(lanelock("history", *store, "--json").stdout)
    assert [event["event"] for event in history["events"] if event.get("pid") == proc.pid] == \
        ["acquired", "released"]
    with psycopg.connect(postgres.dsn, autocommit=True) as conn:
        rows = conn.execute("SELECT record ? 'released_at' FROM lanelock_holders WHERE "
                            "(record->>'pid')::int = %s", (proc.pid,)).fetchall()
    assert rows == [(True,)], rows
    os.kill(proc.pid, signal.SIGCONT)
    assert proc.wait(TIMEOUT) == 0
    assert json.loads(lanelock("probe", *store, "--json").stdout)["state"] == "free"
