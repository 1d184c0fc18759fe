"""Waiters share their host's connection on the PostgreSQL store (store/pg/hostqueue.py): a host's
waiting turns queue on a flock lane of their own host first, and only the head of each host's
queue waits in the server's queue (the waiter next behind it holds a connection ahead of its
turn, the others none). Server connections: one per holder plus at most two per host with
waiters, whatever the number of waiters; the order across hosts
(class, then arrival; aging) holds as with one connection per waiter.

A real PostgreSQL 15 (support/pg_server.py) with max_connections=20, real `lanelock run` turns and a
real proxy; two hosts are network namespaces with hostnames of their own (support/netns.py), sharing
this machine's files (so the same LANELOCK_DIR: the host lane's name carries the host's name).
Each command stamps its own start and end into one file: overlaps are read from the stamps.
"""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from support.cli import LANELOCK, TIMEOUT, environ, json_of
from support.processes import wait_for

pg_server = pytest.importorskip("support.pg_server")
psycopg = pytest.importorskip("psycopg")

# Each command stamps its own start and end (ns since the epoch) into the file named by $1.
STAMP = 's=$(date +%s%N); sleep 0.1; e=$(date +%s%N); echo "$s $e" >> "$1"'
LANE = "localhost:7031"
COUNT_SQL = ("SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE 'lanelock%' "
             "AND pid <> pg_backend_pid()")


def crowded_server(lock_roots):
    """(dsn, server): a private server with 20 connections (3 reserved for superusers)."""
    if pg_server.binaries() is None:
        pytest.skip("no PostgreSQL server")
    server = pg_server.Server()
    server.settings.update(max_connections=20, superuser_reserved_connections=3)
    lock_roots.after(server.stop)
    server.start()
    lock_roots.watch_store(server.dsn)
    return server.dsn, server


def overlaps(stamps: Path) -> list:
    intervals = sorted(tuple(map(int, line.split())) for line in stamps.read_text().splitlines())
    return [(a, b) for a, b in zip(intervals, intervals[1:]) if b[0] < a[1]]


def start_at_once(procs, dsn: str, stamps: Path, count: int, wait: str = "120",
                  lane: str = LANE) -> list:
    """count `lanelock run --wait WAIT` turns released together by one write to their stdin pipe,
    each running the stamping command."""
    go_read, go_write = os.pipe()
    turns = [procs.start(["sh", "-c", 'read go; exec "$@" </dev/null', "sh", *LANELOCK, "run",
                          "--store", dsn, "--wait", wait, "-b", lane, "--",
                          "sh", "-c", STAMP, "sh", str(stamps)],
                         stdin=go_read, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=environ())
             for _ in range(count)]
    os.close(go_read)
    os.write(go_write, b"go\n" * count)
    os.close(go_write)
    return turns


def sessions(dsn: str) -> list[tuple]:
    """lanelock's sessions on the server now: what each runs and since when (said when a count
    is more than the docs allow)."""
    with psycopg.connect(dsn, autocommit=True, application_name="sampler") as conn:
        return conn.execute("SELECT pid, application_name, state, left(query, 160), backend_start "
                            "FROM pg_stat_activity WHERE application_name LIKE 'lanelock%' "
                            "ORDER BY backend_start").fetchall()


class Sampler:
    """The server's own count of lanelock's sessions, sampled every 20 ms in a thread on a
    connection of its own (a superuser's reserved slot; not counted: its application_name)."""

    def __init__(self, dsn: str, sql: str = COUNT_SQL):
        self.conn = psycopg.connect(dsn, autocommit=True, application_name="sampler")
        self.sql = sql
        self.counts: list[int] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(0.02):
            self.counts.append(self.conn.execute(self.sql).fetchone()[0])

    def take(self) -> list[int]:
        """The samples so far, one taken now among them (a phase may be shorter than the
        thread's period), and a fresh list for the next phase."""
        now = self.conn.execute(self.sql).fetchone()[0]
        taken, self.counts = self.counts, []
        return [*taken, now]

    def close(self) -> None:
        self.stop.set()
        self.thread.join(TIMEOUT)
        self.conn.close()


def queue_length(dsn: str, lane: str = LANE) -> int:
    (found,) = json_of(["status", "--json", "--store", dsn, "-b", lane])["lanes"]
    return len(found["queue"])


@pytest.mark.slow
def test_thirty_waiters_past_max_connections_hold_two_connections_for_their_host(
        procs, holder, lock_roots, tmp_path):
    """A holder, then 30 waiters on one host (more than the server's 20 connections): while
    they wait the server counts 3 lanelock sessions (the holder's, the host's head's and its
    next's), `status` lists all 30 in the queue; once the holder lets go all 30 run one at a
    time, none fails open. Before host lanes every waiter held a session: 17 of them filled the server and the
    rest backed off, crowded."""
    dsn, _ = crowded_server(lock_roots)
    stamps = tmp_path / "stamps"
    stamps.touch()
    held = holder("--store", dsn, "-b", LANE, "-s", "holder")
    turns = start_at_once(procs, dsn, stamps, 30)
    wait_for(lambda: queue_length(dsn) == 30, "30 waiters queued", timeout=TIMEOUT)
    sampler = Sampler(dsn)
    try:
        time.sleep(1.0)   # samples while they wait: 50 of them
        waiting = sampler.take()
        assert held.release() == 0
        results = [(turn.wait(timeout=TIMEOUT * 2), turn.stderr.read().decode())
                   for turn in turns]
        serving = sampler.take()
    finally:
        sampler.close()
    print(f"\n30 waiters past max_connections=20: lanelock sessions while they wait "
          f"{min(waiting)}-{max(waiting)} ({len(waiting)} samples), while served "
          f"{min(serving or [0])}-{max(serving or [0])} ({len(serving)} samples)")
    assert len(waiting) >= 10 and max(waiting) <= 3, waiting
    failed_open = [err for _, err in results if "running without it" in err]
    assert failed_open == [], failed_open[:3]
    assert [status for status, _ in results] == [0] * 30, [err for _, err in results][:3]
    assert overlaps(stamps) == []
    assert len(stamps.read_text().splitlines()) == 30
    # while served: the holder, the head, its next, and a holder just done (its count): never
    # more
    assert serving and max(serving) <= 4, serving


@pytest.mark.slow
def test_twenty_five_waiting_requests_through_the_proxy_hold_two_connections(procs, holder,
                                                                            lock_roots):
    """A proxy on the crowded server, 25 requests waiting behind a holder of another process:
    the server counts the holder's session, the proxy's one head, its next and its one connection
    for short questions (store/pg/shared.py: the waiting requests' looks) while they wait; once the
    holder lets go all 25 are forwarded one at a time, none answered fail-open."""
    import json

    pytest.importorskip("aiohttp")
    from support.http import send_waiting
    from support.server import Server
    from support.engine import Engine
    from support.proxy import CHAT, LISTENING, chat_body

    dsn, _ = crowded_server(lock_roots)
    engine = Engine(procs, delay=0.01)
    held = holder("--store", dsn, "-b", engine.backend)
    proxy = Server(procs, [*LANELOCK, "proxy", "--listen", "127.0.0.1:0", "--store", dsn,
                           "--no-witness", "-b", engine.backend, "--wait", "1d"],
                   LISTENING.pattern)
    body = chat_body()
    request = (f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               f"X-Lanelock-Wait: inf\r\nContent-Length: {len(body)}\r\n"
               "Connection: close\r\n\r\n").encode() + body
    results, threads = send_waiting(proxy.port, 25, request, TIMEOUT * 4)
    wait_for(lambda: queue_length(dsn, engine.backend) == 25, "25 requests queued",
             timeout=TIMEOUT)
    sampler = Sampler(dsn)
    try:
        time.sleep(1.0)
        waiting = sampler.take()
    finally:
        sampler.close()
    print(f"\n25 waiting proxied requests: lanelock sessions while they wait "
          f"{min(waiting)}-{max(waiting)} ({len(waiting)} samples)")
    assert len(waiting) >= 10 and max(waiting) <= 4, (waiting, sessions(dsn))
    assert engine.stats()["total"] == 0, "the engine was asked while the holder held the lane"
    assert not results, results[:3]
    assert held.release() == 0
    for thread in threads:
        thread.join(TIMEOUT * 4)
    states = [(status, headers.get("x-lanelock-state")) for status, headers in results]
    assert states == [(200, "held")] * 25, sorted(set(map(str, states)))
    assert engine.stats()["max_in_flight"] == 1
    proxy.stop()
    assert "running without it" not in proxy.log() and "fail-open" not in json.dumps(states)


def test_three_waiters_of_a_host_whose_server_cannot_be_reached_run_one_at_a_time(procs,
                                                                                 tmp_path):
    """Nothing listens at the store's address: each of three turns started together fails open
    with its one warning, and they run one at a time -- the host lane, kept by the turn that
    runs ungated, still orders this host's turns (before: all three at once)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    stamps = tmp_path / "stamps"
    stamps.touch()
    turns = start_at_once(procs, f"postgresql://postgres@127.0.0.1:{port}/x", stamps, 3,
                          wait="30")
    results = [(turn.wait(timeout=TIMEOUT), turn.stderr.read().decode()) for turn in turns]
    assert len(stamps.read_text().splitlines()) == 3
    assert overlaps(stamps) == []
    for status, err in results:
        assert status == 0, err
        assert err.count("running without it") == 1, err
        assert "ungated across hosts" in err and "Traceback" not in err, err


def test_a_stopped_head_is_passed_over_by_the_next_waiter_of_its_host(postgres, procs, holder,
                                                                      lock_roots):
    """The first waiter of a host (its head, in the server's queue) is stopped (kill -STOP): the
    next waiter of the host passes it over, as the flock queue passes over a stopped waiter,
    joins the server's queue itself and runs once the holder lets go; the stopped one keeps its
    place and runs once continued. (A head that held its host's waiters back while stopped made
    the second wait for ever.)"""
    import signal

    lock_roots.watch_store(postgres.dsn)
    lane = f"127.0.0.1:{7100 + os.getpid() % 500}"
    held = holder("--store", postgres.dsn, "-b", lane)

    def waiter(word: str):
        return procs.start([*LANELOCK, "run", "--store", postgres.dsn, "--wait", "60", "-b", lane,
                            "--", "echo", word], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           env=environ())

    def in_server() -> set:
        with psycopg.connect(postgres.dsn, autocommit=True) as conn:
            return {row[0] for row in conn.execute(
                "SELECT (facts->>'pid')::int FROM lanelock_queue")}

    first = waiter("first")
    wait_for(lambda: first.pid in in_server(), "the first waiter in the server's queue")
    os.kill(first.pid, signal.SIGSTOP)
    try:
        second = waiter("second")
        wait_for(lambda: second.pid in in_server(), "the second waiter in the server's queue")
        assert held.release() == 0
        out, err = second.communicate(timeout=TIMEOUT)
        assert (second.returncode, out, err) == (0, b"second\n", b"")
    finally:
        os.kill(first.pid, signal.SIGCONT)
    out, err = first.communicate(timeout=TIMEOUT)
    assert (first.returncode, out, err) == (0, b"first\n", b"")


@pytest.mark.slow
def test_the_next_waiter_of_a_host_connects_ahead_and_each_new_next_is_woken_to(
        postgres, holder, lock_roots):
    """Holder H, then waiters A, B, C of one host: A waits in the server's queue (its head) and
    B, next behind it, holds a connection of its own already (H's, A's, B's: 3 sessions), C
    none. H lets go and A holds: B is the head now, and C, though it waits on B's entry and
    nobody just ahead of it left, connects as the next (A's, B's, C's: 3 again, H's session
    gone). Then each runs in its order. (How soon C connects -- B's ring wakes it -- is a speed:
    bench/handoff.py.)"""
    lock_roots.watch_store(postgres.dsn)
    lane = f"127.0.0.1:{7600 + os.getpid() % 400}"
    held = holder("--store", postgres.dsn, "-b", lane)
    sessions = ("SELECT pid FROM pg_stat_activity WHERE application_name LIKE 'lanelock%%' "
                "AND pid <> pg_backend_pid() AND pid <> ALL(%s)")

    def lanelock_sessions(leaving=()) -> list[int]:
        with psycopg.connect(postgres.dsn, autocommit=True) as conn:
            return [pid for (pid,) in conn.execute(sessions, (list(leaving),))]

    def in_server() -> set:   # of this test's waiters
        with psycopg.connect(postgres.dsn, autocommit=True) as conn:
            return {row[0] for row in conn.execute(
                "SELECT (facts->>'pid')::int FROM lanelock_queue")} & {turn.pid for turn in waiting}

    holders = lanelock_sessions()
    assert len(holders) == 1, holders   # H's alone
    waiting = []
    for count in (1, 2, 3):
        waiting.append(holder("--store", postgres.dsn, "-b", lane, "--wait", "60",
                              ready=False))
        wait_for(lambda: queue_length(postgres.dsn, lane) == count, f"{count} queued")
    a, b, c = waiting
    wait_for(lambda: in_server() == {a.pid}, "A, the head, alone in the server's queue")
    wait_for(lambda: len(lanelock_sessions()) == 3, "H's, the head's and the next's sessions")
    assert held.release() == 0
    a.wait_ready()
    wait_for(lambda: in_server() == {b.pid}, "B, the new head, in the server's queue")
    wait_for(lambda: len(lanelock_sessions(holders)) == 3,
             "A's, B's, and C's (the new next) sessions")
    for turn, after in ((a, b), (b, c), (c, None)):
        assert turn.release() == 0
        if after is not None:
            after.wait_ready()


# == two hosts =====================================================================================
ENGINE_PORT = 8094
NO_AGING = "3600"
SERVED = 'echo "$1" >> "$0"'


@pytest.fixture
def hosts(lock_roots, monkeypatch):
    """[host A, host B]: network namespaces with their own hostnames, reaching one PostgreSQL
    server on the engine box's LAN address (netns.two_hosts)."""
    from support.netns import Host, two_hosts

    hosts = two_hosts(lock_roots, ("host-a", "host-b"), Host)
    monkeypatch.setenv("LANELOCK_PRIORITY_AGING", NO_AGING)
    return hosts


def engine() -> str:
    from support.netns import ENGINE_IP

    return f"{ENGINE_IP}:{ENGINE_PORT}"


def waiter(host, procs, order: Path, name: str, klass: str):
    return procs.start([*host.prefix, *LANELOCK, "run", "--wait", "120", "--priority", klass,
                        "-s", name, "-b", engine(), "--store", host.store, "--",
                        "sh", "-c", SERVED, str(order), name],
                       stderr=subprocess.PIPE, text=True)


def queue_of(store: str) -> list[dict]:
    (lane,) = json_of(["status", "--json", "--store", store, "-b", engine()])["lanes"]
    return lane["queue"]


def server_queue(store: str) -> list[str]:
    """The sessions of the rows in the server's own queue table (the hosts' heads)."""
    with psycopg.connect(store, autocommit=True) as conn:
        rows = conn.execute("SELECT facts->>'session' FROM lanelock_queue WHERE lane = %s "
                            "ORDER BY ticket", (engine(),)).fetchall()
    return [row[0] for row in rows]


def queue_in_turn(procs, order: Path, arrivals) -> dict:
    """Each waiter (host, name, class) started once the one before shows in the queue."""
    waiters = {}
    for host, name, klass in arrivals:
        started = waiter(host, procs, order, name, klass)

        def seen(started=started, name=name):
            if started.poll() is not None:
                raise AssertionError(f"{name} ended: {started.stderr.read()!r}")
            return any(entry["pid"] == started.pid for entry in queue_of(host.store))

        wait_for(seen, f"{name} to queue")
        waiters[name] = started
    return waiters


def finished(waiters: dict) -> None:
    for name, started in waiters.items():
        status = started.wait(TIMEOUT)
        said = started.stderr.read()
        assert (status, said) == (0, ""), (name, said)


@pytest.mark.slow
def test_a_later_waiter_of_a_host_keeps_its_arrival_across_hosts(hosts, holder, procs,
                                                                  tmp_path):
    """A holds; a1 then a2 wait on host A (a2 behind a1 on A's host lane, no connection), then
    b1 on host B. a2 joins the server's queue only when a1 has the lane, yet with its own
    arrival: served a1, a2, b1 (not a1, b1, a2), and `status` lists the three in that order."""
    host_a, host_b = hosts
    order = tmp_path / "order"
    first = holder("-b", engine(), "--store", host_a.store, "-s", "holder",
                   prefix=host_a.prefix)
    waiters = queue_in_turn(procs, order, [(host_a, "a1", "normal"), (host_a, "a2", "normal"),
                                           (host_b, "b1", "normal")])
    assert [entry["session"] for entry in queue_of(host_a.store)] == ["a1", "a2", "b1"]
    assert sorted(server_queue(host_a.store)) == ["a1", "b1"]   # one head per host
    assert first.release() == 0
    finished(waiters)
    assert order.read_text().splitlines() == ["a1", "a2", "b1"]


@pytest.mark.slow
def test_an_interactive_arrival_behind_a_batch_head_goes_before_the_other_hosts_batch(
        hosts, holder, procs, tmp_path):
    """A holds; a-batch (host A's head, in the server) and b-batch (host B's) wait, then
    a-interactive arrives on host A, behind its batch head on A's host lane. The head steps
    aside (it leaves the server's queue, keeping its arrival): a-interactive is served first,
    then a-batch, then b-batch."""
    host_a, host_b = hosts
    order = tmp_path / "order"
    first = holder("-b", engine(), "--store", host_a.store, "-s", "holder",
                   prefix=host_a.prefix)
    waiters = queue_in_turn(procs, order, [(host_a, "a-batch", "batch"),
                                           (host_b, "b-batch", "batch"),
                                           (host_a, "a-interactive", "interactive")])
    wait_for(lambda: sorted(server_queue(host_a.store)) == ["a-interactive", "b-batch"],
             "a-batch to step aside for a-interactive")
    assert [entry["session"] for entry in queue_of(host_a.store)] == \
        ["a-interactive", "a-batch", "b-batch"]
    assert first.release() == 0
    finished(waiters)
    assert order.read_text().splitlines() == ["a-interactive", "a-batch", "b-batch"]


@pytest.mark.parametrize("count", [60, pytest.param(200, marks=pytest.mark.slow)])
def test_many_waiting_proxied_requests_never_crowd_the_server(procs, holder, lock_roots, count):
    """A proxy with its witness on a server of 20 connections: its waiting requests, its status
    and its witness share its host's connections -- no burst past max_connections (no FATAL in
    the server's log), no request answered fail-open, and all forwarded one at a time once the
    holder of another process lets go."""
    import http.client
    import json

    pytest.importorskip("aiohttp")
    from support.http import send_waiting
    from support.server import Server
    from support.engine import Engine
    from support.proxy import CHAT, LISTENING, chat_body

    dsn, server = crowded_server(lock_roots)
    engine = Engine(procs, delay=0.01)
    held = holder("--store", dsn, "-b", engine.backend)
    proxy = Server(procs, [*LANELOCK, "proxy", "--listen", "127.0.0.1:0", "--store", dsn,
                           "-b", engine.backend, "--wait", "1d"], LISTENING.pattern)
    body = chat_body()
    request = (f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               f"X-Lanelock-Wait: inf\r\nContent-Length: {len(body)}\r\n"
               "Connection: close\r\n\r\n").encode() + body
    # The test's own `lanelock status` (its queue_length) not counted.
    sampler = Sampler(dsn, COUNT_SQL + " AND application_name <> 'lanelock status'")
    try:
        results, threads = send_waiting(proxy.port, count, request, TIMEOUT * 8)
        wait_for(lambda: queue_length(dsn, engine.backend) == count,
                 f"{count} requests queued", timeout=TIMEOUT * 2)
        arriving = sampler.take()
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=TIMEOUT)
        conn.request("GET", "/lanelock/status")
        status = conn.getresponse()
        assert status.status == 200 and json.loads(status.read())["lanes"]
        conn.close()
        assert not results, results[:3]
        waiting = sampler.take()
        assert held.release() == 0
        for thread in threads:
            thread.join(TIMEOUT * 8)
        draining = sampler.take()
    finally:
        sampler.close()
    states = [(status, headers.get("x-lanelock-state")) for status, headers in results]
    assert states == [(200, "held")] * count, sorted(set(map(str, states)))
    assert engine.stats()["max_in_flight"] == 1
    proxy.stop()
    fatal = [line for line in open(server.log_path).read().splitlines() if "FATAL" in line and
             "role \"root\" does not exist" not in line]
    print(f"\n{count} waiting proxied requests: lanelock sessions at most "
          f"{max(arriving)} arriving, {max(waiting)} waiting, {max(draining)} draining; "
          f"{len(fatal)} FATAL lines")
    assert not fatal, fatal[:5]
    # The same few whatever the count: the other process's holder, and the proxy's -- its
    # witness, its short questions' one connection, and its turns' own sessions as the lane is
    # handed on (the one releasing, counting; the one holding; its host's next head and the
    # one after it). Not one per waiting request: that was 17 of the 20.
    assert max(arriving + waiting + draining) <= 10, (arriving, waiting, draining)
    assert "running without it" not in proxy.log() and "fail-open" not in json.dumps(states)
