"""`lanelock run` with real processes, its process lifetime: kill -9 of the wrapper or of the
child, a command that outlives its wrapper, signals forwarded to the child, the lock fd and daemons
the child leaves behind, and Ctrl-C on a terminal."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pexpect
import psutil
import pytest

from support.cli import LANELOCK, TIMEOUT, environ
from support.holding import ESCAPING_HOLD, HOLD_SCRIPT, signalled_hold
from support.kernel_locks import flock_entries, is_queued, is_waiting
from support.processes import ExitWatch, pid_gone, read_line, wait_for, wait_stopped
from lanelock import Gate


def open_fds(pid: int) -> set[str]:
    """What /proc/PID/fd/* point at."""
    targets = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            targets.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            pass
    return targets


# -- process lifetime and signals --------------------------------------------------------------
def test_kill_9_of_the_wrapper_frees_the_lane_and_kills_the_child(holder, lanelock):
    held = holder()
    assert psutil.Process(held.child_pid).ppid() == held.pid
    child = ExitWatch(held.child_pid)
    os.kill(held.pid, signal.SIGKILL)
    assert held.wait() == -signal.SIGKILL
    assert lanelock("probe").returncode == 0, "the lane outlived its wrapper"
    child.wait()   # the parent-death signal


# A held command slow to die: its touched pages are freed before its files are closed (the
# kernel's do_exit order), so a SIGKILL'd copy holds its token flock for a moment after the kill.
HEAVY_HOLD = r"""
import fcntl, os, sys
weight = b"\1" * (1 << 30)
token = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
fcntl.flock(token, fcntl.LOCK_EX)
print("ready", os.getpid(), flush=True)
sys.stdin.read()
"""

# The next turn, an API turn (waiting for the lane, or deflect-mode) that looks at the token the
# moment the lane is its.
TOKEN_LOOK = r"""
import fcntl, os, sys
from lanelock import Gate
token = os.open(sys.argv[1], os.O_RDWR | os.O_CLOEXEC)
print("asking", flush=True)

def look(turn):
    if turn.state != "held":
        return f"{turn.state} {turn.reason}"
    try:
        fcntl.flock(token, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return "held free"
    except BlockingIOError:
        return "held beside the killed turn's command"

async def in_a_task():
    async with Gate().turn(wait=None) as turn:
        return look(turn)

if sys.argv[2] == "async":
    import asyncio
    print(asyncio.run(in_a_task()), flush=True)
else:
    with Gate().turn(wait=None if sys.argv[2] == "forever" else float(sys.argv[2])) as turn:
        print(look(turn), flush=True)
"""


@pytest.mark.parametrize("waiter", ["waiting", "async", "arriving"])
def test_kill_9_of_the_wrapper_hands_the_lane_on_only_once_its_command_is_gone(
        waiter, holder, procs, lock_dir, tmp_path):
    """The kernel lets go of the wrapper's lock before its child is sent the parent-death
    signal, and the child takes a moment to die: the next turn must not generate beside it.
    Here the command takes ~70 ms to die (1 GiB to free): the turn waiting for the lane (a
    thread or an asyncio task), or a deflect-mode one arriving just then, gets it only once the command is gone (or deflects)."""
    token = tmp_path / "token"
    held = holder(command=[sys.executable, "-c", HEAVY_HOLD, str(token)])
    lock = lock_dir / "localhost-8080.lock"
    look = procs.start([sys.executable, "-c", TOKEN_LOOK, str(token),
                        {"waiting": "forever", "async": "async", "arriving": "0"}[waiter]],
                       env=environ({"LANELOCK_DEBUG_PAUSE": "before-acquire"
                                    if waiter == "arriving" else None}),
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert read_line(look.stdout, TIMEOUT) == "asking\n"
    if waiter != "arriving":
        wait_for(lambda: is_waiting(lock, look.pid) or look.poll() is not None,
                 what="the next turn to wait for the lane")
        os.kill(held.pid, signal.SIGKILL)
    else:   # stopped just before it tries the lane; let go once the wrapper is dead
        wait_stopped(look.pid)
        os.kill(held.pid, signal.SIGKILL)
        held.wait()
        os.kill(look.pid, signal.SIGCONT)
    out, err = look.communicate(timeout=TIMEOUT)
    assert look.returncode == 0 and "Traceback" not in err, err
    if waiter != "arriving":
        assert out.splitlines()[-1] == "held free", (out, err)
    else:   # the lane was busy while the command ran, or taken once it was gone
        assert out.splitlines()[-1] in ("held free", "deflected local_backend_busy"), (out, err)


def test_a_command_that_outlives_its_killed_wrapper_keeps_the_lane_until_it_ends(
        holder, procs, lanelock, lock_dir):
    """Whoever generates owns the lane: with its wrapper killed, a command still running (here
    one that turned its parent-death signal off) is the holder -- status says so and why, probe
    and a deflect-mode turn find the lane busy and name it, a waiting turn gets the lane the
    moment it ends."""
    held = holder(command=[sys.executable, "-c", ESCAPING_HOLD])
    os.kill(held.pid, signal.SIGKILL)
    held.wait()
    try:
        status = lanelock("status", "--json")
        lane = json.loads(status.stdout)["lanes"][0]
        assert (lane["state"], lane["verdict"]) == ("held", "ending"), lane
        assert lane["holder"]["pid"] == held.child_pid
        words = lanelock("status").stdout
        assert f"held by pid {held.child_pid}, the command of lanelock turn pid {held.pid}" in words
        assert (f"which was killed: the lane frees when its process group {held.child_pid} "
                "is empty") in words
        probe = lanelock("probe")
        assert probe.returncode == 1 and f"pid {held.child_pid}" in probe.stdout, probe
        assert Gate().busy() is True
        busy = lanelock("run", "--", "true")
        assert busy.returncode == 75 and "still ending" in busy.stderr, busy.stderr
        waiter = procs.start([*LANELOCK, "run", "--wait", "--", "echo", "ran"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        # it takes the lock, and holds it while it waits for the command
        lock = lock_dir / "localhost-8080.lock"
        wait_for(lambda: (waiter.pid in flock_entries(lock)[0] and is_queued(lock, waiter.pid))
                 or waiter.poll() is not None, what="the turn to wait")
        assert waiter.poll() is None, waiter.communicate()
        waiting = json.loads(lanelock("status", "--json").stdout)["lanes"][0]
        assert waiting["verdict"] == "ending", waiting   # the waiter holds the lock meanwhile
        assert f"pid {waiter.pid} takes the lane when its process group" in waiting["message"], \
            waiting
    finally:
        os.kill(held.child_pid, signal.SIGKILL)
    out, err = waiter.communicate(timeout=TIMEOUT)
    assert (waiter.returncode, out) == (0, "ran\n"), err
    after = json.loads(lanelock("status", "--json").stdout)["lanes"][0]
    assert after["verdict"] == "released", after


def test_the_record_names_the_command_even_when_its_parked_child_was_forked_again(
        holder, procs, lock_dir):
    """`run` forks its command before it waits for the lane; if that parked child is killed
    meanwhile, it forks again once the lane is its. The holder record must name the command that
    runs (the next turn waits for it should the wrapper be killed), not the one that died."""
    first = holder()
    waiter = procs.start([*LANELOCK, "run", "--wait", "--", "sh", "-c", HOLD_SCRIPT],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    lock = lock_dir / "localhost-8080.lock"
    wait_for(lambda: is_queued(lock, waiter.pid) or waiter.poll() is not None,
             what="the turn to wait")
    (parked,) = psutil.Process(waiter.pid).children()
    parked.kill()   # a zombie until the wrapper, waiting for the lane, reaps it
    wait_for(lambda: parked.status() == psutil.STATUS_ZOMBIE, what="the parked child to die")
    assert first.release() == 0
    line = read_line(waiter.stdout, TIMEOUT)
    assert line.startswith("ready "), (line, waiter.stderr.read())
    command = int(line.split()[1])
    assert command != parked.pid
    record = json.loads((lock_dir / "localhost-8080.json").read_text())
    assert record["command_pid"] == command, record
    waiter.stdin.write("0\n")
    waiter.stdin.close()
    assert waiter.wait(TIMEOUT) == 0


def test_kill_9_of_the_child_frees_the_lane_and_the_wrapper_exits_137(holder, lanelock, lock_dir):
    held = holder()
    os.kill(held.child_pid, signal.SIGKILL)
    assert held.wait() == 137
    assert "Traceback" not in held.stderr()
    assert lanelock("probe").returncode == 0
    assert json.loads((lock_dir / "localhost-8080.json").read_text())["exit_status"] == 137


@pytest.mark.parametrize("signo", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT, signal.SIGQUIT,
                                   signal.SIGUSR1, signal.SIGUSR2])
def test_signals_to_the_wrapper_are_forwarded_to_the_child(signo, holder, lanelock):
    held = holder(command=signalled_hold(signo.name))
    os.kill(held.pid, signo)
    assert held.read_line() == f"signal {int(signo)}\n", held.stderr()   # the child has it
    assert held.proc.poll() is None, "the wrapper must wait for its child, not die of the signal"
    assert held.release(42) == 42, held.stderr()   # and it ends with the child's own status
    assert lanelock("probe").returncode == 0


def test_sigterm_kills_an_untrapping_child_and_the_wrapper_reports_143(holder):
    held = holder()
    os.kill(held.pid, signal.SIGTERM)
    assert held.wait() == 143
    assert pid_gone(held.child_pid)


def test_kill_after_kills_a_child_that_ignores_the_forwarded_signal(holder):
    held = holder("--kill-after", "0.2", command=["sh", "-c", 'trap "" TERM; echo "ready $$"; read x'])
    os.kill(held.pid, signal.SIGTERM)
    assert held.wait() == 137


def test_the_child_does_not_inherit_the_lock_fd(holder, lock_dir):
    held = holder()
    lock = os.path.realpath(lock_dir / "localhost-8080.lock")
    assert lock in open_fds(held.pid), "sanity: the wrapper holds the lock file open"
    assert lock not in open_fds(held.child_pid)
    assert held.release() == 0


def test_a_daemon_the_child_starts_cannot_keep_the_lane(procs, lanelock, lock_dir, tmp_path):
    """A daemon leaves the turn's process group (setsid): it is outside the turn. (A background
    job that stays in the group is the turn's, and keeps the lane: test_turn_tree.py.)"""
    out = tmp_path / "daemon-pid"
    with open(out, "w") as stdout:
        wrapper = procs.start([*LANELOCK, "run", "--", "sh", "-c", "setsid sleep 30 & echo $!"],
                              stdout=stdout)
        assert wrapper.wait(timeout=TIMEOUT) == 0
    daemon = procs.adopt(int(out.read_text()))
    assert daemon is not None and daemon.is_running(), "the daemon should outlive the turn"
    assert os.path.realpath(lock_dir / "localhost-8080.lock") not in open_fds(daemon.pid)
    assert lanelock("probe").returncode == 0, "a daemon of the child kept the lane"
    result = lanelock("run", "--", "printenv", "LANELOCK_STATE")
    assert result.stdout.strip() == "held"


# -- Ctrl-C on a terminal ----------------------------------------------------------------------
def spawn(procs, argv, **kwargs):
    child = pexpect.spawn(argv[0], list(argv[1:]), env=environ(), timeout=30, encoding="utf-8",
                          **kwargs)
    return procs.spawn(child)


def finished(child) -> tuple[int | None, int | None]:
    child.expect(pexpect.EOF)
    child.close()
    return child.exitstatus, child.signalstatus


def test_ctrl_c_at_a_terminal_exits_130_and_frees_the_lane(procs, lanelock):
    child = spawn(procs, [*LANELOCK, "run", "--", "sh", "-c", "echo READY-$((6*7)); exec sleep 30"])
    child.expect("READY-42")
    child.sendintr()
    status, signo = finished(child)
    assert status == 130 or signo == signal.SIGINT, (status, signo)
    assert lanelock("probe").returncode == 0


def test_ctrl_c_to_a_child_that_traps_it_does_not_end_the_turn(procs):
    """The terminal sends ^C to the whole foreground group: a child that handles it goes on, and
    the wrapper keeps waiting for it (no re-raise: the child did not die of it). The child reports
    every SIGINT it gets, so a second copy forwarded by the wrapper shows -- unless it coalesced
    with the first, so only a late duplicate can be caught."""
    child = spawn(procs, [*LANELOCK, "run", "--", *signalled_hold("SIGINT")])
    child.expect("ready")
    child.sendintr()
    child.expect(f"signal {int(signal.SIGINT)}")
    child.sendline("0")
    status, signo = finished(child)
    assert (status, signo) == (0, None)
    assert "signal" not in child.before, "SIGINT reached the child twice"


@pytest.mark.parametrize("wrapped", [False, True])
def test_ctrl_c_stops_a_calling_shell_loop_as_without_lanelock(wrapped, procs):
    """bash ends a loop only when its child died of SIGINT: lanelock must look the same."""
    prefix = f"{sys.executable} -m lanelock run -- " if wrapped else ""
    script = (f"for i in 1 2; do {prefix}sh -c \"echo READY-$((40+i)); exec sleep 30\"; "
              "echo rc=$?; done; echo after-loop")
    child = spawn(procs, ["bash", "-c", script])
    child.expect("READY-41")
    child.sendintr()
    child.expect(pexpect.EOF)
    rest = child.before
    child.close()
    assert "READY-42" not in rest and "after-loop" not in rest and "rc=" not in rest, rest
    assert child.signalstatus == signal.SIGINT or child.exitstatus == 130


def test_ctrl_c_while_waiting_for_the_lane_exits_130(holder, procs, lock_dir, lanelock):
    held = holder()
    child = spawn(procs, [*LANELOCK, "run", "--wait", "--", "true"])
    wait_for(lambda: is_waiting(lock_dir / "localhost-8080.lock", child.pid) or not child.isalive(),
             what="the waiter to block in flock()")
    child.sendintr()
    status, signo = finished(child)
    assert status == 130 or signo == signal.SIGINT, (status, signo)
    assert lanelock("probe").returncode == 1, "the holder must be unaffected"
    assert held.release() == 0


def test_the_session_label_names_the_terminal(procs):
    child = spawn(procs, [*LANELOCK, "run", "--", "printenv", "LANELOCK_SESSION"])
    child.expect(pexpect.EOF)
    label = child.before.strip()
    child.close()
    assert child.exitstatus == 0
    assert re.fullmatch(r"[^@\s]+@(pts/\d+|tty\w*)", label), label
