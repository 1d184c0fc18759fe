"""Crowded is not broken on the PostgreSQL store: a server that refuses a connection
for load -- "sorry, too many clients already", "remaining connection slots are reserved" -- is
working and busy. Its refused turns wait (a turn with a wait tries again, backing off) or deflect
(gate_crowded), never run beside the holder. A server that cannot be reached at all still fails
its turns open. A real server with max_connections=20, real `lanelock run` turns released at once.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from support.cli import LANELOCK, TIMEOUT, environ
from support.processes import wait_for

pg_server = pytest.importorskip("support.pg_server")
psycopg = pytest.importorskip("psycopg")

# Each command stamps its own start and end (ns since the epoch) into the file named by $1.
STAMP = 's=$(date +%s%N); sleep 0.15; e=$(date +%s%N); echo "$s $e" >> "$1"'


def crowded_server(lock_roots, role: str | None = None):
    """(dsn, server): a private server with 20 connections (3 of them reserved for superusers);
    its lanes are checked free at teardown, then it stops. role: a non-superuser to connect as
    (it has 17)."""
    if pg_server.binaries() is None:
        pytest.skip("no PostgreSQL server")
    server = pg_server.Server()
    server.settings.update(max_connections=20, superuser_reserved_connections=3)
    lock_roots.after(server.stop)
    server.start()
    dsn = server.dsn
    if role is not None:
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            conn.execute(f"CREATE ROLE {role} LOGIN")
            conn.execute(f"GRANT ALL ON SCHEMA public TO {role}")
        dsn = dsn.replace("postgres@", f"{role}@", 1)
    lock_roots.watch_store(server.dsn)
    return dsn, server


def turns_at_once(procs, dsn: str, stamps, waits: list) -> list:
    """One `lanelock run` per entry of waits (its --wait, or None: no wait), released together
    by one write to the pipe that is their stdin (sh reads a pipe a byte at a time: one line
    each), each running the stamping command. Returns the Popens."""
    go_read, go_write = os.pipe()
    turns = []
    for wait in waits:
        flags = [] if wait is None else ["--wait", str(wait)]
        turns.append(procs.start(
            ["sh", "-c", 'read go; exec "$@" </dev/null', "sh", *LANELOCK, "run",
             "--store", dsn, *flags, "-b", "localhost:7030", "--",
             "sh", "-c", STAMP, "sh", str(stamps)],
            stdin=go_read, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=environ()))
    os.close(go_read)
    os.write(go_write, b"go\n" * len(waits))
    os.close(go_write)
    return turns


def overlaps(stamps) -> list:
    intervals = sorted(tuple(map(int, line.split())) for line in stamps.read_text().splitlines())
    return [(a, b) for a, b in zip(intervals, intervals[1:]) if b[0] < a[1]]


@pytest.mark.slow
@pytest.mark.parametrize("role", [None, "lanes"], ids=["superuser", "role"])
def test_thirty_turns_past_max_connections_wait_or_deflect_never_overlap(role, procs, lock_roots,
                                                                        tmp_path):
    dsn, _ = crowded_server(lock_roots, role)
    stamps = tmp_path / "stamps"
    stamps.touch()
    waits = [30] * 22 + [None] * 8
    turns = turns_at_once(procs, dsn, stamps, waits)
    results = [(turn.wait(timeout=TIMEOUT * 4), turn.stderr.read().decode())
               for turn in turns]
    failed_open = [err for _, err in results if "running without it" in err]
    assert failed_open == [], failed_open[:3]
    assert overlaps(stamps) == []
    waited = results[:22]
    assert [status for status, _ in waited] == [0] * 22, [err for _, err in waited][:3]
    # a turn without a wait ran (the lane was free) or was sent away: busy, or crowded, said so
    for status, err in results[22:]:
        assert status in (0, 75), err
        assert "Traceback" not in err
    assert len(stamps.read_text().splitlines()) == 22 + sum(s == 0 for s, _ in results[22:])


def test_a_crowded_turn_without_a_wait_deflects_gate_crowded(lock_roots):
    """Every connection taken (by others' sessions): a turn without a wait says the gate is
    crowded and runs nothing (exit 75), where it ran ungated before."""
    dsn, _ = crowded_server(lock_roots)
    hogs = [psycopg.connect(dsn, autocommit=True) for _ in range(20)]
    try:
        done = subprocess.run([*LANELOCK, "run", "--store", dsn, "-b", "localhost:7030", "--",
                               "echo", "RAN"], capture_output=True, text=True, env=environ(),
                              timeout=TIMEOUT)
    finally:
        for conn in hogs:
            conn.close()
    assert done.returncode == 75, done.stderr
    assert "RAN" not in done.stdout
    assert "gate_crowded" in done.stderr and "too many clients" in done.stderr
    assert "running without it" not in done.stderr


@pytest.mark.slow   # the default tier's time: the slow tier (CI) runs it
def test_a_crowded_turn_with_a_wait_runs_once_a_connection_frees(procs, lock_roots):
    """Every connection taken: a turn with a wait tries again (backing off) and runs once one is
    let go, inside its wait."""
    dsn, server = crowded_server(lock_roots)
    hogs = [psycopg.connect(dsn, autocommit=True) for _ in range(20)]
    turn = procs.start([*LANELOCK, "run", "--store", dsn, "--wait", "30", "-b", "localhost:7030",
                        "--", "echo", "RAN"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       env=environ())
    # its first try is refused (the server logs the refusal), then a connection frees
    wait_for(lambda: b"too many clients" in open(server.log_path, "rb").read(), "a refusal")
    hogs.pop().close()
    out, err = turn.communicate(timeout=TIMEOUT)
    for conn in hogs:
        conn.close()
    assert turn.returncode == 0, err.decode()
    assert b"RAN" in out
    assert b"running without it" not in err


def test_an_unreachable_server_still_fails_open():
    """Nothing listening: not crowded, absent -- the turn runs ungated and says so, as before."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    done = subprocess.run([*LANELOCK, "run", "--store", f"postgresql://postgres@127.0.0.1:{port}/x",
                           "--wait", "5", "-b", "localhost:7030", "--", "echo", "RAN"],
                          capture_output=True, text=True, env=environ(), timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr
    assert "RAN" in done.stdout and "running without it" in done.stderr


@pytest.mark.slow
def test_twenty_five_waiting_requests_through_the_proxy_past_max_connections(procs, holder,
                                                                             lock_roots):
    """A proxy on a crowded server: 25 requests wait behind a holder while every server
    connection its role may have is taken (its requests' one head among them: the other slots by
    sessions of the role's own); the refused head is asked again (nothing answered fail-open), and
    once the holder lets go all 25 are forwarded one at a time."""
    import json

    pytest.importorskip("aiohttp")
    from support.http import send_waiting
    from support.server import Server
    from support.engine import Engine
    from support.proxy import CHAT, LISTENING, chat_body

    dsn, server = crowded_server(lock_roots, "lanes")   # 17 slots; the test's check has 3 more
    engine = Engine(procs, delay=0.01)
    held = holder("--store", dsn, "-b", engine.backend)
    proxy = Server(procs, [*LANELOCK, "proxy", "--listen", "127.0.0.1:0", "--store", dsn,
                          "--no-witness", "-b", engine.backend, "--wait", "1d"],
                   LISTENING.pattern)
    body = chat_body()
    request = (f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               f"X-Lanelock-Wait: inf\r\nContent-Length: {len(body)}\r\n"
               "Connection: close\r\n\r\n").encode() + body
    # The proxy's waiting requests share its connections (store/pg/hostqueue.py, shared.py):
    # every slot of the role's 17 it has not taken yet is taken by other sessions of the role,
    # until the server refuses one.
    hogs = []
    try:
        while len(hogs) < 20:
            hogs.append(psycopg.connect(dsn, autocommit=True))
    except psycopg.OperationalError:
        pass

    def refusals() -> int:
        return open(server.log_path, "rb").read().count(b"connection slots are reserved")

    before = refusals()
    results, threads = send_waiting(proxy.port, 25, request, TIMEOUT * 4)
    try:
        wait_for(lambda: refusals() > before, "the server's connections taken, the proxy refused")
        assert engine.stats()["total"] == 0, "the engine was asked while the holder held the lane"
        assert not results, results[:3]
    finally:
        for conn in hogs:
            conn.close()
    assert held.release() == 0
    for thread in threads:
        thread.join(TIMEOUT * 4)
    states = [(status, headers.get("x-lanelock-state")) for status, headers in results]
    assert states == [(200, "held")] * 25, sorted(set(map(str, states)))
    assert engine.stats()["max_in_flight"] == 1
    proxy.stop()
    assert "running without it" not in proxy.log() and "fail-open" not in json.dumps(states)
