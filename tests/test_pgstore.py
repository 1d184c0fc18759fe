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

sys.path.insert(0, os.path.dirname(__file__))
import pg_server  # noqa: E402

from lanelock.store.postgres import lane_key  # noqa: E402

LANELOCK = [sys.executable, "-m", "lanelock"]


@pytest.fixture(scope="module")
def server():
    if pg_server.binaries() is None:
        if os.environ.get("LANELOCK_REQUIRE_PG"):
            pytest.fail("no PostgreSQL server binaries")
        pytest.skip("no PostgreSQL server binaries (apt-get install postgresql)")
    pytest.importorskip("psycopg")
    instance = pg_server.Server().start()
    yield instance
    instance.stop()


@pytest.fixture(autouse=True)
def env(tmp_path, monkeypatch, server):
    monkeypatch.setenv("LANELOCK_DIR", str(tmp_path / "root"))
    monkeypatch.setenv("LANELOCK_STORE", server.dsn)
    monkeypatch.setenv("LANELOCK_SYSTEM_CONFIG", str(tmp_path / "none.toml"))
    monkeypatch.setenv("LANELOCK_CONFIG", str(tmp_path / "none-user.toml"))
    for name in ("LANELOCK_BACKEND", "LANELOCK_SESSION", "LANELOCK_HELD", "LANELOCK_HOLDER_PID"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def procs():
    started = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def lanelock(*args, timeout=60, **kw):
    return subprocess.run(LANELOCK + list(args), capture_output=True, text=True, timeout=timeout, **kw)


def sql(server, query, *params):
    import psycopg

    with psycopg.connect(server.dsn, autocommit=True) as conn:
        rows = conn.execute(query, params).fetchall()
    return rows


def hold(procs, tmp_path, *extra, name="ready"):
    ready = tmp_path / name
    proc = subprocess.Popen(LANELOCK + ["run", *extra, "--", "sh", "-c", f"touch {ready}; sleep 60"])
    procs.append(proc)
    deadline = time.monotonic() + 30
    while not ready.exists():
        assert time.monotonic() < deadline and proc.poll() is None, "the holder never started"
        time.sleep(0.01)
    return proc


def state() -> str:
    return json.loads(lanelock("probe", "--json").stdout)["state"]


def test_two_processes_contend_and_the_second_deflects_with_the_reason(procs, tmp_path):
    holder = hold(procs, tmp_path, "-s", "first", "-m", "qwen")
    done = lanelock("run", "-f", "sh -c 'echo $LANELOCK_STATE $LANELOCK_FAILOVER_REASON'", "--", "echo", "no")
    assert done.returncode == 0
    assert done.stdout.strip() == "deflected local_backend_busy"
    assert "local model in use by another session" in done.stderr
    assert f"pid {holder.pid}" in done.stderr and "session first" in done.stderr
    assert lanelock("run", "--", "true").returncode == 75
    assert state() == "busy"


def test_kill_9_of_the_holder_releases(procs, tmp_path):
    holder = hold(procs, tmp_path)
    assert state() == "busy"
    holder.kill()
    holder.wait()
    deadline = time.monotonic() + 30
    while state() != "free":   # the server notices the closed socket at once
        assert time.monotonic() < deadline
        time.sleep(0.02)
    lane = json.loads(lanelock("status", "--json").stdout)["lanes"][0]
    assert lane["verdict"] == "died"
    assert lanelock("run", "--", "true").returncode == 0


def test_terminated_session_releases_and_the_wrapper_notices(procs, tmp_path, server):
    holder = subprocess.Popen(LANELOCK + ["run", "--", "sh", "-c", f"touch {tmp_path}/r; sleep 3"],
                              stderr=subprocess.PIPE, text=True)
    procs.append(holder)
    deadline = time.monotonic() + 30
    while not (tmp_path / "r").exists():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    key = lane_key(json.loads(lanelock("where", "--json").stdout)["lane"])
    rows = sql(server, "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND classid = %s "
                       "AND objid = %s AND granted", key[0] & 0xFFFFFFFF, key[1] & 0xFFFFFFFF)
    assert len(rows) == 1
    sql(server, "SELECT pg_terminate_backend(%s)", rows[0][0])
    assert state() == "free"
    _, err = holder.communicate(timeout=30)
    assert holder.returncode == 0           # the command went on and finished
    assert "lost" in err and err.count("lanelock: warning:") == 1


def test_wait_hands_off_when_the_holder_ends(procs, tmp_path):
    holder = hold(procs, tmp_path)
    waiter = subprocess.Popen(LANELOCK + ["run", "--wait", "30", "--", "sh", "-c", "echo $LANELOCK_STATE"],
                              stdout=subprocess.PIPE, text=True)
    procs.append(waiter)
    deadline = time.monotonic() + 30
    while not json.loads(lanelock("status", "--json").stdout)["lanes"][0]["waiters"]:
        assert time.monotonic() < deadline, "the waiter never blocked on the server"
        time.sleep(0.02)
    holder.send_signal(signal.SIGTERM)
    out, _ = waiter.communicate(timeout=30)
    assert waiter.returncode == 0 and out.strip() == "held"
    assert lanelock("run", "--wait", "0.3", "--", "true").returncode == 0


def test_wait_times_out_on_the_server(procs, tmp_path):
    hold(procs, tmp_path)
    done = lanelock("run", "--wait", "0.5", "--", "true")
    assert done.returncode == 75


def test_status_takes_the_holder_from_pg_locks(procs, tmp_path):
    holder = hold(procs, tmp_path, "-s", "status-session")
    lane = json.loads(lanelock("status", "--json").stdout)["lanes"][0]
    assert lane["state"] == "held" and lane["verdict"] == "held"
    assert lane["kernel_source"] == "pg_locks"
    assert lane["holder"]["pid"] == holder.pid and lane["holder"]["session"] == "status-session"
    assert lane["holders"][0]["lanelock"] is True
    all_lanes = json.loads(lanelock("status", "--all", "--json").stdout)["lanes"]
    assert any(entry["lane"] == lane["lane"] for entry in all_lanes)
    human = lanelock("status")
    assert "held by lanelock turn" in human.stdout


def test_history_comes_from_the_events_table(procs, tmp_path):
    assert lanelock("run", "--", "true").returncode == 0
    holder = hold(procs, tmp_path)
    assert lanelock("run", "-f", "true", "--", "true").returncode == 0
    holder.kill()
    holder.wait()
    data = json.loads(lanelock("history", "--json").stdout)
    kinds = [event["event"] for event in data["events"]]
    assert "acquired" in kinds and "deflected" in kinds
    assert data["summary"]["deflected"] >= 1


def test_duel_passes_with_the_store(server):
    done = lanelock("duel", "--json", "--hold", "0", "--store", server.dsn, timeout=180)
    report = json.loads(done.stdout)
    assert done.returncode == 0, report
    assert len(set(report["lock_paths"].values())) == 1
    assert report["lock_paths"]["A"].startswith("postgresql://")


def test_local_lanes_are_per_host_and_lan_lanes_shared():
    local = json.loads(lanelock("where", "--json").stdout)["lane"]
    assert local == f"localhost:8080@{os.uname().nodename}"
    lan = json.loads(lanelock("where", "--json", "-b", "192.168.1.50:8080").stdout)
    assert lan["lane"] == "192.168.1.50:8080" and lan["gated"]
    assert json.loads(lanelock("where", "--json", "-b", "api.openai.com:443").stdout)["gated"] is False


def test_password_never_shown(server):
    dsn = server.dsn.replace("postgres@", "postgres:s3cret@")
    done = lanelock("where", "--store", dsn)
    assert "s3cret" not in done.stdout + done.stderr


def test_hash_collision_is_reported(procs, tmp_path):
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
    hold(procs, tmp_path, "-b", f"{first}:8080")
    done = lanelock("run", "-b", f"{second}:8080", "--", "true")
    assert done.returncode == 75
    assert "collision" in done.stderr
    lane = json.loads(lanelock("status", "--json", "-b", f"{second}:8080").stdout)["lanes"][0]
    assert "collision" in (lane["sidecar_problem"] or "") or "collision" in lane["message"]


def test_unreachable_store_fails_open_at_once():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    done = lanelock("run", "--store", f"postgresql://x@127.0.0.1:{port}/db", "--", "echo", "ran")
    assert done.returncode == 0 and done.stdout.strip() == "ran"
    assert done.stderr.count("lanelock: warning: gate unavailable (") == 1


def test_silent_store_fails_open_within_the_connect_timeout():
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


def test_missing_driver_names_the_extra(tmp_path):
    blocker = tmp_path / "block" / "psycopg"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('psycopg hidden for this test')\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "block"))
    done = subprocess.run(LANELOCK + ["run", "--", "echo", "ran"], capture_output=True, text=True,
                          env=env, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ran"
    assert "pip install 'lanelock[postgres]'" in done.stderr
    probe = subprocess.run(LANELOCK + ["probe"], capture_output=True, text=True, env=env, timeout=60)
    assert probe.returncode == 2 and "lanelock[postgres]" in probe.stderr
