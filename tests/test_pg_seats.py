"""Seats on the PostgreSQL store, across hosts: a lane of N holds up to N turns at once, each on a
seat of its own (an advisory lock per seat, seat 1's the lane's own key), the count kept in the
store's table of kept values -- one value every host reads.

Two hosts: the site of test_priority_hosts.py (support/netns.py). This namespace is the engine
box, where a real PostgreSQL server listens on its LAN address; each host is a network namespace
with its own link to it and its own hostname. Every turn is given `-b ENGINE`, the one LAN lane
of both hosts; nothing listens there (`run` never asks the engine). The hosts share this machine's
files and pids. A held command says its seat ("ready PID SEAT") and holds until told its status.
Each test ends with the server's log holding no ERROR line of a lanelock session.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from support.cli import LANELOCK, TIMEOUT, json_of
from support.processes import ExitWatch, read_line, wait_for
from support.netns import ENGINE_IP, Host, two_hosts

pg_server = pytest.importorskip("support.pg_server")
psycopg = pytest.importorskip("psycopg")

ENGINE = f"{ENGINE_IP}:8094"          # nobody listens: `run` never asks the engine
SEATED = ["sh", "-c", 'echo "ready $$ $LANELOCK_SEAT"; read code; exit "${code:-0}"']
# Each command stamps its own start and end (ns since the epoch) and its seat into the file $1.
STAMP = 's=$(date +%s%N); sleep 0.5; echo "$s $(date +%s%N) $LANELOCK_SEAT" >> "$1"'


@pytest.fixture
def hosts(lock_roots):
    """[host A, host B] on one PostgreSQL store (netns.two_hosts), the lane's count set to 2 from
    host A."""
    return two_hosts(lock_roots, ("host-a", "host-b"), Host)


def seats(host, run_cmd, *count) -> subprocess.CompletedProcess:
    """`lanelock seats -b ENGINE [COUNT]` on the host."""
    done = host.lanelock(run_cmd, "seats", "-b", ENGINE, "--store", host.store, *count)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done
    return done


def hold(holder, host, *args, ready=True):
    """A `run` turn of the host holding a seat (ready=False: one that waits for it)."""
    return holder("-b", ENGINE, "--store", host.store, *args, command=SEATED, ready=ready,
                  prefix=host.prefix)


def seat_of(held) -> int:
    return int(held.ready_line.split()[2])


def run(host, run_cmd, *args) -> subprocess.CompletedProcess:
    return host.lanelock(run_cmd, "run", "-b", ENGINE, "--store", host.store, *args)


def queued(store: str, pid: int) -> bool:
    (lane,) = json_of(["status", "--json", "--store", store, "-b", ENGINE])["lanes"]
    return any(entry["pid"] == pid for entry in lane["queue"])


def assert_quiet(store: str) -> None:
    """The server's log (beside its data directory: support/pg_server.py) has no ERROR line of
    a lanelock session."""
    with psycopg.connect(store, autocommit=True) as conn:
        data = conn.execute("SHOW data_directory").fetchone()[0]
    log = Path(os.path.dirname(data)) / "server.log"
    assert pg_server.lanelock_errors(log.read_text()) == []


def events(store: str) -> list[dict]:
    with psycopg.connect(store, autocommit=True) as conn:
        rows = conn.execute("SELECT event FROM lanelock_events WHERE lane = %s ORDER BY ts, id",
                            (ENGINE,)).fetchall()
    return [row[0] for row in rows]


def test_two_hosts_hold_two_seats_at_once_and_a_third_deflects(hosts, holder, run_cmd):
    """The count set from host A is read on host B; a turn of each host holds at once, each on a
    seat of its own; a third from either host deflects, naming both holders."""
    host_a, host_b = hosts
    assert seats(host_b, run_cmd).stdout == "1\n"
    seats(host_a, run_cmd, "2")
    assert seats(host_b, run_cmd).stdout == "2\n"
    on_a = hold(holder, host_a, "-s", "on-a")
    on_b = hold(holder, host_b, "-s", "on-b")
    assert {seat_of(on_a), seat_of(on_b)} == {1, 2}   # both running
    # Every seat's facts, from the other host too: who holds which seat, and from where.
    for host in hosts:
        shown = host.lanelock(run_cmd, "status", "--json", "-b", ENGINE, "--store", host.store)
        (lane,) = json.loads(shown.stdout)["lanes"]
        assert (lane["seats"], lane["held_seats"]) == (2, 2), lane
        assert sorted((seat["seat"], seat["holder"]["pid"], seat["holder"]["hostname"])
                      for seat in lane["by_seat"]) == \
            sorted([(seat_of(on_a), on_a.pid, "host-a"), (seat_of(on_b), on_b.pid, "host-b")])
    for host in hosts:
        third = run(host, run_cmd, "--", "echo", "ran")
        assert third.returncode == 75 and "ran" not in third.stdout, third
        assert "2 of 2 seats" in third.stderr, third.stderr
        assert f"pid {on_a.pid}" in third.stderr and f"pid {on_b.pid}" in third.stderr
    assert on_a.release() == 0 and on_b.release() == 0
    assert run(host_b, run_cmd, "--", "true").returncode == 0
    assert_quiet(host_a.store)


@pytest.mark.slow
def test_a_waiting_turn_takes_the_first_seat_freed_on_either_host(hosts, holder, run_cmd):
    """Both seats held (one from each host); a waiter of host B takes the seat host A's turn frees
    -- woken by its release, not a poll -- while B's own holder holds on."""
    host_a, host_b = hosts
    seats(host_a, run_cmd, "2")
    on_a = hold(holder, host_a)
    on_b = hold(holder, host_b)
    waiting = hold(holder, host_b, "--wait", "60", ready=False)
    wait_for(lambda: queued(host_a.store, waiting.pid), "the waiter queued")
    freed = seat_of(on_a)
    released = time.monotonic()
    assert on_a.release() == 0
    waiting.wait_ready()
    assert time.monotonic() - released < 1.0   # the release's notification woke it
    assert seat_of(waiting) == freed
    assert waiting.release() == 0 and on_b.release() == 0
    assert_quiet(host_a.store)


@pytest.mark.slow   # the default tier's time: the slow tier (CI) runs it
@pytest.mark.parametrize("killed_on", ["same host", "other host"])
def test_kill_9_of_a_holder_frees_its_seat(hosts, holder, run_cmd, killed_on):
    """kill -9 of a holder (the wrapper and its command) frees its seat for the waiter: of the
    waiter's host, its death wakes the wait at once; of another host, once its lease ends (the
    server cannot tell a death elsewhere from a cut link: store/pg/lease.py), asked again within
    a second (a death elsewhere notifies no one)."""
    from lanelock.store.pg.lease import LEASE

    host_a, host_b = hosts
    seats(host_a, run_cmd, "2")
    victim_host = host_a if killed_on == "same host" else host_b
    other_host = host_b if killed_on == "same host" else host_a
    victim = hold(holder, victim_host)
    other = hold(holder, other_host)
    waiting = hold(holder, host_a, "--wait", "60", ready=False)
    wait_for(lambda: queued(host_a.store, waiting.pid), "the waiter queued")
    gone = ExitWatch(victim.pid)
    os.killpg(victim.pid, signal.SIGKILL)
    gone.wait()
    killed = time.monotonic()
    waiting.wait_ready()
    assert time.monotonic() - killed < (3.0 if killed_on == "same host" else LEASE + 3.0)
    assert seat_of(waiting) == seat_of(victim)
    assert waiting.release() == 0 and other.release() == 0
    assert_quiet(host_a.store)


@pytest.mark.slow   # the default tier's time: the slow tier (CI) runs it
def test_a_smaller_count_evicts_nobody_and_a_new_turn_waits_until_none_holds(
        hosts, holder, run_cmd):
    """Two hold (one per host); the count set to 1 from host B: both run to their end; a new turn
    of host A waits while either holds -- after the first lets go one still holds, so host B's
    probe says busy and its run deflects -- and takes the lane only once none holds."""
    host_a, host_b = hosts
    seats(host_a, run_cmd, "2")
    on_a = hold(holder, host_a)
    on_b = hold(holder, host_b)
    assert "new turns wait until fewer hold" in seats(host_b, run_cmd, "1").stdout
    assert seats(host_a, run_cmd).stdout == "1\n"
    waiting = hold(holder, host_a, "--wait", "60", ready=False)
    wait_for(lambda: queued(host_a.store, waiting.pid), "the new turn queued")
    assert on_a.release() == 0   # ran to its end: nobody was evicted
    probe = host_b.lanelock(run_cmd, "probe", "-b", ENGINE, "--store", host_b.store)
    assert probe.returncode == 1, probe
    assert run(host_b, run_cmd, "--", "true").returncode == 75
    assert waiting.proc.poll() is None and queued(host_a.store, waiting.pid)
    assert on_b.release() == 0
    waiting.wait_ready()
    released = [event["ts"] for event in events(host_a.store) if event["event"] == "released"]
    acquired = [event["ts"] for event in events(host_a.store)
                if event["event"] == "acquired" and event["pid"] == waiting.pid]
    assert acquired and acquired[0] >= max(released)
    assert waiting.release() == 0
    assert_quiet(host_a.store)


@pytest.mark.slow
def test_a_host_s_head_takes_a_free_seat_while_its_other_waiters_wait(hosts, holder, procs,
                                                                      run_cmd, tmp_path):
    """Host B holds one of two seats; four turns of host A arrive at once with --wait (one server
    connection for A's waiters: its queue's head). One of A's runs beside B's holder at once,
    the others one after another on that seat: never more than two at once, all four served,
    none ungated."""
    host_a, host_b = hosts
    seats(host_a, run_cmd, "2")
    on_b = hold(holder, host_b)
    stamps = tmp_path / "stamps"
    stamps.touch()
    turns = [procs.start([*host_a.prefix, *LANELOCK, "run", "--wait", "60", "-s", f"a{index}",
                          "-b", ENGINE, "--store", host_a.store, "--",
                          "sh", "-c", STAMP, "sh", str(stamps)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for index in range(4)]
    for turn in turns:
        assert turn.wait(TIMEOUT) == 0
        said = turn.stderr.read()
        assert "ungated" not in said and "Traceback" not in said, said
    assert on_b.release() == 0
    served = sorted(tuple(map(int, line.split())) for line in stamps.read_text().splitlines())
    assert len(served) == 4
    assert {seat for _, _, seat in served} == {3 - seat_of(on_b)}   # the seat B's turn left free
    assert all(later[0] >= earlier[1] for earlier, later in zip(served, served[1:]))
    assert_quiet(host_a.store)


@pytest.mark.slow   # the default tier's time: the slow tier (CI) runs it
def test_a_restart_gives_each_holder_its_own_seat_back_before_any_waiter(procs, holder,
                                                                       lock_roots, tmp_path):
    """Seats 2, both held, a waiter queued; the server restarts (a fast shutdown). Each holder
    takes its own seat back (its seat's row is its claim) and says so; the waiter, connected
    again, runs only once a holder lets go, on the seat freed."""
    if pg_server.binaries() is None:
        pytest.skip("no PostgreSQL server")
    server = pg_server.Server()
    lock_roots.after(server.stop)
    server.start()
    store = lock_roots.watch_store(server.dsn)
    lane = ["-b", "localhost:7038", "--store", store]
    done = subprocess.run([*LANELOCK, "seats", *lane, "2"], capture_output=True, text=True,
                          timeout=TIMEOUT)
    assert done.returncode == 0, done
    first = holder(*lane, command=SEATED, stderr=subprocess.PIPE)
    second = holder(*lane, command=SEATED, stderr=subprocess.PIPE)
    waiting = holder(*lane, "--wait", "60", command=SEATED, ready=False,
                     env={"LANELOCK_DIR": str(tmp_path / "another-host")})
    wait_for(lambda: len(json_of(["status", "--json", *lane])["lanes"][0]["queue"]) == 1,
             "the waiter queued")

    server.restart()

    for held in (first, second):
        lines = []
        while not lines or "taken back after" not in lines[-1]:
            lines.append(read_line(held.proc.stderr))   # within TIMEOUT
        assert all("lost" in line for line in lines[:-1]), lines
    with psycopg.connect(store, autocommit=True) as conn:
        holders = conn.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
                               "AND granted AND classid = %s AND objsubid = 2",
                               (0x4C4E4C4B,)).fetchone()[0]
    assert holders == 2                     # both seats held again, by their holders
    assert waiting.proc.poll() is None      # and the waiter has not run beside them
    freed = seat_of(second)
    assert second.release() == 0
    waiting.wait_ready()
    assert seat_of(waiting) == freed
    assert waiting.release() == 0 and first.release() == 0
    assert pg_server.lanelock_errors(open(server.log_path, errors="replace").read()) == []


def test_a_session_comes_back_to_its_own_seat_on_the_store(postgres, lock_roots, run_cmd):
    """Seats 2 on one store: session x takes a seat; session y, the other (the least recently
    held: never held); x again its own, then y its own -- each seat's row says whose it was."""
    store = lock_roots.watch_store(postgres.dsn)
    lane = ["-b", "localhost:7039", "--store", store]
    assert run_cmd([*LANELOCK, "seats", *lane, "2"]).returncode == 0

    def seat(session: str) -> int:
        done = run_cmd([*LANELOCK, "run", *lane, "-s", session, "--", "sh", "-c",
                        'echo "$LANELOCK_SEAT"'])
        assert done.returncode == 0, done
        return int(done.stdout)

    x, y = seat("x"), seat("y")
    assert {x, y} == {1, 2}
    assert [seat("x"), seat("y"), seat("y"), seat("x")] == [x, y, y, x]


@pytest.mark.slow   # ten turns on the store (about 7 s); the flock store's twin is in the default tier
def test_after_kill_9_of_seat_one_s_holder_sessions_rotate_over_both_seats_again_on_the_store(
        postgres, lock_roots, run_cmd, holder):
    """As on the flock store: sessions take turns one after another on a lane of two seats and
    seat 1's holder (session q1) is killed -9 mid-turn. Its row was never released, and the
    server no longer holds its seat: it counts as released when it died -- q1 comes back to it,
    and three sessions taking turns rotate over both seats, each back on its own."""
    store = lock_roots.watch_store(postgres.dsn)
    lane = ["-b", "localhost:7041", "--store", store]
    assert run_cmd([*LANELOCK, "seats", *lane, "2"]).returncode == 0

    def turn(session: str) -> int:
        held = holder(*lane, "--session", session, command=SEATED)
        seat = seat_of(held)
        assert held.release() == 0
        return seat

    assert [turn("q1"), turn("q2")] == [1, 2]
    killed = holder(*lane, "--session", "q1", command=SEATED)
    assert seat_of(killed) == 1
    gone, command_gone = ExitWatch(killed.pid), ExitWatch(killed.child_pid)
    os.killpg(killed.pid, signal.SIGKILL)
    gone.wait()
    command_gone.wait()
    assert turn("q2") == 2   # its own seat
    assert turn("q1") == 1   # its own, though its last turn there never released
    taken = [turn(session) for _ in range(2) for session in ("q1", "q2", "q3")]
    assert taken.count(1) >= 2 and taken.count(2) >= 2, taken
