"""`lanelock status`: the kernel's truth about a lane, cross-checked with the sidecar, with real
processes (lanelock turns, a plain flock(1), a kill -9, a reused pid) and hostile sidecars.

Synchronisation is never a sleep: a holder's child prints "ready PID" on a pipe and holds until the
test writes its exit status to its stdin; where no process can tell us (a flock(1) holder, a waiter
blocked in the kernel), /proc/locks itself is polled with a deadline.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import random
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.cli import LANE, LANELOCK, STEM, TIMEOUT
from support.holding import HOLD_SCRIPT
from support.kernel_locks import is_queued
from support.processes import ExitWatch, read_line, wait_exit, wait_for
from lanelock import locks, proc

ESCAPE = "\x1b"


def kernel(lock_path) -> locks.KernelView:
    view = locks.kernel_view(os.stat(lock_path))
    assert view is not None, "/proc/locks is unreadable here"
    return view


def status_json(lanelock, *args) -> list[dict]:
    done = lanelock("status", "--json", *args, timeout=30)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    return json.loads(done.stdout)["lanes"]


def one_lane(lanelock, *args) -> dict:
    lanes = status_json(lanelock, *args)
    assert len(lanes) == 1, lanes
    return lanes[0]


def status_line(lanelock, *args, env=None) -> str:
    """The piped human view: exactly one plain line for the lane."""
    done = lanelock("status", *args, env=env, timeout=30)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    assert ESCAPE not in done.stdout
    lines = done.stdout.splitlines()
    assert len(lines) == 1 and done.stdout.endswith("\n"), done.stdout
    assert lines[0].startswith(f"{LANE}: "), lines
    return lines[0]


def status_lines(lanelock, *args) -> list[str]:
    """The piped human view of one lane: its line, then one indented line per waiter."""
    done = lanelock("status", *args, timeout=30)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert ESCAPE not in done.stdout
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"{LANE}: ") and all(line.startswith("  ") for line in lines[1:])
    return lines


def one_turn(lanelock, lock_dir: Path) -> subprocess.CompletedProcess:
    """One finished turn: the lock file, a released sidecar and two journal lines exist."""
    done = lanelock("run", "--", "true")
    assert done.returncode == 0 and (lock_dir / f"{STEM}.lock").is_file(), done.stderr
    return done


def sidecar_path(lock_dir: Path) -> Path:
    return lock_dir / f"{STEM}.json"


# -- held, foreign, died, released -------------------------------------------------------------------
def test_held_by_a_lanelock_turn_names_the_wrapper_and_the_sidecar_labels(lanelock, holder, lock_dir):
    held = holder("--session", "night-shift", "--model", "qwen-7b")
    lane = one_lane(lanelock)
    assert (lane["state"], lane["verdict"]) == ("held", "held")
    assert [h["pid"] for h in lane["holders"]] == [held.pid]
    assert lane["holders"][0]["lanelock"] is True
    assert lane["holder"]["pid"] == held.pid
    assert lane["holder"]["session"] == "night-shift"
    assert lane["holder"]["model"] == "qwen-7b"
    assert lane["holder"]["command"] == shlex.join(["sh", "-c", HOLD_SCRIPT])   # quoted, pasteable
    assert isinstance(lane["holder"]["held_for"], (int, float)) and lane["holder"]["held_for"] >= 0
    assert lane["waiters"] == [] and lane["kernel_source"] == "proc-locks"
    assert lane["lock_path"] == str(lock_dir / f"{STEM}.lock")

    line = status_line(lanelock)
    assert f"held by lanelock turn pid {held.pid}" in line
    assert "session night-shift" in line and "model qwen-7b" in line
    assert held.release() == 0


def test_held_by_plain_flock_is_reported_as_not_lanelock(lanelock, procs, lock_dir):
    one_turn(lanelock, lock_dir)
    lock = lock_dir / f"{STEM}.lock"
    flock = procs.start(["flock", lock, "sh", "-c", HOLD_SCRIPT], stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE)
    assert read_line(flock.stdout).startswith("ready ")   # flock(1) holds it while its child runs
    command = shlex.join(["flock", str(lock), "sh", "-c", HOLD_SCRIPT])

    lane = one_lane(lanelock)
    assert (lane["state"], lane["verdict"]) == ("held", "held-foreign")
    first = lane["holders"][0]
    assert first["pid"] == flock.pid and first["lanelock"] is False
    assert first["command"] == command
    assert lane["holder"] is None
    line = status_line(lanelock)
    assert "not lanelock" in line and f"pid {flock.pid}" in line and f"flock {lock} sh -c" in line

    flock.stdin.close()
    assert flock.wait(timeout=TIMEOUT) == 0


def test_holder_killed_with_sigkill_died_without_releasing(lanelock, holder, lock_dir):
    held = holder()
    child = ExitWatch(held.child_pid)
    os.kill(held.pid, signal.SIGKILL)
    assert held.proc.wait(timeout=TIMEOUT) == -signal.SIGKILL
    child.wait()   # the parent-death signal: nothing is left holding or generating
    assert kernel(lock_dir / f"{STEM}.lock").holders == ()

    lane = one_lane(lanelock)
    assert (lane["state"], lane["verdict"]) == ("free", "died")
    assert lane["last"]["pid"] == held.pid
    line = status_line(lanelock)
    assert "died without releasing" in line and f"pid {held.pid}" in line
    assert lanelock("run", "--", "true").returncode == 0   # the lane is usable again


def test_killed_holder_not_yet_reaped_still_died(lanelock, holder, lock_dir):
    held = holder()
    os.kill(held.pid, signal.SIGKILL)   # not reaped: the test (its parent) waits only afterwards
    wait_exit(held.pid)
    assert _state(held.pid) == "Z"
    assert kernel(lock_dir / f"{STEM}.lock").holders == ()
    try:
        lane = one_lane(lanelock)
        assert lane["verdict"] == "died", lane["message"]
    finally:
        held.proc.wait(timeout=TIMEOUT)


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            data = handle.read()
    except OSError:
        return None
    return data[data.rfind(b")") + 2:].split()[0].decode()


def test_released_cleanly_reports_the_exit_status(lanelock, holder):
    held = holder("--session", "tidy")
    assert held.release(3) == 3
    lane = one_lane(lanelock)
    assert (lane["state"], lane["verdict"]) == ("free", "released")
    last = lane["last"]
    assert last["pid"] == held.pid and last["exit_status"] == 3 and last["session"] == "tidy"
    assert isinstance(last["held_seconds"], (int, float)) and last["held_seconds"] >= 0
    assert isinstance(last["released_at"], str) and last["released_at"]
    assert lane["holders"] == [] and lane["holder"] is None
    line = status_line(lanelock)
    assert "released cleanly" in line and "exit 3" in line and f"pid {held.pid}" in line


def test_a_lane_no_turn_has_used(lanelock, lock_dir):
    lane = one_lane(lanelock)
    assert (lane["state"], lane["verdict"], lane["exists"]) == ("free", "never-used", False)
    assert "no turn" in status_line(lanelock)
    assert not lock_dir.exists()   # status creates nothing


# -- stale sidecars: pid reuse, another lane, the future, a previous boot ---------------------------
def _unreleased(record: dict) -> dict:
    for key in ("released_at", "exit_status", "held_seconds"):
        record.pop(key, None)
    return record


def _edit_sidecar(lock_dir: Path, change) -> None:
    path = sidecar_path(lock_dir)
    record = _unreleased(json.loads(path.read_text()))
    change(record)
    path.write_text(json.dumps(record))


@pytest.mark.parametrize("whose", ["the test itself", "a sleep the test started"])
def test_a_live_pid_with_another_start_time_is_pid_reuse(lanelock, procs, lock_dir, whose):
    one_turn(lanelock, lock_dir)
    if whose == "the test itself":
        pid = os.getpid()
    else:
        pid = procs.start(["sleep", "60"]).pid
    ticks = proc.start_ticks(pid)
    assert ticks is not None

    def reuse(record):
        record.update(pid=pid, start_ticks=ticks + 12345)

    _edit_sidecar(lock_dir, reuse)
    lane = one_lane(lanelock)
    assert (lane["state"], lane["verdict"]) == ("free", "sidecar-stale")
    assert "reused" in lane["message"] and str(pid) in lane["message"]
    assert "reused" in status_line(lanelock)


def test_the_same_pid_and_start_time_alive_is_not_pid_reuse(lanelock, procs, lock_dir):
    """The control for the test above: the true start time of a live pid is no reuse (and that
    process does not hold the lock, so the turn is letting go, not stale)."""
    one_turn(lanelock, lock_dir)
    pid = procs.start(["sleep", "60"]).pid
    _edit_sidecar(lock_dir, lambda record: record.update(pid=pid, start_ticks=proc.start_ticks(pid)))
    lane = one_lane(lanelock)
    assert lane["verdict"] == "releasing" and "reused" not in lane["message"]


@pytest.mark.parametrize("change, words", [
    (lambda record: record.update(lane="localhost:9999"), "another lane"),
    (lambda record: record.update(acquired_at="2999-01-01T00:00:00.000Z"), "future"),
    (lambda record: record.update(boot_id="00000000-0000-4000-8000-000000000000"), "previous boot"),
], ids=["another-lane", "future", "previous-boot"])
def test_a_stale_sidecar_is_reported_in_plain_words(lanelock, lock_dir, change, words):
    one_turn(lanelock, lock_dir)
    _edit_sidecar(lock_dir, change)
    lane = one_lane(lanelock)
    assert (lane["state"], lane["verdict"]) == ("free", "sidecar-stale")
    assert words in lane["message"]
    assert words in status_line(lanelock)


def test_a_stale_sidecar_while_held_trusts_the_kernel(lanelock, holder, lock_dir):
    held = holder()
    ticks = proc.start_ticks(held.pid)
    _edit_sidecar(lock_dir, lambda record: record.update(start_ticks=ticks + 1))
    lane = one_lane(lanelock)
    assert (lane["state"], lane["verdict"]) == ("held", "held-unlabelled")
    assert lane["holders"][0]["pid"] == held.pid and lane["holders"][0]["lanelock"] is True
    assert lane["holder"] is None and "reused" in lane["message"]
    assert held.release() == 0


# -- waiters -----------------------------------------------------------------------------------------
def test_a_waiting_turn_is_shown_as_a_waiter(lanelock, holder, procs, lock_dir):
    held = holder()
    waiter = procs.start([*LANELOCK, "run", "--wait", "--", "true"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    lock = lock_dir / f"{STEM}.lock"
    wait_for(lambda: waiter.pid in kernel(lock).waiters, "the --wait turn to block in flock()")

    lane = one_lane(lanelock)
    assert lane["verdict"] == "held" and lane["holders"][0]["pid"] == held.pid
    assert [w["pid"] for w in lane["waiters"]] == [waiter.pid]
    assert lane["waiters"][0]["lanelock"] is True
    lines = status_lines(lanelock)   # the lane's line, then one line per waiter
    assert lines[0].endswith(" [1 waiting]; engine: nothing answers on 127.0.0.1:8080"), lines
    assert re.fullmatch(rf"  1\. normal pid {waiter.pid} \(session [^)]+\), waited \d+\.\ds, no "
                        r"estimate of the lane \(no hold in the last hour to go by\)", lines[1]), \
        lines

    assert held.release() == 0
    out, err = waiter.communicate(timeout=TIMEOUT)
    assert waiter.returncode == 0, err
    assert one_lane(lanelock)["waiters"] == []


# -- status never takes the lock ---------------------------------------------------------------------
def test_status_in_a_tight_loop_never_makes_a_turn_deflect(lanelock, procs, lock_dir, tmp_path):
    """30 sequential turns with no grace (any momentary lock by anyone else deflects them) beside
    status runs for as long as the turns go on."""
    turns = 30
    loop = procs.start(["sh", "-c", 'for i in $(seq "$1"); do "$0" -m lanelock run --grace 0 -- true; '
                        'echo "rc $?"; done', sys.executable, str(turns)],
                       stdout=subprocess.PIPE, stderr=open(tmp_path / "turns.stderr", "wb"))
    runs = 0
    while loop.poll() is None or runs == 0:
        arguments = ("--json",) if runs % 3 == 0 else ("--all",) if runs % 3 == 1 else ()
        done = lanelock("status", *arguments, timeout=30)
        assert done.returncode == 0, done.stderr
        runs += 1
    out = loop.stdout.read().decode()
    loop.wait(timeout=TIMEOUT)
    stderr = (tmp_path / "turns.stderr").read_text()
    assert out.split("\n")[:-1] == ["rc 0"] * turns, (out, stderr)
    assert "local_backend_busy" not in stderr
    events = [json.loads(line)["event"] for line in (lock_dir / f"{STEM}.journal").read_text().splitlines()]
    assert events.count("acquired") == turns and "deflected" not in events
    assert runs >= 2, "status never ran beside the turns"


# Runs the CLI in a process that records every fcntl lock call through Python's audit hooks (the
# fcntl.flock / fcntl.lockf / fcntl.fcntl events): the real flock(2) is still what runs.
AUDITED = """
import json, sys
calls = []
sys.addaudithook(lambda event, args: calls.append([event, list(args)])
                 if event in ("fcntl.flock", "fcntl.lockf", "fcntl.fcntl") else None)
from lanelock.cli import main
code = main(sys.argv[1:])
sys.stdout.flush()
sys.stderr.write("LOCK-CALLS " + json.dumps(calls) + "\\n")
sys.exit(code)
"""


def _lock_calls(run_cmd, *args) -> list:
    done = run_cmd([sys.executable, "-c", AUDITED, *args], timeout=30)
    assert done.returncode in (0, 1), done.stderr
    marker = [line for line in done.stderr.splitlines() if line.startswith("LOCK-CALLS ")]
    assert len(marker) == 1, done.stderr
    return json.loads(marker[0].split(" ", 1)[1])


def test_status_never_calls_flock_whatever_the_lane_state(run_cmd, lanelock, holder, procs, lock_dir):
    """Deterministic where the loop above is statistical: a momentary probe would slip between
    turns, but not past the audit hook."""
    one_turn(lanelock, lock_dir)
    assert _lock_calls(run_cmd, "probe") != [], "control: the hook sees probe's flock"
    arguments = (["status"], ["status", "--json"], ["status", "--all"], ["status", "--all", "--json"])
    for args in arguments:                       # free, released
        assert _lock_calls(run_cmd, *args) == [], args
    held = holder()
    waiter = procs.start([*LANELOCK, "run", "--wait", "--", "true"])
    wait_for(lambda: waiter.pid in kernel(lock_dir / f"{STEM}.lock").waiters, "the waiter to block")
    for args in arguments:                       # held, with a waiter
        assert _lock_calls(run_cmd, *args) == [], args
    assert held.release() == 0
    assert waiter.wait(timeout=TIMEOUT) == 0


# -- hostile sidecars --------------------------------------------------------------------------------
def _write(data: bytes):
    def plant(path: Path, tmp_path: Path) -> None:
        path.write_bytes(data)
    return plant


def _sparse(path: Path, tmp_path: Path) -> None:
    with open(path, "wb") as handle:
        handle.truncate(50 * 1024 * 1024)


def _symlink(path: Path, tmp_path: Path) -> None:
    target = tmp_path / "elsewhere.json"
    target.write_bytes(path.read_bytes())
    path.unlink()
    path.symlink_to(target)


def _fifo(path: Path, tmp_path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _directory(path: Path, tmp_path: Path) -> None:
    path.unlink()
    path.mkdir()


def _mode_000(path: Path, tmp_path: Path) -> None:
    path.chmod(0)


def _record(**fields) -> bytes:
    return json.dumps({"schema": 1, "lane": LANE, **fields}).encode()


HOSTILE = {
    "random-bytes": _write(random.Random(4).randbytes(4096)),
    "invalid-utf8": _write(b'{"schema": 1, "session": "\xff\xfe\xc0\xaf", "pid": 1}'),
    "nul-bytes": _write(b'{"schema": 1,\x00 "pid": 1}\x00\x00'),
    "empty": _write(b""),
    "50-megabytes": _sparse,
    "nested-100000": _write(b"[" * 100000),
    "nested-under-the-size-limit": _write(b"[" * 60000),
    "nested-objects": _write(b'{"a":' * 12000),
    "not-an-object": _write(b"[1, 2, 3]"),
    "a-string": _write(b'"lanelock"'),
    "wrong-types": _write(_record(pid="123", start_ticks=[1, 2], acquired_at=7, boot_id=[],
                                  argv="sh", session={"a": 1}, acquired_monotonic="now")),
    "huge-numbers": _write(_record(pid=10 ** 30, start_ticks=10 ** 40, lock_inode=-10 ** 30,
                                   acquired_monotonic=1e308, held_seconds=-1e308)),
    "a-5000-digit-number": _write(b'{"schema": 1, "pid": ' + b"9" * 5000 + b"}"),
    "infinity-and-nan": _write(b'{"schema": 1, "pid": 1, "start_ticks": Infinity, '
                               b'"acquired_monotonic": NaN}'),
    "future-schema": _write(_record(schema=2, pid=1)),
    "huge-schema": _write(_record(schema=10 ** 30)),
    "boolean-schema": _write(_record(schema=True)),
    "no-schema": _write(b'{"pid": 1}'),
    "escapes-in-labels": _write(_record(pid=1, session="evil\n\x1b[31mred\x1b[0m\rline\x07",
                                        model="\x1b]0;title\x07", argv=["a\nb", "\x1b[2J"])),
    "symlink-to-a-file": _symlink,
    "fifo": _fifo,
    "directory": _directory,
    "mode-000": _mode_000,
}


@pytest.mark.parametrize("plant", HOSTILE.values(), ids=HOSTILE.keys())
def test_a_hostile_sidecar_gives_one_line_and_exit_0(lanelock, lock_dir, tmp_path, plant):
    one_turn(lanelock, lock_dir)
    plant(sidecar_path(lock_dir), tmp_path)
    line = status_line(lanelock)   # one plain line, exit 0, no traceback; bounded: a FIFO must not hang
    assert "\r" not in line and "\x07" not in line
    lane = one_lane(lanelock)
    assert lane["state"] == "free" and lane["holders"] == []
    assert lane["message"] and "\n" not in line


@pytest.mark.parametrize("name", ["random-bytes", "50-megabytes", "fifo", "symlink-to-a-file"])
def test_a_hostile_sidecar_while_held_still_names_the_kernel_holder(lanelock, holder, lock_dir,
                                                                   tmp_path, name):
    held = holder()
    HOSTILE[name](sidecar_path(lock_dir), tmp_path)
    line = status_line(lanelock)
    assert f"pid {held.pid}" in line
    lane = one_lane(lanelock)
    assert (lane["state"], lane["verdict"]) == ("held", "held-unlabelled")
    assert lane["holders"][0]["pid"] == held.pid and lane["sidecar_problem"]
    assert held.release() == 0


@pytest.mark.parametrize("name", ["wrong-types", "huge-numbers"])
def test_a_sidecar_naming_no_usable_pid_is_not_a_dead_holder(lanelock, lock_dir, tmp_path, name):
    one_turn(lanelock, lock_dir)
    HOSTILE[name](sidecar_path(lock_dir), tmp_path)
    lane = one_lane(lanelock)
    assert lane["verdict"] != "died" and "pid None" not in lane["message"], lane["message"]


# -- --all, usage errors -----------------------------------------------------------------------------
def test_all_lists_every_lane_under_the_root(lanelock, holder, lock_dir):
    assert lanelock("run", "-b", "127.0.0.1:8080", "--", "true").returncode == 0
    held = holder("-b", "127.0.0.1:9090")
    lanes = {lane["lane"]: lane for lane in status_json(lanelock, "--all")}
    assert set(lanes) == {"localhost:8080", "localhost:9090"}
    assert lanes["localhost:8080"]["verdict"] == "released"
    assert lanes["localhost:9090"]["verdict"] == "held"
    assert lanes["localhost:9090"]["holders"][0]["pid"] == held.pid

    done = lanelock("status", "--all")
    assert done.returncode == 0 and ESCAPE not in done.stdout
    lines = done.stdout.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("localhost:8080: ") and lines[1].startswith("localhost:9090: ")
    assert held.release() == 0


def test_all_on_an_empty_root_lists_nothing(lanelock):
    assert status_json(lanelock, "--all") == []


def test_all_with_backend_is_a_usage_error(lanelock):
    done = lanelock("status", "--all", "--backend", "127.0.0.1:8080")
    assert done.returncode == 2 and done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("lanelock:"), done.stderr


# -- terminals, colours, --watch ---------------------------------------------------------------------
def _spawn(procs, args, env=None):
    pexpect = pytest.importorskip("pexpect")
    merged = {**os.environ, "TERM": "xterm", "COLUMNS": "200", "LINES": "40", **(env or {})}
    child = pexpect.spawn(sys.executable, ["-m", "lanelock", *args], env=merged, timeout=20,
                          dimensions=(40, 200))
    procs.spawns.append(child)
    return child, pexpect


def test_watch_on_a_terminal_shows_the_lane_and_ctrl_c_exits_0(lanelock, procs, lock_dir):
    one_turn(lanelock, lock_dir)
    child, pexpect = _spawn(procs, ["status", "--watch"])
    child.expect(re.escape(LANE))
    child.expect("released cleanly")
    child.sendintr()
    child.expect(pexpect.EOF, timeout=15)   # a hang fails here
    child.close()
    assert (child.exitstatus, child.signalstatus) == (0, None)
    assert b"Traceback" not in child.before


def test_watch_piped_prints_plain_lines_and_sigint_exits_0(lanelock, procs, lock_dir):
    one_turn(lanelock, lock_dir)
    watch = procs.start([*LANELOCK, "status", "--watch"], stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE)
    line = read_line(watch.stdout, 30)
    assert line.startswith(f"{LANE}: ") and ESCAPE not in line
    watch.send_signal(signal.SIGINT)
    out, err = watch.communicate(timeout=15)
    assert watch.returncode == 0, err
    assert ESCAPE.encode() not in out and b"Traceback" not in err


def test_watch_on_a_terminal_refreshes_when_the_lane_changes(procs, holder):
    """The wait between refreshes also listens for the reader going away; on a terminal it must
    still be a wait, and the table must still follow the lane."""
    child, pexpect = _spawn(procs, ["status", "--watch"])
    child.expect("no turn has used this lane yet")
    held = holder()
    child.expect(f"held by lanelock turn pid {held.pid}")
    assert held.release() == 0
    child.expect("released cleanly")
    child.sendintr()
    child.expect(pexpect.EOF, timeout=15)
    child.close()
    assert (child.exitstatus, child.signalstatus) == (0, None)


# A reader that went away is not lanelock's error: the watch ends at once with 0, as a read
# command whose reader goes does (test_edges), and says nothing about it. A stdout closed from the
# start is another thing: nothing can be written, so it says so and fails.
WATCH_READERS = {
    "plain-into-head": ("status --watch | head -1", 1),
    "json-into-head": ("status --json --watch | head -1", 1),
    "stdout-closed": ("status --watch >&-", 0),   # says it cannot write, exits 1 (below)
    "nothing-written-into-true": ("status --all --watch | true", 0),   # an empty root: no line
}


@pytest.mark.parametrize("case", WATCH_READERS, ids=list(WATCH_READERS))
def test_watch_ends_when_its_reader_goes_away(case, run_cmd, lock_dir):
    command, lines = WATCH_READERS[case]
    program = " ".join(map(shlex.quote, LANELOCK))
    done = run_cmd(["bash", "-c", f"{program} {command}; echo \"rc=${{PIPESTATUS[0]}}\" >&2"],
                   timeout=30)   # the old watch ran until killed here
    if case == "stdout-closed":   # nothing can be written at all: said, and a failure
        said = done.stderr.splitlines()
        assert said[-1] == "rc=1" and len(said) == 2, done.stderr
        assert said[0].startswith("lanelock: cannot write the output: "), done.stderr
        return
    assert done.stderr.splitlines() == ["rc=0"], done.stderr   # no traceback, no "Exception ignored"
    assert len(done.stdout.splitlines()) == lines, done.stdout
    if case == "plain-into-head":
        assert done.stdout.startswith(f"{LANE}: free")
    if case == "json-into-head":
        refresh = json.loads(done.stdout)
        assert [lane["lane"] for lane in refresh["lanes"]] == [LANE] and refresh["time"] > 0


@pytest.mark.parametrize("env", [{}, {"NO_COLOR": "1"}, {"TERM": "xterm-256color", "FORCE_COLOR": "1",
                                                          "CLICOLOR_FORCE": "1"}],
                         ids=["plain", "no-color", "colour-forced"])
def test_piped_output_has_no_escape_sequences(lanelock, holder, env):
    held = holder()
    for args in ((), ("--all",)):
        done = lanelock("status", *args, env=env)
        assert done.returncode == 0 and done.stdout and ESCAPE not in done.stdout + done.stderr
    assert held.release() == 0


_SGR = re.compile(r"\x1b\[([0-9;]*)m")


def _colour_codes(data: bytes) -> list[str]:
    codes = []
    for match in _SGR.finditer(data.decode("utf-8", "replace")):
        for part in match.group(1).split(";"):
            if part.isdigit() and (30 <= int(part) <= 49 or 90 <= int(part) <= 107):
                codes.append(part)
    return codes


def test_no_color_on_a_terminal_has_no_colour_codes(lanelock, procs, lock_dir):
    one_turn(lanelock, lock_dir)
    child, pexpect = _spawn(procs, ["status"])
    child.expect(pexpect.EOF)
    coloured = child.before
    assert LANE.encode() in coloured and _colour_codes(coloured), "rich shows colour on a terminal"

    child, pexpect = _spawn(procs, ["status"], env={"NO_COLOR": "1"})
    child.expect(pexpect.EOF)
    assert LANE.encode() in child.before and b"released cleanly" in child.before
    assert _colour_codes(child.before) == []


@pytest.mark.skipif(not shutil.which("strace"), reason="needs strace")
def test_status_of_one_backend_reads_only_its_own_lanes(lanelock, lock_dir, run_cmd, tmp_path):
    """`status -b X` judged every lane under the root to find X's lanes keyed another
    way (--key-by model). It now asks the store for the lanes' names and judges only X's: with 40
    other lanes' holder records on the root, it opens none of them, and still names the lane of
    X keyed by model."""
    from lanelock import Gate

    for port in range(9100, 9140):
        with Gate(f"127.0.0.1:{port}", lock_dir=str(lock_dir)).turn(session=f"other-{port}"):
            pass
    trace = tmp_path / "trace"
    with Gate("127.0.0.1:8080", lock_dir=str(lock_dir), key_by="model",
              model="qwen").turn(session="keyed"):   # held: in use beside the lane asked about
        done = run_cmd(["strace", "-f", "-qq", "-e", "trace=openat,open", "-o", str(trace),
                        *LANELOCK, "status", "-b", "127.0.0.1:8080"])
    assert done.returncode == 0, done.stderr
    assert "localhost:8080#qwen" in done.stdout + done.stderr
    opened = [line for line in trace.read_text().splitlines() if "-91" in line and ".json" in line]
    assert opened == [], opened[:3]


# -- reading the queue --------------------------------------------------------------
def queue_of(procs, lock_dir, classes) -> list[subprocess.Popen]:
    """One `run --wait` turn per class, each queued (its entry file there) before the next."""
    lock = lock_dir / f"{STEM}.lock"
    waiters = []
    for number, klass in enumerate(classes):
        waiter = procs.start([*LANELOCK, "run", "--wait", "--priority", klass, "-s",
                              f"waiter-{number}", "--", "true"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        wait_for(lambda: is_queued(lock, waiter.pid), f"waiter {number} to queue")
        waiters.append(waiter)
    return waiters


# A turn caught joining: its entry made under the queue's temporary name (.new.PID.RANDOM) and
# locked, not yet renamed in -- as every joining turn is for a moment.
JOINING = """
import fcntl, os, sys
fd = os.open(os.path.join(sys.argv[1], f".new.{os.getpid()}.000000000000"),
             os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
print("ready", flush=True)
sys.stdin.readline()
"""


def test_a_turn_caught_joining_is_nobodys_place_in_line(lanelock, holder, procs, lock_dir):
    """A waiting turn's entry is made under a temporary name and renamed into the queue once
    locked: until then it is in no order -- not in status's queue, not queued for the tests'
    own look (is_queued), which once counted it and so freed a seat before the turn could be
    seen by the turn already waiting."""
    lock = lock_dir / f"{STEM}.lock"
    held = holder("--session", "holder")
    waiter = procs.start([*LANELOCK, "run", "--wait", "-s", "waiter", "--", "true"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wait_for(lambda: is_queued(lock, waiter.pid), "the waiter to queue")
    joining = procs.start([sys.executable, "-c", JOINING, str(lock.with_suffix(".queue"))],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert read_line(joining.stdout).strip() == "ready"
    assert not is_queued(lock, joining.pid)
    assert [row["pid"] for row in one_lane(lanelock)["queue"]] == [waiter.pid]
    joining.stdin.close()
    assert joining.wait(timeout=TIMEOUT) == 0
    assert held.release() == 0
    assert waiter.wait(timeout=TIMEOUT) == 0


def test_plain_status_gives_each_waiter_its_line_and_estimate(lanelock, holder, procs, lock_dir):
    """20 waiters were one 1,097-character line: now the lane's line, then one line per waiter
    in the queue's order, with the estimate the proxy's Retry-After makes (estimate.py)."""
    from lanelock.estimate import until_lane

    one_turn(lanelock, lock_dir)   # a hold to go by
    held = holder("--session", "holder")
    waiters = queue_of(procs, lock_dir, ["batch", "normal", "interactive", "batch", "normal"])
    lane = one_lane(lanelock)
    lines = status_lines(lanelock)
    # "; engine: ..." or, while another test's stand-in answers on port 8080, "; engine http://..."
    assert len(lines) == 6 and " [5 waiting]; engine" in lines[0], lines
    assert max(len(line) for line in lines[1:]) < 120, lines
    order = [row["pid"] for row in lane["queue"]]
    assert order == [waiters[index].pid for index in (2, 1, 4, 0, 3)]   # class, then arrival
    for position, (line, row) in enumerate(zip(lines[1:], lane["queue"]), 1):
        assert line.startswith(f"  {position}. {row['class']} pid {row['pid']} (session "
                               f"waiter-"), line
        expected = until_lane(lane["typical_hold"], lane["holder"]["held_for"], position - 1)
        assert row["estimate"] == expected and row["stopped"] is False
        assert re.search(r", the lane in about \d+s$", line), line
    assert held.release() == 0
    for waiter in waiters:
        assert waiter.wait(timeout=TIMEOUT) == 0


def test_the_table_keeps_the_lane_whole_and_shows_each_waiter_at_40_columns(
        lanelock, holder, procs, lock_dir):
    held = holder("--session", "holder")
    waiters = queue_of(procs, lock_dir, ["batch", "interactive"])
    for columns in (40, 200):
        child, pexpect = _spawn(procs, ["status"], env={"COLUMNS": str(columns), "NO_COLOR": "1"})
        child.setwinsize(40, columns)
        child.expect(pexpect.EOF)
        child.close()
        shown = re.sub(r"\x1b\[[0-9;]*m", "", child.before.decode().replace("\r", ""))
        assert child.exitstatus == 0 and "Traceback" not in shown, shown
        assert LANE in shown and "localh…" not in shown, shown
        for waiter in waiters:
            (row,) = [line for line in shown.splitlines() if str(waiter.pid) in line]
            assert ("interactive" if waiter is waiters[1] else "batch") in row, shown
        assert max(len(line) for line in shown.splitlines()) <= columns
    assert held.release() == 0


def line_of(watch, wanted) -> str:
    """The first line the watch prints that is wanted, within TIMEOUT (the refreshes before it
    are skipped; a watch that never prints one fails here, never hangs)."""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        line = read_line(watch.stdout, max(0.1, deadline - time.monotonic()))
        if wanted(line):
            return line
    raise AssertionError("the watch never printed the line wanted")


def test_watch_shows_the_queue_change_live(lanelock, holder, procs, lock_dir):
    """`status --watch`, piped: a line per waiter appears when it queues and goes when it has
    its turn."""
    held = holder("--session", "holder")
    watch = procs.start([*LANELOCK, "status", "--watch"], stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE)
    assert read_line(watch.stdout, 30).startswith(f"{LANE}: held by")
    (waiter,) = queue_of(procs, lock_dir, ["batch"])
    line_of(watch, lambda line: line.startswith(f"  1. batch pid {waiter.pid} (session "
                                                "waiter-0), waited "))
    assert held.release() == 0
    assert waiter.wait(timeout=TIMEOUT) == 0
    line_of(watch, lambda line: line.startswith(f"{LANE}: free"))
    line = read_line(watch.stdout, 30)
    assert line.startswith(f"{LANE}: ") and not line.startswith("  "), line   # no waiter left
    watch.send_signal(signal.SIGINT)
    assert watch.wait(timeout=TIMEOUT) == 0


def test_an_idle_lane_keyed_by_model_is_no_warning_for_ever(lanelock, procs, lock_dir):
    """After one --key-by model turn, every `status -b` repeated a warning nobody could clear
    (lock files are never deleted): it speaks only while that lane is in use."""
    assert lanelock("run", "--key-by", "model", "-m", "qwen", "--", "true").returncode == 0
    done = lanelock("status")
    assert done.returncode == 0 and done.stderr == "", done.stderr
    keyed = procs.start([*LANELOCK, "run", "--key-by", "model", "-m", "qwen", "--", "sh", "-c",
                         HOLD_SCRIPT], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert read_line(keyed.stdout).startswith("ready ")
    done = lanelock("status")
    assert "lanes keyed another way" in done.stderr and f"{LANE}#qwen (held)" in done.stderr
    keyed.stdin.write(b"0\n")
    keyed.stdin.close()
    assert keyed.wait(timeout=TIMEOUT) == 0


def test_status_all_on_a_root_not_made_yet_says_so(lanelock, tmp_path):
    root = tmp_path / "not-yet"
    done = lanelock("status", "--all", "--lock-dir", str(root))
    assert done.returncode == 0, done.stderr
    assert done.stdout == (f"no lanes yet: the lock root {root} does not exist yet (the first "
                           "turn makes it)\n"), done.stdout
    root.mkdir()
    done = lanelock("status", "--all", "--lock-dir", str(root))
    assert done.stdout == f"no lanes yet under the lock root {root}\n"


def test_a_lane_whose_engine_does_not_answer_says_so(lanelock):
    """`status -b 127.0.0.1:18439` on a wrong port said "free; no turn has used this lane yet",
    exit 0, and no engine line: a typo looked like a quiet lane."""
    from support.ports import free_port

    port = free_port()
    done = lanelock("status", "-b", f"127.0.0.1:{port}")
    assert done.returncode == 0, done.stderr     # the lane's state is still what status judges
    assert done.stdout == (f"localhost:{port}: free; no turn has used this lane yet; engine: "
                           f"nothing answers on 127.0.0.1:{port}\n"), done.stdout
    engine = json.loads(lanelock("status", "-b", f"127.0.0.1:{port}", "--json").stdout)
    assert engine["lanes"][0]["engine"]["answers"] is False
