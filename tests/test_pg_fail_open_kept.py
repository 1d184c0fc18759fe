"""Turns that ran fail-open while the PostgreSQL store could not be reached are in `history` and in
the lane's counts once the server is back: each kept its `fail-open` event and its `fail_open`
count on its host (a spool under the lock root, store/pg/spool.py), and the next turn that
reached the server carried them there. A turn asks the unreachable server once.

A stand-in listener takes the server's address first (it counts the connections it is asked for
and closes each at once: the server's process is gone, the address answers nothing useful); then
a real PostgreSQL 15 takes the same address."""

from __future__ import annotations

import json
import socket
import threading

import pytest

from support.cli import json_of

pg_server = pytest.importorskip("support.pg_server")
psycopg = pytest.importorskip("psycopg")

LANE = "127.0.0.1:7044"


class Refuser:
    """A listener that closes every connection as it comes, counting them."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.asked = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.asked += 1
            conn.close()

    def close(self) -> None:
        self.sock.shutdown(socket.SHUT_RDWR)   # wakes the accept (a close alone would not)
        self.thread.join(10)
        self.sock.close()


@pytest.mark.slow
def test_fail_open_turns_reach_history_and_counts_once_the_server_is_back(lanelock,
                                                                           lock_roots):
    if pg_server.binaries() is None:
        pytest.skip("no PostgreSQL server")
    refuser = Refuser()
    dsn = f"postgresql://postgres@127.0.0.1:{refuser.port}/postgres"
    try:
        for turn in range(2):
            asked = refuser.asked
            done = lanelock("run", "--store", dsn, "-b", LANE, "--", "echo", "ran")
            assert (done.returncode, done.stdout) == (0, "ran\n"), done.stderr
            assert done.stderr.count("running without it") == 1, done.stderr
            assert refuser.asked - asked == 1, f"turn {turn}: asked {refuser.asked - asked}"
    finally:
        refuser.close()
    server = pg_server.Server()
    server.port = refuser.port   # the same address, answering now
    lock_roots.after(server.stop)
    server.start()
    lock_roots.watch_store(dsn)
    done = lanelock("run", "--store", dsn, "-b", LANE, "--", "echo", "ran")
    assert (done.returncode, done.stdout, done.stderr) == (0, "ran\n", "")
    shown = json_of(["history", "--json", "--store", dsn, "-b", LANE])
    assert [event["event"] for event in shown["events"]].count("fail-open") == 2, shown
    assert shown["summary"]["fail_open"] == 2, shown["summary"]
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute("SELECT counts FROM lanelock_counts").fetchall()
    turns = [counts["turns"] for (counts,) in rows]
    assert sum(counted.get("fail_open", 0) for counted in turns) == 2, turns
    assert sum(counted.get("local", 0) for counted in turns) == 1, turns
    # carried once: another turn carries nothing more
    lanelock("run", "--store", dsn, "-b", LANE, "--", "true")
    shown = json_of(["history", "--json", "--store", dsn, "-b", LANE])
    assert shown["summary"]["fail_open"] == 2, json.dumps(shown["summary"])
