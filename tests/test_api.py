"""The Python API, in-process and against other real processes: `with Gate(...).turn() as turn`,
busy() that never takes the lock, release on exceptions, same-thread reentrancy, other threads
deflect or wait, fail-open, and the sidecar record."""

from __future__ import annotations

import calendar
import fcntl
import json
import os
import pwd
import re
import socket
import subprocess
import sys
import threading
import time

import pytest

from lanelock.store.flock import store as lock_store
from support.cli import STEM, TIMEOUT, needs_flock
from support.kernel_locks import is_waiting
from support.processes import wait_for
from lanelock import BUSY_WORDS, REASON_BUSY, Gate
from lanelock.lanes import BackendError

ISO_UTC = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


def epoch(stamp: str) -> float:
    return calendar.timegm(time.strptime(stamp[:19], "%Y-%m-%dT%H:%M:%S")) + int(stamp[20:23]) / 1000


def own_start_ticks() -> int:
    """Field 22 of /proc/self/stat, read here independently of lanelock."""
    with open("/proc/self/stat", "rb") as handle:
        data = handle.read()
    return int(data[data.rfind(b")") + 2:].split()[19])


def probe(lanelock) -> subprocess.CompletedProcess:
    return lanelock("probe", "--json")


def flock_free(run_cmd, path) -> bool:
    result = run_cmd(["flock", "-n", "-E", "99", path, "true"])
    assert result.returncode in (0, 99), result.stderr
    return result.returncode == 0


# -- holding a turn ----------------------------------------------------------------------------
@needs_flock
def test_a_turn_holds_the_lane_for_other_processes(lanelock, run_cmd):
    gate = Gate("127.0.0.1:8080")
    with gate.turn(session="a", model="m") as turn:
        assert turn.held and turn.state == "held"
        assert turn.reason is None and turn.nested is False
        assert turn.lane == "localhost:8080" and turn.lock_path == gate.lock_path
        seen = probe(lanelock)
        assert seen.returncode == 1, seen.stdout
        holder = json.loads(seen.stdout)["holder"]
        assert (holder["pid"], holder["session"], holder["model"]) == (os.getpid(), "a", "m")
        assert not flock_free(run_cmd, gate.lock_path)
    assert turn.state == "released" and not turn.held
    assert probe(lanelock).returncode == 0
    assert flock_free(run_cmd, gate.lock_path)


def test_explicit_acquire_and_release_are_idempotent(lanelock):
    turn = Gate("127.0.0.1:8080").turn()
    assert turn.acquire().held
    turn.release(5)
    turn.release(6)   # a second release changes nothing
    assert probe(lanelock).returncode == 0
    assert json.loads(open(turn.gate.sidecar_path).read())["exit_status"] == 5


def test_the_backend_and_model_come_from_the_environment(monkeypatch, lock_dir):
    monkeypatch.setenv("LANELOCK_BACKEND", "http://[::1]:9090/v1")
    monkeypatch.setenv("LANELOCK_MODEL", "qwen")
    gate = Gate()
    assert gate.lane.name == "localhost:9090" and gate.model == "qwen"
    assert gate.lock_path == str(lock_dir / "localhost-9090.lock")


def test_a_malformed_backend_raises_backend_error():
    with pytest.raises(BackendError):
        Gate("host:")


def test_a_public_backend_is_ungated_and_touches_nothing(lock_dir):
    gate = Gate("api.openai.com:443")
    with gate.turn() as turn:
        assert turn.state == "ungated" and not turn.held
    assert gate.busy() is False
    assert not lock_dir.exists()


def test_a_child_of_the_holding_process_is_nested_only_when_handed_the_turn(lanelock):
    """A command the holder runs is part of its turn when given turn.env (`lanelock run`
    straight through, held); without it, it is another session (test_handover.py has the rest)."""
    with Gate("127.0.0.1:8080").turn() as turn:
        result = lanelock("run", "--", "printenv", "LANELOCK_STATE", env=turn.env)
        assert (result.returncode, result.stdout.strip()) == (0, "held"), result.stderr
        alone = lanelock("run", "--", "printenv", "LANELOCK_STATE")
        assert (alone.returncode, alone.stdout.strip()) == (75, ""), alone.stderr


# -- busy() ------------------------------------------------------------------------------------
def test_busy_is_false_when_free_and_creates_nothing(lock_dir):
    gate = Gate("127.0.0.1:8080")
    assert gate.busy() is False
    assert not lock_dir.exists()
    with gate.turn():
        pass
    assert gate.busy() is False


def test_busy_is_true_while_held_here_and_by_another_process(holder):
    gate = Gate("127.0.0.1:8080")
    with gate.turn():
        assert gate.busy() is True
        assert Gate("localhost:8080").busy() is True
    assert gate.busy() is False
    held = holder()
    assert gate.busy() is True
    assert held.release() == 0
    assert gate.busy() is False


def test_busy_never_calls_flock(monkeypatch, holder):
    """A spy, not a mock: every flock() still happens for real; busy() must make none."""
    calls = []
    real_flock = fcntl.flock

    def spy(fd, operation):
        calls.append(operation)
        return real_flock(fd, operation)

    monkeypatch.setattr(lock_store.fcntl, "flock", spy)
    gate = Gate("127.0.0.1:8080")
    with gate.turn():
        calls.clear()
        assert gate.busy() is True and calls == []
    held = holder()
    calls.clear()
    assert gate.busy() is True and calls == []
    assert held.release() == 0
    calls.clear()
    assert gate.busy() is False and calls == []
    gate.probe()
    assert calls, "sanity: the spy sees the flock() calls a probe makes"


def test_busy_racing_with_turns_never_makes_a_turn_deflect(procs, lanelock):
    """Turns with no grace at all deflect on any contention; busy() beside them must cause none."""
    assert lanelock("run", "--", "true").returncode == 0   # the lock file exists from here on
    gate = Gate("127.0.0.1:8080")
    turns = procs.start(
        ["sh", "-c", f'for i in $(seq 15); do {sys.executable} -m lanelock run --grace 0 -- true '
         '|| echo "turn $i exit $?"; done'],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    checks = 0
    while turns.poll() is None:
        gate.busy()
        checks += 1
    out, err = turns.communicate(timeout=TIMEOUT)
    assert (turns.returncode, out) == (0, ""), out
    assert "local_backend_busy" not in err
    assert checks > 15


# -- exceptions, nesting, threads --------------------------------------------------------------
def test_an_exception_inside_the_turn_releases_the_lane(lanelock):
    gate = Gate("127.0.0.1:8080")
    with pytest.raises(RuntimeError, match="generation failed"):
        with gate.turn(session="boom") as turn:
            assert turn.held
            raise RuntimeError("generation failed")
    assert probe(lanelock).returncode == 0
    record = json.loads(open(gate.sidecar_path).read())
    assert "released_at" in record and record["exit_status"] is None


def test_a_nested_turn_in_the_same_thread_is_reentrant(lanelock):
    gate = Gate("127.0.0.1:8080")
    with gate.turn(session="outer") as outer:
        with Gate("localhost:8080").turn(session="inner") as inner:
            assert inner.held and inner.nested
            assert outer.held and not outer.nested
        assert probe(lanelock).returncode == 1, "leaving the inner turn released the outer one"
        with gate.turn() as again:
            assert again.held and again.nested
    assert probe(lanelock).returncode == 0


def test_another_thread_deflects_while_held(lanelock):
    gate = Gate("127.0.0.1:8080")
    seen = {}

    def contender():
        turn = Gate("127.0.0.1:8080").turn(session="thread", wait=0.1)
        with turn:
            seen.update(state=turn.state, reason=turn.reason, holder=turn.holder, held=turn.held)

    with gate.turn(session="main", model="m"):
        worker = threading.Thread(target=contender)
        worker.start()
        worker.join(TIMEOUT)
        assert not worker.is_alive()
    assert seen["state"] == "deflected" and seen["held"] is False
    assert seen["reason"] == REASON_BUSY == "local_backend_busy"
    assert seen["holder"]["pid"] == os.getpid() and seen["holder"]["session"] == "main"
    assert BUSY_WORDS == "local model in use by another session"
    assert probe(lanelock).returncode == 0


def test_a_waiting_thread_gets_the_lane_when_the_main_thread_releases(lanelock):
    gate = Gate("127.0.0.1:8080")
    got = threading.Event()
    go_on = threading.Event()
    seen = {}

    def waiter():
        with Gate("127.0.0.1:8080").turn(session="waiter", wait=30) as turn:
            seen["state"] = turn.state
            got.set()
            go_on.wait(TIMEOUT)

    outer = gate.turn(session="main").acquire()
    worker = threading.Thread(target=waiter)
    worker.start()
    try:
        wait_for(lambda: is_waiting(gate.lock_path, os.getpid()) or not worker.is_alive(),
                 what="the thread to block in flock()")
        assert not got.is_set()
    finally:
        outer.release(0)
    assert got.wait(TIMEOUT) and seen["state"] == "held"
    seen_by_others = probe(lanelock)
    go_on.set()
    worker.join(TIMEOUT)
    assert seen_by_others.returncode == 1
    assert json.loads(seen_by_others.stdout)["holder"]["session"] == "waiter"
    assert probe(lanelock).returncode == 0


def test_the_main_thread_waits_in_the_kernel_for_another_process(holder, lock_dir):
    held = holder()
    lock = lock_dir / "localhost-8080.lock"

    def release_when_waited_for():
        wait_for(lambda: is_waiting(lock, os.getpid()), what="the main thread to block in flock()")
        held.release()

    releaser = threading.Thread(target=release_when_waited_for)
    releaser.start()
    try:
        with Gate("127.0.0.1:8080").turn(wait=30) as turn:
            assert turn.held
    finally:
        releaser.join(TIMEOUT)
    assert held.returncode == 0


def test_a_turn_deflects_from_another_process_with_its_holder(holder):
    held = holder("--session", "elsewhere")
    with Gate("127.0.0.1:8080").turn(wait=0.1) as turn:
        assert turn.state == "deflected" and not turn.held and turn.reason == REASON_BUSY
        assert turn.holder["pid"] == held.pid and turn.holder["session"] == "elsewhere"
    assert held.release() == 0


# -- fail open ---------------------------------------------------------------------------------
def test_fail_open_gives_one_warning_and_no_lock(tmp_path):
    (tmp_path / "file").write_text("x")
    warnings = []
    gate = Gate("127.0.0.1:8080", lock_dir=str(tmp_path / "file" / "sub"), warn=warnings.append)
    with gate.turn() as turn:
        assert turn.state == "fail-open" and not turn.held and turn.reason
    assert len(warnings) == 1 and warnings[0].startswith("gate unavailable (")
    assert gate.busy() is False


def test_a_sidecar_that_cannot_be_written_is_only_a_warning(lock_dir, tmp_path, lanelock):
    lock_dir.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    os.symlink(victim, lock_dir / "localhost-8080.json")
    warnings = []
    with Gate("127.0.0.1:8080", warn=warnings.append).turn() as turn:
        assert turn.held
        assert probe(lanelock).returncode == 1
    assert warnings and all("holder record" in warning for warning in warnings)
    assert victim.read_text() == "precious\n"


# -- the sidecar -------------------------------------------------------------------------------
def test_the_sidecar_record_while_held_and_after_release(lanelock):
    gate = Gate("127.0.0.1:8080")
    before = time.time()
    with gate.turn(session="a", model="m", argv=["llm", "-m", "m", "hello world"]):
        record = json.loads(open(gate.sidecar_path).read())
    after = time.time()
    assert record["schema"] == 1
    assert record["lane"] == "localhost:8080" and record["backend"] == "127.0.0.1:8080"
    assert record["pid"] == os.getpid() and record["start_ticks"] == own_start_ticks()
    assert (record["session"], record["model"]) == ("a", "m")
    assert record["argv"] == ["llm", "-m", "m", "hello world"]
    assert record["user"] == pwd.getpwuid(os.getuid()).pw_name
    assert record["hostname"] == socket.gethostname()
    assert ISO_UTC.match(record["acquired_at"]), record["acquired_at"]
    assert before - 1 <= epoch(record["acquired_at"]) <= after + 1
    assert "released_at" not in record and "exit_status" not in record

    done = json.loads(open(gate.sidecar_path).read())
    assert ISO_UTC.match(done["released_at"])
    assert epoch(done["acquired_at"]) <= epoch(done["released_at"]) <= after + 1
    assert done["exit_status"] == 0
    for key in ("schema", "lane", "pid", "start_ticks", "session", "model", "argv", "user",
                "hostname", "acquired_at"):
        assert done[key] == record[key], key


def test_the_sidecar_of_a_cli_turn(lanelock, lock_dir):
    result = lanelock("run", "-s", "cli-session", "-m", "qwen", "--", "sh", "-c", "exit 4")
    assert result.returncode == 4
    gate = Gate("127.0.0.1:8080")
    record = json.loads(open(gate.sidecar_path).read())
    assert record["argv"] == ["sh", "-c", "exit 4"]
    assert (record["session"], record["model"], record["exit_status"]) == ("cli-session", "qwen", 4)
    assert isinstance(record["pid"], int) and record["pid"] != os.getpid()
    assert isinstance(record["start_ticks"], int)
    assert gate.sidecar_path == str(lock_dir / "localhost-8080.json")
    mode = os.stat(gate.sidecar_path).st_mode & 0o777
    assert mode == 0o666   # every user of the lane records its turns here
    assert not [name for name in os.listdir(lock_dir) if name.endswith(".tmp")]


def test_a_turn_is_on_the_same_lock_as_the_cli(holder):
    held = holder()
    assert Gate("[::1]:8080").busy() is True
    with Gate("http://localhost:8080/v1").turn(wait=0) as turn:
        assert turn.state == "deflected"
    assert held.release() == 0


def test_a_broken_config_fails_open_with_one_warning(monkeypatch, tmp_path, lock_dir):
    config = tmp_path / "config.toml"
    config.write_text("grace = = 0.1\n")   # a file that does not parse: nothing in it is known
    monkeypatch.setenv("LANELOCK_CONFIG", str(config))
    warnings = []
    with Gate("127.0.0.1:8080", warn=warnings.append).turn() as turn:
        assert turn.state == "fail-open" and str(config) in turn.reason
    assert len(warnings) == 1 and warnings[0].startswith("gate unavailable (")
    assert not (lock_dir / "localhost-8080.lock").exists()


# -- the API's arguments are checked at the call ---------------------------------
# Gate(8080) raised an AttributeError from deep inside; turn(wait="5") passed until the lane was
# busy and then failed in the wait; wait=-1 was taken. Each is a TypeError or ValueError at once.
LANE_SPELLING = "127.0.0.1:8080"
BAD_CALLS = [
    (lambda: Gate(8080), TypeError, "backend must be a string such as '127.0.0.1:8080', not int 8080"),
    (lambda: Gate(LANE_SPELLING).turn(wait="5"), TypeError,
     "wait must be a number of seconds, not str '5'"),
    (lambda: Gate(LANE_SPELLING).turn(wait=-1), ValueError,
     "wait must be a number of seconds, 0 or more, not -1"),
    (lambda: Gate(LANE_SPELLING).turn(wait=float("nan")), ValueError, "not nan"),
    (lambda: Gate(LANE_SPELLING).turn(wait=True), TypeError, "not bool True"),
    (lambda: Gate(LANE_SPELLING).turn(priority="urgent"), ValueError,
     "priority must be one of batch, normal, interactive, not 'urgent'"),
    (lambda: Gate(LANE_SPELLING).turn(session=7), TypeError, "session must be a string"),
    (lambda: Gate(LANE_SPELLING, grace="0.1"), TypeError, "grace must be a number of seconds"),
    (lambda: Gate(LANE_SPELLING, grace=float("inf")), ValueError, "grace must be a number"),
    (lambda: Gate(LANE_SPELLING, priority="urgent"), ValueError, "priority must be one of"),
    (lambda: Gate(LANE_SPELLING, priority=2), TypeError, "priority must be a string"),
    (lambda: Gate(LANE_SPELLING, key_by="host"), ValueError, "key_by must be 'backend' or 'model'"),
    (lambda: Gate(LANE_SPELLING, gate="yes"), TypeError, "gate must be True, False or None"),
    (lambda: Gate(LANE_SPELLING, lock_dir=3), TypeError, "lock_dir must be a path"),
]


@pytest.mark.parametrize("call, error, words", BAD_CALLS, ids=range(len(BAD_CALLS)))
def test_bad_api_arguments_fail_at_the_call(call, error, words, holder):
    holder()   # a busy lane: a bad wait must not get as far as waiting for it
    with pytest.raises(error) as raised:
        call()
    assert words in str(raised.value)


def test_a_gates_priority_is_its_turns_class_unless_the_turn_says(lanelock, tmp_path):
    """Gate(..., priority=) exists as turn(priority=) does; it also accepts a Path lock_dir."""
    gate = Gate(LANE_SPELLING, priority="Batch", lock_dir=tmp_path / "lanes")
    with gate.turn(session="from-gate") as turn:
        assert turn.held and turn.priority == "batch"
    with gate.turn(session="from-turn", priority="interactive") as turn:
        assert turn.held and turn.priority == "interactive"
    with gate.turn(session="forever", wait=float("inf")) as turn:   # inf: as long as it takes
        assert turn.held
    done = lanelock("history", "--json", "--lock-dir", tmp_path / "lanes")
    said = {event["session"]: event["priority"] for event in json.loads(done.stdout)["events"]
            if event["event"] == "acquired"}
    assert said == {"from-gate": "batch", "from-turn": "interactive", "forever": "batch"}, said


def test_a_turns_steps_are_the_asyncio_drivers_not_public_api():
    """Take/commit/prepare/conclude (and abandon, own_by, cancel_wait) were public
    names for what only asyncturn.py calls; a caller takes a turn with `with`, `async with`, or
    acquire() and release()."""
    from lanelock.gate import Turn

    public = {name for name in dir(Turn) if not name.startswith("_")}
    assert not public & {"take", "commit", "prepare", "conclude", "own_by", "cancel_wait"}
    assert {"acquire", "release", "held", "env", "headers", "lane", "lock_path"} <= public


def test_a_turn_given_up_in_a_thread_leaves_no_kernel_wait(holder, lock_dir, procs):
    """A turn that stops waiting calls its kernel wait off (store/flock/
    interrupt.py: a signal to the waiter thread). The signal's handler can be installed only
    from the main thread: a program whose turns wait only in threads it started (a worker pool)
    kept the abandoned wait until the holder let go, a phantom waiter in /proc/locks. The gate,
    built on the main thread, installs it."""
    script = """
import sys, threading
from lanelock import Gate
gate = Gate("127.0.0.1:8080")
seen = []
worker = threading.Thread(target=lambda: seen.append(gate.turn(session="pool", wait=0.2)
                                                     .acquire().state))
worker.start()
worker.join()
print(seen[0], flush=True)
sys.stdin.readline()
"""
    held = holder()
    asker = procs.start([sys.executable, "-c", script], stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE, text=True)
    assert asker.stdout.readline().strip() == "deflected"
    assert not is_waiting(lock_dir / f"{STEM}.lock", asker.pid)
    asker.stdin.write("\n")
    asker.stdin.flush()
    assert asker.wait(TIMEOUT) == 0
    assert held.release() == 0
