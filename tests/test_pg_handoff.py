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
from support.processes import wait_for, wait_stopped

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


def test_a_holder_waiting_for_its_hosts_next_head_lets_go_as_that_head_joins(postgres, holder,
                                                                             lock_roots):
    """Holder H, then A and B of one host: A waits in the server's queue, B (next) connected
    ahead. B's link freezes (a relay in front of the server: its session alone) and H lets go:
    A holds, and B, the host's head now, cannot join the server's queue. A's command ends: A
    asks once whether a head of its host has joined (no), and waits -- no other host's later
    waiter may take the lane in between -- woken by B's ring once B's link thaws and B has
    joined: one more question, and the lane goes to B. Two questions in A's release, not a
    question on a schedule (each a round trip: looks at 1, 2, 4 and 8 ms before)."""
    from support.relay import Relay

    relay = Relay(postgres.port)
    try:
        dsn = logged(relay.dsn())   # one DSN for the three (the host's queue is named from it)
        lock_roots.watch_store(postgres.dsn)
        lane = f"127.0.0.1:{7200 + os.getpid() % 400}"
        store = ("--store", dsn, "-b", lane)
        held = holder(*store)

        def sessions() -> set:   # the lanelock sessions' client ports (the relay's side)
            with psycopg.connect(postgres.dsn, autocommit=True) as conn:
                return {port for (port,) in conn.execute(
                    "SELECT client_port FROM pg_stat_activity WHERE application_name LIKE "
                    "'lanelock%%' AND pid <> pg_backend_pid()")}

        def in_server(pid: int) -> bool:
            with psycopg.connect(postgres.dsn, autocommit=True) as conn:
                return conn.execute("SELECT EXISTS (SELECT 1 FROM lanelock_queue WHERE "
                                    "(facts->>'pid')::int = %s)", (pid,)).fetchone()[0]

        a = holder(*store, "--wait", "60", ready=False)
        wait_for(lambda: in_server(a.pid), "A in the server's queue")
        before = sessions()
        b = holder(*store, "--wait", "60", ready=False)
        ports = wait_for(lambda: sessions() - before, "B's session, ahead")
        relay.freeze(port=ports.pop())
        assert held.release() == 0
        a.wait_ready()
        start = os.path.getsize(postgres.log_path)
        a.proc.stdin.write(b"0\n")   # A's command ends; its release waits for B
        a.proc.stdin.close()
        asked = lambda: [line for line in statements(postgres, start)  # noqa: E731
                         if "pg_advisory_unlock(" in line and "EXISTS" in line]
        wait_for(asked, "A's first question")
        assert a.proc.poll() is None   # it waits for B: nobody else may take the lane
        relay.restore()
        assert a.wait() == 0
        b.wait_ready()
        assert len(asked()) == 2, len(asked())
        assert b.release() == 0
    finally:
        relay.close()
