"""Seats: a lane of N holds up to N turns at once, each on a seat the kernel frees with its holder.

Real processes throughout: the count is set with `lanelock seats` (never by writing kept.json),
turns are `lanelock run` and API turns in processes of their own. Views of seats (status,
history, metrics, the deflection's words) are tests/test_seat_views.py's.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys

import pytest

from support.cli import LANE, LANELOCK, STEM, TIMEOUT
from support.kernel_locks import is_queued, is_waiting
from support.processes import ExitWatch, read_line, wait_for
from support.roots import remove_lane_files

# A held command that says its seat: "ready PID SEAT", then holds until told its exit status.
SEATED = ["sh", "-c", 'echo "ready $$ $LANELOCK_SEAT"; read code; exit "${code:-0}"']


def seat_of(held) -> int:
    return int(held.ready_line.split()[2])


def set_seats(lanelock, count, *args, env=None):
    done = lanelock("seats", *args, str(count), env=env)
    assert done.returncode == 0, done.stderr
    return done


def test_seats_is_printed_set_and_refused_in_one_line(lanelock):
    assert lanelock("seats").stdout == "1\n"
    done = set_seats(lanelock, 2)
    assert done.stdout == f"{LANE}: 2 seats (was 1)\n"
    assert lanelock("seats").stdout == "2\n"
    assert json.loads(lanelock("seats", "--json").stdout) == {"lane": LANE, "seats": 2}
    for bad in ("0", "-1", "abc", "1.5", "257", "", "２", "+2", "9" * 100_000):
        refused = lanelock("seats", "--", bad)
        assert refused.returncode == 2, bad
        assert refused.stderr.count("\n") == 1 and refused.stderr.startswith("lanelock: ")
        assert len(refused.stderr) < 300
        assert "Traceback" not in refused.stderr
    assert lanelock("seats").stdout == "2\n"   # a bad count changed nothing
    smaller = set_seats(lanelock, 1)
    assert "(was 2)" in smaller.stdout and "new turns wait until fewer hold" in smaller.stdout
    remote = lanelock("seats", "-b", "api.openai.com:443", "2")
    assert remote.returncode == 2 and "not a local lane" in remote.stderr


def test_two_turns_hold_a_lane_of_two_seats_and_a_third_deflects(lanelock, holder):
    set_seats(lanelock, 2)
    first = holder(command=SEATED)
    second = holder(command=SEATED)
    assert {seat_of(first), seat_of(second)} == {1, 2}   # both running, each on its own seat
    third = lanelock("run", "--", "echo", "ran")
    assert third.returncode == 75 and "ran" not in third.stdout
    assert "local_backend_busy" in third.stderr
    assert first.release() == 0 and second.release() == 0


def test_probe_is_free_while_a_seat_is_free(lanelock, holder):
    set_seats(lanelock, 2)
    first = holder(command=SEATED)
    assert lanelock("probe").returncode == 0
    second = holder(command=SEATED)
    assert lanelock("probe").returncode == 1
    first.release()
    assert lanelock("probe").returncode == 0
    second.release()


def test_a_waiting_turn_takes_the_first_seat_freed_in_class_order(lanelock, holder, lock_dir):
    set_seats(lanelock, 2)
    first = holder(command=SEATED)
    second = holder(command=SEATED)
    batch = holder("--wait", "--priority", "batch", command=SEATED, ready=False)
    wait_for(lambda: is_queued(lock_dir / f"{STEM}.lock", batch.pid), "the batch turn queued")
    urgent = holder("--wait", "--priority", "interactive", command=SEATED, ready=False)
    wait_for(lambda: is_queued(lock_dir / f"{STEM}.lock", urgent.pid), "the urgent turn queued")
    freed = seat_of(second)
    second.release()
    urgent.wait_ready()   # the interactive one, though it came later
    assert seat_of(urgent) == freed
    freed = seat_of(first)
    first.release()
    batch.wait_ready()
    assert seat_of(batch) == freed
    urgent.release()
    batch.release()


def test_kill_9_of_a_holder_frees_its_seat_at_once(lanelock, holder):
    set_seats(lanelock, 2)
    first = holder(command=SEATED)
    second = holder(command=SEATED)
    waiting = holder("--wait", command=SEATED, ready=False)
    gone = ExitWatch(first.pid)
    os.killpg(first.pid, signal.SIGKILL)   # the wrapper and its command: nothing of it runs
    gone.wait()
    waiting.wait_ready()
    assert seat_of(waiting) == seat_of(first)
    waiting.release()
    second.release()


def test_a_smaller_count_evicts_nobody_and_new_turns_wait_until_fewer_hold(lanelock, holder,
                                                                            lock_dir):
    set_seats(lanelock, 2)
    first = holder(command=SEATED)
    second = holder(command=SEATED)
    set_seats(lanelock, 1)
    waiting = holder("--wait", command=SEATED, ready=False)
    wait_for(lambda: is_queued(lock_dir / f"{STEM}.lock", waiting.pid), "the new turn queued")
    assert first.release() == 0   # ran to its end: nobody was evicted
    # One still holds, and the lane has one seat now: the new turn still waits.
    assert lanelock("probe").returncode == 1
    assert lanelock("run", "--", "true").returncode == 75
    assert second.release() == 0
    waiting.wait_ready()
    events = [json.loads(line) for line in (lock_dir / f"{STEM}.journal").read_text().splitlines()]
    released = [event for event in events if event["event"] == "released"]
    acquired = [event for event in events if event["event"] == "acquired"
                and event["pid"] == waiting.pid]
    assert acquired and acquired[0]["ts"] >= max(event["ts"] for event in released)
    waiting.release()
    # Once nobody holds it, the seat past the count is nobody's: the lane reads as one seat.
    lane = json.loads(lanelock("status", "--json").stdout)["lanes"][0]
    assert (lane["state"], lane["seats"], lane["by_seat"]) == ("free", 1, [])
    assert "seat 2" not in lanelock("status").stdout


API_TURN = """
import sys
from lanelock import Gate
with Gate("127.0.0.1:8080").turn(session=sys.argv[1]) as turn:
    print("ready", turn.state, turn.seat, flush=True)
    sys.stdin.readline()
"""


def test_api_turns_in_two_processes_get_two_seats(lanelock, procs):
    set_seats(lanelock, 2)
    turns = [procs.start([sys.executable, "-c", API_TURN, name], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE) for name in ("one", "two")]
    lines = [read_line(turn.stdout).split() for turn in turns]
    assert [line[1] for line in lines] == ["held", "held"]
    assert {line[2] for line in lines} == {"1", "2"}
    third = procs.start([sys.executable, "-c", API_TURN, "three"], stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE)
    assert read_line(third.stdout).split()[1:] == ["deflected", "None"]
    third.stdin.close()
    for turn in turns:
        turn.stdin.close()
        assert turn.wait(timeout=TIMEOUT) == 0


def test_a_session_comes_back_to_its_own_seat(lanelock, holder):
    set_seats(lanelock, 2)

    def turn(session):
        return holder("--session", session, command=SEATED)

    alpha = turn("alpha")
    alpha_seat = seat_of(alpha)
    alpha.release()
    beta = turn("beta")   # the seat alpha just used stays alpha's: beta takes the other
    beta_seat = seat_of(beta)
    assert beta_seat != alpha_seat
    beta.release()
    for _ in range(2):
        alpha = turn("alpha")
        assert seat_of(alpha) == alpha_seat
        beta = turn("beta")
        assert seat_of(beta) == beta_seat
        alpha.release()
        beta.release()
    # A new session takes the seat held least recently: beta released last, alpha's is older.
    gamma = turn("gamma")
    assert seat_of(gamma) == alpha_seat
    gamma.release()


def test_a_one_seat_lane_is_the_lane_it_always_was(lanelock, holder, lock_dir):
    held = holder(command=SEATED)
    assert seat_of(held) == 1
    held.release()
    assert not (lock_dir / f"{STEM}.seats").exists()
    record = json.loads((lock_dir / f"{STEM}.json").read_text())
    assert "seat" not in record and "seats" not in record
    assert not (lock_dir / "kept.json").exists()


def test_flock_1_on_the_lane_s_lock_holds_seat_one(lanelock, procs, lock_dir, holder):
    set_seats(lanelock, 2)
    lanelock("probe")   # the lock file exists
    plain = procs.start(["flock", str(lock_dir / f"{STEM}.lock"), "-c",
                         'echo ready; read line'], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert read_line(plain.stdout).strip() == "ready"
    turn = holder(command=SEATED)
    assert seat_of(turn) == 2
    assert lanelock("run", "--", "true").returncode == 75
    plain.stdin.close()
    plain.wait(timeout=TIMEOUT)
    turn.release()


def test_a_count_nobody_may_trust_is_one_seat_said_once(lanelock, holder, lock_dir):
    set_seats(lanelock, 2)
    os.chmod(lock_dir / "kept.json", 0o666)   # anyone could raise the count: not believed
    held = holder(command=SEATED)
    busy = lanelock("run", "--", "true")
    assert busy.returncode == 75
    warned = [line for line in busy.stderr.splitlines() if "kept.json" in line]
    assert len(warned) == 1 and "one seat" in warned[0]
    held.release()


def test_a_count_set_from_one_home_is_read_under_env_i_from_another(lanelock, run_cmd, holder,
                                                                    default_root, tmp_path,
                                                                    lock_roots):
    port = 20000 + os.getpid() % 20000
    backend = f"127.0.0.1:{port}"
    lock_roots.after(lambda: remove_lane_files(default_root / f"localhost-{port}.lock"))
    lock_roots.after(lambda: lanelock("seats", "-b", backend, "1"))
    homes = [tmp_path / "home-a", tmp_path / "home-b"]
    for home in homes:
        home.mkdir()
    set_seats(lanelock, 2, "-b", backend, env={"HOME": str(homes[0])})
    bare = ["env", "-i", f"HOME={homes[1]}", f"PATH={os.path.dirname(sys.executable)}:/usr/bin:/bin"]
    read = run_cmd([*bare, *LANELOCK, "seats", "-b", backend])
    assert read.returncode == 0 and read.stdout == "2\n", read.stderr
    first = holder("-b", backend, command=SEATED, env={"HOME": str(homes[0])})
    second = holder("-b", backend, command=SEATED, prefix=bare)
    assert {seat_of(first), seat_of(second)} == {1, 2}
    first.release()
    second.release()


@pytest.mark.parametrize("count", [3])
def test_the_head_of_the_queue_waits_on_every_seat_in_the_kernel(lanelock, holder, lock_dir,
                                                                count):
    set_seats(lanelock, count)
    held = [holder(command=SEATED) for _ in range(count)]
    waiting = holder("--wait", command=SEATED, ready=False)
    # Blocked in flock() on every seat's lock file at once (no polling): /proc/locks says so.
    files = [lock_dir / f"{STEM}.lock",
             *(lock_dir / f"{STEM}.seats" / f"{seat}.lock" for seat in range(2, count + 1))]
    wait_for(lambda: all(is_waiting(path, waiting.pid) for path in files),
             "the waiter blocked on every seat")
    last = held[-1]
    last.release()
    waiting.wait_ready()
    assert seat_of(waiting) == seat_of(last)
    for turn in (*held[:-1], waiting):
        turn.release()


def test_the_readme_seats_block(lanelock, procs, tmp_path):
    """Each line of README's Seats block, asserting what its comment says; `auto` against a
    stand-in llama.cpp of 3 slots in 8080's place (this machine's 8080 is nobody's to take)."""
    from support.doc_blocks import block
    from support.standin_kind import Served

    engine = Served(procs, tmp_path, "--kind", "llama.cpp", "--parallel", "3")
    lines = [line for line in block("seats-count").text.splitlines() if line.strip()]
    said = []
    for line in lines:
        command, _, comment = line.partition("#")
        words = command.split()
        assert words[0] == "lanelock"
        if words[-1] == "auto":
            words = [word.replace("127.0.0.1:8080", f"127.0.0.1:{engine.port}") for word in words]
        done = lanelock(*words[1:])
        assert done.returncode == 0, done.stderr
        said.append((done.stdout.strip().splitlines()[-1], comment.strip()))
        if words[-1] == "auto":   # what answered, said first
            assert done.stdout.startswith(f"localhost:{engine.port}: http://127.0.0.1:"
                                          f"{engine.port}/props (llama.cpp): 3 slots\n")
    assert said[0][0] == said[0][1] == "localhost:8080: 2 seats (was 1)"
    assert said[1][0] == said[1][1] == "2"
    assert said[2][0] == f"localhost:{engine.port}: 3 seats (was 1)"
    assert "slot count" in said[2][1]


def test_a_turn_handed_over_is_part_of_its_holder_s_turn_not_a_second_seat(lanelock, holder):
    """A nested `lanelock run` inside a held turn's command runs as part of that turn, whichever
    seat it holds: it takes no free seat, and deflects nobody."""
    set_seats(lanelock, 2)
    inner = (f"{' '.join(LANELOCK)} run -- sh -c "
             "'echo \"ready $$ $LANELOCK_SEAT $LANELOCK_STATE\"; read code; exit $code'")
    outer = holder(command=["sh", "-c", inner])
    assert outer.ready_line.split()[2:] == ["1", "held"]
    other = lanelock("run", "--", "sh", "-c", 'echo "$LANELOCK_SEAT"')
    assert other.returncode == 0 and other.stdout == "2\n", other.stderr   # seat 2 was free
    outer.release()
    # And from inside seat 2's holder, with seat 1 held by another turn: nested, not busy.
    first = holder(command=SEATED)
    second = holder(command=["sh", "-c", inner])
    assert second.ready_line.split()[2:] == ["2", "held"]
    first.release()
    second.release()


def test_each_waiter_s_estimate_counts_the_seat_that_frees_first(lanelock, holder, procs,
                                                                 lock_dir):
    """status's estimate (the proxy's Retry-After rule): on a lane of two seats the first two
    waiters each get a seat when a holder's typical hold ends, the third one hold later -- not
    one hold per waiter as on one seat."""
    from lanelock.estimate import until_lane

    assert lanelock("run", "--", "sleep", "2").returncode == 0   # a typical hold of ~2 s
    set_seats(lanelock, 2)
    held = [holder(command=SEATED) for _ in range(2)]
    waiters = []
    for number in range(3):
        waiter = procs.start([*LANELOCK, "run", "--wait", "--", "true"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        wait_for(lambda: is_queued(lock_dir / f"{STEM}.lock", waiter.pid), f"waiter {number}")
        waiters.append(waiter)
    lane = json.loads(lanelock("status", "--json").stdout)["lanes"][0]
    typical = lane["typical_hold"]
    assert typical >= 2
    held_for = [seat["holder"]["held_for"] for seat in lane["by_seat"]]
    estimates = [row["estimate"] for row in lane["queue"]]
    assert estimates == [until_lane(typical, held_for[0], ahead, 2, (held_for[1],))
                         for ahead in range(3)]
    # The first two each take a seat as a holder's hold ends -- the same second, or a later one
    # when the holds began apart (each rest rounds up on its own) -- the third a hold later.
    gap = math.ceil(abs(held_for[0] - held_for[1]))
    assert estimates[0] <= estimates[1] <= estimates[0] + gap
    assert estimates[1] < estimates[2] < estimates[0] + typical + 1
    for turn in held:
        turn.release()
    for waiter in waiters:
        assert waiter.wait(timeout=TIMEOUT) == 0


HOLDER_ASKS = r"""
import json, sys, urllib.error, urllib.request
from lanelock import Gate

backend, url = sys.argv[1:3]
with Gate(backend).turn(session="agent") as turn:
    request = urllib.request.Request(url, data=json.dumps({"model": "m", "messages": [
        {"role": "user", "content": "hi"}]}).encode(), headers={"Content-Type": "application/json"})
    try:
        answer = urllib.request.urlopen(request, timeout=30)
        print(json.dumps({"status": answer.status, "seat": turn.seat}))
    except urllib.error.HTTPError as error:
        print(json.dumps({"status": error.code, "seat": turn.seat,
                          "body": error.read().decode()}))
"""


def test_a_holder_asking_the_proxy_without_its_headers_is_told_on_a_lane_of_seats(lanelock,
                                                                                   procs):
    """The holder of a seat sending its own request without turn.headers is told to send them,
    as on one seat -- not given a second seat while one is free."""
    from support.engine import Engine
    from support.proxy import CHAT, Proxy

    engine = Engine(procs, delay=0.01)
    proxy = Proxy(procs, engine.backend)
    set_seats(lanelock, 2, "-b", engine.backend)
    asked = procs.start([sys.executable, "-c", HOLDER_ASKS, engine.backend, proxy.url + CHAT],
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = asked.communicate(timeout=TIMEOUT)
    report = json.loads(out.decode())
    assert report["status"] == 503 and "send turn.headers" in report["body"], (report, err)


def test_after_kill_9_of_seat_one_s_holder_sessions_rotate_over_both_seats_again(lanelock,
                                                                                  holder):
    """Sessions take turns one after another on a lane of two seats; seat 1's holder (session
    q1) is killed -9 mid-turn. Its seat counts as released when it died: q1 comes back to it,
    and three sessions taking turns rotate over both seats (before: every session went to seat
    2 until seat 1 had a clean release -- Q1:2 Q2:2 Q3:2 Q1:2 -- and seat 1's cache idled)."""
    set_seats(lanelock, 2)

    def turn(session):
        held = holder("--session", session, command=SEATED)
        seat = seat_of(held)
        held.release()
        return seat

    assert [turn("q1"), turn("q2")] == [1, 2]
    killed = holder("--session", "q1", command=SEATED)
    assert seat_of(killed) == 1
    gone, command_gone = ExitWatch(killed.pid), ExitWatch(killed.child_pid)
    os.killpg(killed.pid, signal.SIGKILL)
    gone.wait()
    command_gone.wait()   # the command's parent-death signal: nothing of the turn runs
    assert turn("q2") == 2   # its own seat
    assert turn("q1") == 1   # its own, though its last turn there never released
    taken = [turn(session) for _ in range(2) for session in ("q1", "q2", "q3")]
    assert taken.count(1) >= 2 and taken.count(2) >= 2, taken
