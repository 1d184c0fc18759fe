"""The PostgreSQL lane store against a real server on loopback (never a mock)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from support.cli import LANELOCK, TIMEOUT, environ
from support.holding import ESCAPING_HOLD
from support.processes import read_line, wait_for
from lanelock.store.pg.store import lane_key


@pytest.fixture(autouse=True)
def store(postgres, monkeypatch) -> str:
    """Every turn in this file uses the server's lane store (the teardown check watches it)."""
    monkeypatch.setenv("LANELOCK_STORE", postgres.dsn)
    return postgres.dsn


def sql(postgres, query, *params):
    import psycopg

    # A statement that blocks (pg_advisory_lock) gives up within the test's deadline.
    with psycopg.connect(postgres.dsn, autocommit=True,
                         options=f"-c statement_timeout={int(TIMEOUT * 1000)}") as conn:
        rows = conn.execute(query, params).fetchall()
    return rows


def state(lanelock) -> str:
    return json.loads(lanelock("probe", "--json").stdout)["state"]


def key_of_the_lane(lanelock) -> tuple[int, int]:
    return lane_key(json.loads(lanelock("where", "--json").stdout)["lane"])


def test_two_processes_contend_and_the_second_deflects_with_the_reason(lanelock, holder):
    held = holder("-s", "first", "-m", "qwen")
    done = lanelock("run", "-f", "sh -c 'echo $LANELOCK_STATE $LANELOCK_FAILOVER_REASON'", "--",
                    "echo", "no")
    assert done.returncode == 0
    assert done.stdout.strip() == "deflected local_backend_busy"
    assert "local model in use by another session" in done.stderr
    assert f"pid {held.pid}" in done.stderr and "session first" in done.stderr
    assert lanelock("run", "--", "true").returncode == 75
    assert state(lanelock) == "busy"
    assert held.release() == 0


def test_kill_9_of_the_holder_releases(lanelock, holder, postgres):
    held = holder()
    assert state(lanelock) == "busy"
    os.kill(held.pid, signal.SIGKILL)
    held.wait()
    # The server lets go when it notices the closed socket: this session blocks on the lane's
    # advisory lock until then (woken by the server, not polling), and lets go when it closes.
    sql(postgres, "SELECT pg_advisory_lock(%s, %s)", *key_of_the_lane(lanelock))
    lane = json.loads(lanelock("status", "--json").stdout)["lanes"][0]
    assert lane["verdict"] == "died"
    assert lanelock("run", "--", "true").returncode == 0


def test_terminated_session_releases_and_the_wrapper_notices(lanelock, holder, postgres):
    held = holder(stderr=subprocess.PIPE)
    key = key_of_the_lane(lanelock)
    rows = sql(postgres, "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND classid = %s "
                         "AND objid = %s AND granted", key[0] & 0xFFFFFFFF, key[1] & 0xFFFFFFFF)
    assert len(rows) == 1
    sql(postgres, "SELECT pg_terminate_backend(%s)", rows[0][0])
    # The wrapper says so the moment its session is gone: the command, still held on its pipe,
    # runs on.
    warning = read_line(held.proc.stderr)
    assert warning.startswith("lanelock: warning: lane ") and " lost" in warning, warning
    # Its lease keeps other turns off while it runs (they cannot tell it from a cut link)...
    assert state(lanelock) == "busy"
    assert held.release() == 0              # the command went on and finished
    assert "lanelock: warning:" not in held.stderr()   # the only warning was that one
    assert state(lanelock) == "free"        # ...and not after it ended: no one to wait for


def test_wait_hands_off_when_the_holder_ends(lanelock, holder, procs):
    held = holder()
    waiter = procs.start([*LANELOCK, "run", "--wait", "30", "--", "sh", "-c", "echo $LANELOCK_STATE"],
                         env=environ(), stdout=subprocess.PIPE, text=True)
    # Queued in the server (asleep on its LISTEN until the holder's unlock wakes it), where no
    # process can tell us: the lane's queue is polled.
    wait_for(lambda: json.loads(lanelock("status", "--json").stdout)["lanes"][0]["queue"],
             what="the waiter to queue on the server")
    os.kill(held.pid, signal.SIGTERM)
    out, _ = waiter.communicate(timeout=TIMEOUT)
    assert waiter.returncode == 0 and out.strip() == "held"
    assert lanelock("run", "--wait", "0.3", "--", "true").returncode == 0


def test_wait_times_out_on_the_server(lanelock, holder):
    held = holder()
    done = lanelock("run", "--wait", "0.5", "--", "true")
    assert done.returncode == 75
    assert held.release() == 0


def test_status_takes_the_holder_from_pg_locks(lanelock, holder):
    held = holder("-s", "status-session")
    lane = json.loads(lanelock("status", "--json").stdout)["lanes"][0]
    assert lane["state"] == "held" and lane["verdict"] == "held"
    assert lane["kernel_source"] == "pg_locks"
    assert lane["holder"]["pid"] == held.pid and lane["holder"]["session"] == "status-session"
    assert lane["holders"][0]["lanelock"] is True
    all_lanes = json.loads(lanelock("status", "--all", "--json").stdout)["lanes"]
    assert any(entry["lane"] == lane["lane"] for entry in all_lanes)
    human = lanelock("status")
    assert "held by lanelock turn" in human.stdout
    assert held.release() == 0


def test_history_comes_from_the_events_table(lanelock, holder):
    assert lanelock("run", "--", "true").returncode == 0
    held = holder()
    assert lanelock("run", "-f", "true", "--", "true").returncode == 0
    assert held.release() == 0
    data = json.loads(lanelock("history", "--json").stdout)
    kinds = [event["event"] for event in data["events"]]
    assert "acquired" in kinds and "deflected" in kinds
    assert data["summary"]["deflected"] >= 1


@pytest.mark.slow   # the default tier's time: the slow tier (CI) runs it
def test_duel_passes_with_the_store(lanelock, postgres):
    done = lanelock("duel", "--json", "--hold", "0", "--store", postgres.dsn, timeout=180)
    report = json.loads(done.stdout)
    assert done.returncode == 0, report
    assert len(set(report["lock_paths"].values())) == 1
    assert report["lock_paths"]["A"].startswith("postgresql://")


def test_local_lanes_are_per_host_and_lan_lanes_shared(lanelock):
    local = json.loads(lanelock("where", "--json").stdout)["lane"]
    assert local == f"localhost:8080@{os.uname().nodename}"
    lan = json.loads(lanelock("where", "--json", "-b", "192.168.1.50:8080").stdout)
    assert lan["lane"] == "192.168.1.50:8080" and lan["gated"]
    assert json.loads(lanelock("where", "--json", "-b", "api.openai.com:443").stdout)["gated"] is False


def test_password_never_shown(lanelock, postgres):
    dsn = postgres.dsn.replace("postgres@", "postgres:s3cret@")
    done = lanelock("where", "--store", dsn)
    assert "s3cret" not in done.stdout + done.stderr


def test_hash_collision_is_reported(lanelock, holder):
    seen = {}
    for number in range(400000):
        name = f"gpu{number}.lan"
        lane = f"{name}:8080"
        key = lane_key(lane)[1]
        if key in seen:
            first, second = seen[key], name
            break
        seen[key] = name
    else:
        pytest.skip("no collision found in the search space")
    held = holder("-b", f"{first}:8080")
    done = lanelock("run", "-b", f"{second}:8080", "--", "true")
    assert done.returncode == 75
    assert "collision" in done.stderr
    lane = json.loads(lanelock("status", "--json", "-b", f"{second}:8080").stdout)["lanes"][0]
    assert "collision" in (lane["sidecar_problem"] or "") or "collision" in lane["message"]
    assert held.release() == 0


def test_unreachable_store_fails_open_at_once(lanelock):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    done = lanelock("run", "--store", f"postgresql://x@127.0.0.1:{port}/db", "--", "echo", "ran")
    assert done.returncode == 0 and done.stdout.strip() == "ran"
    assert done.stderr.count("lanelock: warning: gate unavailable (") == 1


def test_silent_store_fails_open_within_the_connect_timeout(lanelock):
    """A server that accepts TCP but never speaks: connect_timeout (2 s) bounds the wait."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    try:
        port = listener.getsockname()[1]
        started = time.monotonic()
        done = lanelock("run", "--store", f"postgresql://x@127.0.0.1:{port}/db", "--", "echo", "ran")
        elapsed = time.monotonic() - started
    finally:
        listener.close()
    assert done.returncode == 0 and done.stdout.strip() == "ran"
    assert "gate unavailable" in done.stderr
    assert elapsed < 30   # bounded (the figure itself belongs to bench/, not to a test)


def test_missing_driver_names_the_extra(lanelock, tmp_path):
    blocker = tmp_path / "block" / "psycopg"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('psycopg hidden for this test')\n")
    env = {"PYTHONPATH": tmp_path / "block"}
    done = lanelock("run", "--", "echo", "ran", env=env)
    assert done.returncode == 0 and done.stdout.strip() == "ran"
    assert "pip install '.[postgres]' in lanelock's checkout" in done.stderr
    probe = lanelock("probe", env=env)
    assert probe.returncode == 2 and "'.[postgres]'" in probe.stderr


def test_a_killed_run_hands_the_lane_on_only_once_its_command_is_gone(lanelock, holder, postgres,
                                                                      procs):
    """As on the flock store (test_run_signals.py): the server lets the lane go when the killed wrapper's
    session closes, but its command, still running here, keeps it -- status says `ending`, a
    deflect-mode turn names it, a waiting turn gets the lane once it ends."""
    held = holder(command=[sys.executable, "-c", ESCAPING_HOLD])
    os.kill(held.pid, signal.SIGKILL)
    held.wait()
    sql(postgres, "SELECT pg_advisory_lock(%s, %s)", *key_of_the_lane(lanelock))   # let go by now
    try:
        lane = json.loads(lanelock("status", "--json").stdout)["lanes"][0]
        assert (lane["state"], lane["verdict"]) == ("held", "ending"), lane
        assert lane["holder"]["pid"] == held.child_pid
        busy = lanelock("run", "--", "true")
        assert busy.returncode == 75 and "still ending" in busy.stderr, busy.stderr
        waiter = procs.start([*LANELOCK, "run", "--wait", "--", "echo", "ran"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_for(lambda: json.loads(lanelock("status", "--json").stdout)["lanes"][0]["queue"]
                 or waiter.poll() is not None, what="the turn to wait")
        assert waiter.poll() is None, waiter.communicate()
    finally:
        os.kill(held.child_pid, signal.SIGKILL)
    out, err = waiter.communicate(timeout=TIMEOUT)
    assert (waiter.returncode, out) == (0, "ran\n"), err


def test_a_deflection_whose_fallbacks_all_fail_is_busy_in_history_too(postgres, lanelock, holder,
                                                                        monkeypatch):
    """Events no lock handle carries -- a deflection settled busy, an
    abandoned wait -- were never journaled on this store (no event handle): a turn whose every
    fallback failed read as deflected here and as busy on the flock store."""
    import json

    monkeypatch.setenv("LANELOCK_STORE", postgres.dsn)
    backend = "127.0.0.1:28931"
    held = holder("-b", backend, "--session", "holder")
    assert lanelock("run", "-b", backend, "-s", "nofb", "-f", "/nonexistent/fallback", "--",
                    "true").returncode == 75
    assert held.release() == 0
    done = lanelock("history", "-b", backend, "--json")
    assert done.returncode == 0, done.stderr
    sent = [(event["session"], event["outcome"]) for event in json.loads(done.stdout)["events"]
            if event["event"] == "deflected"]
    assert sent == [("nofb", "busy")], sent


def test_an_unreachable_store_is_asked_once_by_a_turn_that_fails_open(lanelock):
    """The event handle (above) must not make a fail-open turn wait out a second connect timeout
    to record that the store cannot be reached: a server that accepts and never answers sees
    one connection from the turn, and the turn says one line."""
    import socket
    import threading

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    accepted = []

    def accept() -> None:
        while True:
            try:
                accepted.append(listener.accept()[0])   # kept open, never answered
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    try:
        dsn = f"postgresql://postgres@127.0.0.1:{listener.getsockname()[1]}/postgres" \
              "?sslmode=disable"
        done = lanelock("run", "--store", dsn, "-b", "127.0.0.1:28932", "--", "true")
    finally:
        listener.close()
        for conn in accepted:
            conn.close()
    assert done.returncode == 0 and "gate unavailable" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert len(accepted) == 1, len(accepted)
