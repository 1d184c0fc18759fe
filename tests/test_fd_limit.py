"""Crowded is not broken: `lanelock run` at any open-file limit runs the command, its fallback, or
exits with a documented status and one line -- never 70 (internal error), never a traceback --
and a turn that cannot open the gate for lack of descriptors never runs beside the holder: the
gate is there, the turn only cannot see it. The Python API deflects the same way.

Limits are real (prlimit(1) on a real `lanelock run`, setrlimit in a real API process).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap

import pytest

from support.cli import LANELOCK, TIMEOUT

RESOURCES = 71   # exitcodes.RESOURCES: EX_OSERR, too few descriptors (or no memory) to start
BUSY = 75

pytestmark = pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs prlimit(1)")


def limited(run_cmd, limit: int, *args: str) -> subprocess.CompletedProcess:
    return run_cmd(["prlimit", f"--nofile={limit}:{limit}", *LANELOCK, "run", *args])


def assert_documented(done: subprocess.CompletedProcess, *, may_run: bool) -> str:
    """What `run` did: 'command', 'fallback', or the status it exited with after one line."""
    assert "Traceback" not in done.stderr and "internal error" not in done.stderr, done
    assert done.returncode != 70, done
    out = done.stdout.strip()
    if out == "command":
        assert may_run, f"the command ran beside the holder: {done}"
        assert done.returncode == 0, done
        return out
    if out == "fallback":
        assert done.returncode == 0, done
        return out
    assert out == "", done
    assert done.returncode in (RESOURCES, BUSY), done
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("lanelock: "), done
    return str(done.returncode)


# On a free lane: at 6 and below no child can be started at all (the parked child's pipes need 4 descriptors
# at once, 3 are stdio): one line and 71 before the gate is touched. At 7 the lock opens but the
# lane's queue cannot be read -- whether someone waits first cannot be told: deflected as crowded.
# From 8 the command runs (the record and journal may be short of a descriptor: warnings only).
FREE_LANE = {5: {str(RESOURCES)}, 6: {str(RESOURCES)}, 7: {"fallback", str(BUSY)}, 8: {"command"}}


@pytest.mark.parametrize("limit", [5, 6, 7, 8])
@pytest.mark.parametrize("fallback", [False, True], ids=["no-fallback", "fallback"])
def test_run_at_a_low_fd_limit_on_a_free_lane(run_cmd, lanelock, limit, fallback):
    extra = ["--fallback", "echo fallback"] if fallback else []
    done = limited(run_cmd, limit, *extra, "--", "echo", "command")
    what = assert_documented(done, may_run=True)
    assert what in FREE_LANE[limit] and (fallback or what != "fallback"), done
    if what == str(RESOURCES):
        assert "cannot start echo: Too many open files" in done.stderr, done
        assert "nothing ran" in done.stderr, done
        if limit == 6:   # at 5 there is no descriptor left to load the module that asks
            assert "(the open-file limit, ulimit -n, is 6)" in done.stderr, done
    if limit == 7:
        assert "gate_crowded: cannot tell whether lane" in done.stderr, done
    assert lanelock("probe").returncode == 0   # and nothing left held


@pytest.mark.parametrize("limit", [5, 6, 7, 8])
@pytest.mark.parametrize("fallback", [False, True], ids=["no-fallback", "fallback"])
def test_run_at_a_low_fd_limit_never_runs_beside_the_holder(run_cmd, holder, limit, fallback):
    held = holder()
    extra = ["--fallback", "echo fallback"] if fallback else []
    done = limited(run_cmd, limit, *extra, "--", "echo", "command")
    what = assert_documented(done, may_run=False)
    if what == str(BUSY):
        assert "no fallback" in done.stderr, done
    assert held.release() == 0


API_TURN = textwrap.dedent("""
    import os, resource, sys
    from lanelock import Gate

    gate = Gate()
    with gate.turn(session="warm-up") as turn:   # everything a held turn imports, imported
        assert turn.state in ("held", "deflected"), turn.state
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    hoard = []
    try:
        while True:
            hoard.append(os.open("/dev/null", os.O_RDONLY))
    except OSError:
        pass
    with gate.turn(session="crowded") as turn:
        crowded = (turn.state, turn.proceed, turn.reason)
    for fd in hoard:
        os.close(fd)
    with gate.turn(session="after") as turn:
        after = turn.state
    print(*crowded, after)
""")


@pytest.mark.parametrize("held", [True, False], ids=["held", "free"])
def test_an_api_turn_out_of_descriptors_deflects_and_never_fails_open(run_cmd, holder, held):
    """EMFILE while taking the lane: the turn cannot tell whether the lane is held, so it
    deflects ("gate_crowded") -- it never runs beside a holder as a broken gate's turn would."""
    keeper = holder() if held else None
    done = run_cmd([sys.executable, "-c", API_TURN], timeout=TIMEOUT)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done
    state, proceed, reason, after = done.stdout.split()
    assert (state, proceed, reason) == ("deflected", "False", "gate_crowded"), done
    assert after == ("deflected" if held else "held"), done
    assert "running without it" not in done.stderr, done
    if keeper is not None:
        assert keeper.release() == 0


def test_a_crowded_turn_never_takes_the_lane_past_a_queue_it_cannot_read(run_cmd, holder, procs,
                                                                         lock_dir, lanelock):
    """A waiter is queued (stopped, so the lane is free meanwhile). A turn at ulimit -n 8 opens
    the lock but cannot list the lane's queue: it cannot tell who waits first, so it deflects as
    crowded and leaves the queue as it was (it used to call the queue broken, warn, and take the
    lane)."""
    import os
    import signal

    from support.cli import STEM
    from support.kernel_locks import is_waiting
    from support.processes import wait_for, wait_stopped

    held = holder()
    waiter = procs.start([*LANELOCK, "run", "-w", "60", "--", "true"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    lock = lock_dir / f"{STEM}.lock"
    # A waiter blocked in the kernel reports nothing: /proc/locks says when it waits.
    wait_for(lambda: is_waiting(lock, waiter.pid), what="the waiter to wait in flock()")
    os.kill(waiter.pid, signal.SIGSTOP)
    wait_stopped(waiter.pid)
    queue = lock_dir / f"{STEM}.queue"
    entries = sorted(os.listdir(queue))
    assert len(entries) == 1, entries
    assert held.release() == 0
    done = limited(run_cmd, 8, "--", "echo", "command")
    what = assert_documented(done, may_run=True)
    assert what == str(BUSY) and "gate_crowded" in done.stderr, done
    assert sorted(os.listdir(queue)) == entries
    os.kill(waiter.pid, signal.SIGCONT)
    assert waiter.wait(timeout=TIMEOUT) == 0


# Run in a real process with its descriptors counted out: the queue asked of a live waiter's entry
# with 0 descriptors to spare (the entry cannot be opened) and with 1 (the entry opens, the
# waiter's /proc status cannot). Prints what the order's first live entry was and whether the entry
# is still there.
_ASK_CROWDED = textwrap.dedent("""
    import errno, os, sys
    from lanelock.store import order
    from lanelock.store.flock.queue import Queue
    root, stem, spare = sys.argv[1], sys.argv[2], int(sys.argv[3])
    queue = Queue(os.open(root, os.O_RDONLY | os.O_DIRECTORY), stem, 60.0)
    entries = queue.listed()
    hoard = []
    while True:
        try:
            hoard.append(os.open("/dev/null", os.O_RDONLY))
        except OSError:
            break
    for fd in hoard[:spare]:
        os.close(fd)
    try:
        found = order.first_in_order(entries, queue.aging, queue)
        said = "found" if found is not None else "none"
    except OSError as error:
        said = errno.errorcode.get(error.errno, str(error.errno))
    for fd in hoard[spare:]:
        os.close(fd)
    print(said, len(os.listdir(os.path.join(root, stem + ".queue"))))
""")


@pytest.mark.parametrize("spare", [0, 1])
def test_a_queue_asked_without_descriptors_neither_drops_nor_skips_a_live_waiter(
        holder, procs, lock_dir, run_cmd, spare):
    """Out of descriptors, a live waiter's entry cannot be asked: that is crowded, not 'gone'
    (its file was removed: the waiter lost its place) nor 'no waiter's entry' (skipped: the
    asking turn took the lane past it). The asker hears the error; the entry stays."""
    from support.cli import STEM
    from support.kernel_locks import is_waiting
    from support.processes import wait_for

    held = holder()
    waiter = procs.start([*LANELOCK, "run", "-w", "60", "--", "true"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    lock = lock_dir / f"{STEM}.lock"
    wait_for(lambda: is_waiting(lock, waiter.pid), what="the waiter to wait in flock()")
    done = run_cmd([sys.executable, "-c", _ASK_CROWDED, str(lock_dir), STEM, str(spare)])
    assert done.returncode == 0, done
    assert done.stdout.split() == ["EMFILE", "1"], done
    assert held.release() == 0
    assert waiter.wait(timeout=TIMEOUT) == 0
