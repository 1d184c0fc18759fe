"""`async with gate.turn()` (asyncturn.py): many tasks of one process beside real processes on the
same lane. Each task is its own turn, so tasks exclude each other and every other process as
processes do; the event loop never blocks on a wait; a cancelled wait is abandoned without a trace
in the records; an exception releases; the same task nests, another task does not.

The asyncio code runs in this process (asyncio.run); every other holder of the lane is a real
`lanelock run` process. Nothing here sleeps to synchronise: the holder says "ready" on a pipe, and
waits are observed in the kernel (/proc/locks).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import threading
import time

import pytest

from support.cli import LANELOCK, TIMEOUT, probe_in_process
from support.kernel_locks import is_waiting
from support.processes import wait_for
from lanelock import Gate, locks

BACKEND = "127.0.0.1:8080"
# The held command of a competing `lanelock run`: take the token directory (mkdir is atomic: it
# fails if anyone else holds it), generate for a moment, give it back. 99: two at once.
GENERATE = 'mkdir "$1" || exit 99; sleep 0.01; rmdir "$1"'


def lock_path(lock_dir) -> str:
    return str(lock_dir / "localhost-8080.lock")


def kernel(lock_dir) -> locks.KernelView:
    view = locks.kernel_view(os.stat(lock_path(lock_dir)))
    assert view is not None, "/proc/locks is unreadable"
    return view


def none_of_ours(lock_dir) -> bool:
    """No lock or wait of this process left on the lane. A deflected or cancelled turn's helper
    thread stays blocked in flock() until the lane frees, then takes and drops it at once (see
    store/flock/waiting.py): wait for that before asking whether the lane is free."""
    view = kernel(lock_dir)
    return os.getpid() not in view.holders and os.getpid() not in view.waiters


def events(lanelock) -> list[dict]:
    result = lanelock("history", "-b", BACKEND, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["events"]


@contextlib.asynccontextmanager
async def ticking():
    """A 1 ms ticker on the running loop for as long as the block runs: yields the list it appends
    each tick's lag to (seconds later than 1 ms it woke), one a tick. A loop that goes on while
    tasks wait ticks on; a store call on the loop lags the tick behind it by the call's length.
    Stopped at the block's end (the tick under way still counts)."""
    lags: list[float] = []
    stop = asyncio.Event()

    async def ticker():
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            before = loop.time()
            await asyncio.sleep(0.001)
            lags.append(loop.time() - before - 0.001)

    tick = asyncio.ensure_future(ticker())
    try:
        yield lags
    finally:
        stop.set()
        await tick


def test_tasks_deflect_while_another_process_holds_and_the_loop_runs_on(holder, lanelock,
                                                                        lock_dir):
    other = holder("-b", BACKEND, "-s", "other")
    gate = Gate(BACKEND)

    async def one(index):
        async with gate.turn(session=f"task-{index}", wait=0.3) as turn:
            return turn.state, turn.reason, turn.proceed, turn.holder, turn.waited

    async def main():
        async with ticking() as lags:
            results = await asyncio.gather(*(one(index) for index in range(10)))
        return results, len(lags)

    started = time.monotonic()
    results, ticks = asyncio.run(main())
    elapsed = time.monotonic() - started
    for state, reason, proceed, who, waited in results:
        assert (state, reason, proceed) == ("deflected", "local_backend_busy", False)
        assert who["pid"] == other.pid and who["session"] == "other"
        assert waited >= 0.3
    assert elapsed < 2.0          # ten waits of 0.3 s side by side, not one after the other
    assert ticks >= 50            # the loop went on while every task waited
    assert other.release() == 0
    wait_for(lambda: none_of_ours(lock_dir), what="the deflected turns' waits to end")
    mine = [event for event in events(lanelock) if event["pid"] == os.getpid()]
    assert sorted(event["session"] for event in mine) == sorted(f"task-{i}" for i in range(10))
    assert {event["event"] for event in mine} == {"deflected"}


def test_many_tasks_and_processes_hold_one_at_a_time(holder, procs, lanelock, lock_dir,
                                                     tmp_path):
    token = tmp_path / "generating"
    first = holder("-b", BACKEND, "-s", "first")     # everyone queues behind it
    runs = [procs.start([*LANELOCK, "run", "--wait", "30", "-b", BACKEND, "-s", f"run-{index}",
                         "--", "sh", "-c", GENERATE, "sh", str(token)], stderr=subprocess.PIPE)
            for index in range(3)]
    gate = Gate(BACKEND)
    tasks_count = 12
    inside = {"now": 0, "most": 0}

    async def task(index):
        async with gate.turn(session=f"task-{index}", wait=30) as turn:
            assert turn.state == "held" and not turn.nested
            inside["now"] += 1
            inside["most"] = max(inside["most"], inside["now"])
            os.mkdir(token)                  # FileExistsError: a process holds it too
            await asyncio.sleep(0.005)       # generating; other tasks run meanwhile
            os.rmdir(token)
            inside["now"] -= 1
            return turn.waited

    def everyone_queued():
        # Every waiting turn -- each task, each `run` process -- is in the lane's queue (status
        # shows it), in order of arrival: one class.
        [facts] = gate.store.survey(gate.lane)
        pids = [entry["pid"] for entry in facts.queue]
        return pids.count(os.getpid()) == tasks_count and \
            all(run.pid in pids for run in runs)

    async def main():
        waiting = [asyncio.create_task(task(index)) for index in range(tasks_count)]
        await asyncio.to_thread(wait_for, everyone_queued, what="every turn to queue")
        assert first.release() == 0
        return await asyncio.gather(*waiting)

    waited = asyncio.run(main())
    for run in runs:
        assert run.wait(timeout=TIMEOUT) == 0, run.stderr.read()
    assert inside["most"] == 1 and inside["now"] == 0
    assert all(seconds > 0 for seconds in waited)
    acquired = [event for event in events(lanelock) if event["event"] == "acquired"]
    assert len(acquired) == 1 + 3 + tasks_count
    held = [event for event in events(lanelock) if event["event"] in ("acquired", "released")]
    # The journal, in order: each acquired is followed by its own release before the next.
    pairs = list(zip(held[::2], held[1::2]))
    assert all(taken["event"] == "acquired" and let_go["event"] == "released" and
               (taken["pid"], taken["session"]) == (let_go["pid"], let_go["session"])
               for taken, let_go in pairs), held


def test_cancelling_a_waiting_task_abandons_the_wait(holder, lanelock, lock_dir):
    other = holder("-b", BACKEND, "-s", "other")
    gate = Gate(BACKEND)
    turn = gate.turn(session="cancelled", wait=None)     # would wait forever
    entered = []

    async def wait_for_lane():
        async with turn:
            entered.append(turn.state)

    async def main():
        task = asyncio.create_task(wait_for_lane())
        await asyncio.to_thread(wait_for, lambda: is_waiting(lock_path(lock_dir), os.getpid()),
                                what="the task to wait in the kernel")
        cancelled_at = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # Nothing waits in the kernel for it any more (the waiter thread stayed
        # blocked in flock(2) until the lane freed).
        assert not is_waiting(lock_path(lock_dir), os.getpid())
        return time.monotonic() - cancelled_at

    took = asyncio.run(main())
    assert took < 1.0 and entered == [] and turn.state == "cancelled"
    assert probe_in_process(["-b", BACKEND]).returncode == 1    # still the other process's
    assert other.release() == 0
    after = lanelock("run", "--wait", "5", "-b", BACKEND, "-s", "next", "--", "sh", "-c",
                     'echo "$LANELOCK_STATE"')
    assert (after.returncode, after.stdout) == (0, "held\n")
    wait_for(lambda: none_of_ours(lock_dir), what="the abandoned wait to end")
    assert probe_in_process(["-b", BACKEND]).returncode == 0
    assert not [event for event in events(lanelock) if event["session"] == "cancelled"]


def test_an_exception_in_the_block_releases(lanelock, lock_dir):
    gate = Gate(BACKEND)

    async def main():
        async with gate.turn(session="boom") as turn:
            assert turn.state == "held"
            busy = await asyncio.to_thread(lanelock, "probe", "-b", BACKEND)
            assert busy.returncode == 1
            raise ValueError("the model call failed")

    with pytest.raises(ValueError, match="the model call failed"):
        asyncio.run(main())
    assert lanelock("probe", "-b", BACKEND).returncode == 0
    released = [event for event in events(lanelock) if event["event"] == "released"]
    assert len(released) == 1 and released[0]["session"] == "boom"
    assert released[0]["exit_status"] is None


def test_the_same_task_nests_and_another_task_is_a_separate_turn(lanelock, lock_dir):
    gate = Gate(BACKEND)

    async def separate():
        async with gate.turn(session="separate", wait=0.1) as turn:
            return turn.state, turn.nested

    async def main():
        async with gate.turn(session="outer") as outer:
            async with gate.turn(session="inner", wait=None) as inner:   # no wait: reentrant
                assert (inner.state, inner.nested, outer.nested) == ("held", True, False)
                other = await asyncio.create_task(separate())
            still = await asyncio.to_thread(lanelock, "probe", "-b", BACKEND)
            assert outer.state == "held"
        return other, still.returncode

    other, still_held = asyncio.run(main())
    assert other == ("deflected", False)
    assert still_held == 1                     # leaving the inner turn kept the outer one
    wait_for(lambda: none_of_ours(lock_dir), what="the separate turn's wait to end")
    assert lanelock("probe", "-b", BACKEND).returncode == 0
    seen = [(event["event"], event["session"]) for event in events(lanelock)]
    assert seen == [("acquired", "outer"), ("deflected", "separate"), ("released", "outer")]


def test_a_wait_cancelled_as_the_lane_frees_is_never_journaled_as_a_turn(procs, lock_dir):
    """Waiters cancelled the moment the lane freed were journaled as
    acquired/released although their block never ran. Here 3 tasks wait in each of 100 rounds;
    the holder (flock(1), quick to start) lets go and every task is cancelled as soon as this
    process learns it did, racing the hand-off. A turn in the journal is a block that ran."""
    gate = Gate(BACKEND)
    lock = lock_path(lock_dir)
    with gate.turn():   # makes the lock file
        pass
    ran: list[str] = []

    async def one(name):
        async with gate.turn(session=name, wait=None):
            ran.append(name)

    async def round_(number):
        held = procs.start(["flock", lock, "sh", "-c", 'echo ready; read go'],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert held.stdout.readline() == b"ready\n"
        tasks = [asyncio.ensure_future(one(f"race-{number}-{index}")) for index in range(3)]
        await asyncio.to_thread(wait_for, lambda: is_waiting(lock, os.getpid()),
                                "this process waits in the kernel")
        held.stdin.write(b"go\n")
        held.stdin.close()
        await asyncio.to_thread(held.wait)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def main():
        for number in range(100):
            await round_(number)

    asyncio.run(main())
    wait_for(lambda: none_of_ours(lock_dir), "the helper thread let go")
    journal = lock_dir / "localhost-8080.journal"
    turns = [json.loads(line) for line in journal.read_text().splitlines()]
    acquired = sorted(event["session"] for event in turns
                      if event["event"] == "acquired" and event["session"].startswith("race-"))
    assert acquired == sorted(ran)


def loop_lag_while_turns_run(gate, tasks: int = 50, samples: int = 1000) -> list[float]:
    """Lags (seconds) of a 1 ms ticker while `tasks` tasks take the lane one after another and as
    many more find it busy and deflect (and settle their counts), round after round until the
    ticker has `samples` lags: a p99 of a hundred ticks is their maximum, one scheduler hiccup of
    a loaded machine (CI saw one of 81 ms), while a store call on the loop would lag every turn."""
    async def taking(index):
        async with gate.turn(session=f"lag-{index}", wait=None) as turn:
            assert turn.held
            await asyncio.sleep(0.001)

    async def deflecting(index):
        async with gate.turn(session=f"busy-{index}", wait=0) as turn:
            return turn.state

    async def main():
        async with ticking() as lags:
            await asyncio.sleep(0.01)
            for _ in range(100):   # rounds; a bound so a stalled ticker cannot loop forever
                await asyncio.gather(*[taking(i) for i in range(tasks)],
                                     *[deflecting(i) for i in range(tasks)])
                if len(lags) >= samples:
                    break
        return lags

    return asyncio.run(main())


STALL = 1.0   # seconds another process keeps the lane's counts locked


def counts_held_by_another_process(gate, procs, store: str, request):
    """Lock the lane's counts where the store keeps them, from another process, until the
    returned function is called: every count (a release, a deflected turn's settle) waits."""
    if store == "flock":
        path = gate.lock_path[:-len(".lock")] + ".counts"
        holder = procs.start(["flock", path, "sh", "-c", "echo ready; read go"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    else:
        dsn = request.getfixturevalue("postgres").dsn
        script = ("import sys, psycopg\n"
                  "conn = psycopg.connect(sys.argv[1])\n"
                  "conn.execute('SELECT counts FROM lanelock_counts WHERE lane = %s FOR UPDATE',"
                  " (sys.argv[2],)).fetchone()\n"
                  "print('ready', flush=True)\n"
                  "sys.stdin.readline()\n"
                  "conn.rollback()\n")
        holder = procs.start([sys.executable, "-c", script, dsn, gate.lane.name],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert holder.stdout.readline() == b"ready\n"

    def let_go():
        holder.stdin.write(b"go\n")
        holder.stdin.close()
        holder.wait(TIMEOUT)

    return let_go


@pytest.mark.parametrize("store", ["flock", "postgresql"])
def test_a_stalled_store_stalls_threads_never_the_loop(store, request, monkeypatch, procs):
    """The decisive form of the lag test: another process keeps the lane's counts
    locked for a second while tasks take turns, release (which counts) and deflect (and settle
    their counts). A store call on the loop would freeze the ticker for the whole second; here
    the ticker never lags by even a quarter of it, and every turn finishes once the lock goes.
    On the flock store a release is the loop's own and only tries the counts' lock: the turns
    that held end at once, their counts added in the loop's pool once the lock goes."""
    if store == "postgresql":
        monkeypatch.setenv("LANELOCK_STORE", request.getfixturevalue("postgres").dsn)
        backend = f"127.0.0.1:{20000 + (os.getpid() + 1) % 20000}"
    else:
        backend = BACKEND
    gate = Gate(backend, warn=lambda message: pytest.fail(f"the gate failed open: {message}"))
    with gate.turn(session="first"):   # the counts exist before anyone locks them
        pass
    let_go = counts_held_by_another_process(gate, procs, store, request)
    tasks = 10

    async def taking(index):
        async with gate.turn(session=f"stall-{index}", wait=None) as turn:
            return turn.state

    async def deflecting(index):
        async with gate.turn(session=f"stalled-{index}", wait=0) as turn:
            return turn.state

    async def main():
        async with ticking() as lags:
            timer = threading.Timer(STALL, let_go)
            timer.start()
            try:
                started = time.monotonic()
                held = asyncio.gather(*[taking(i) for i in range(tasks)])
                others = asyncio.gather(*[deflecting(i) for i in range(tasks)])
                results = await held
                held_in = time.monotonic() - started
                early = turns_counted(gate) if store == "flock" else None
                results += await others
                took = time.monotonic() - started
            finally:
                await asyncio.to_thread(timer.join)
        return results, took, held_in, early, lags

    results, took, held_in, early, lags = asyncio.run(main())
    assert results[:tasks] == ["held"] * tasks
    assert set(results[tasks:]) <= {"held", "deflected"}
    if store == "flock":
        assert held_in < STALL / 2, f"the releases waited {held_in:.2f} s for the counts"
        assert early == 1, "counted while locked: the stall proved nothing"
        assert turns_counted(gate) == 1 + 2 * tasks   # every count added once the lock went
    else:
        assert took >= STALL * 0.9, "the turns never waited for the counts: the stall proved nothing"
    assert max(lags) < STALL / 4, f"the loop froze for {max(lags) * 1000:.0f} ms"


def turns_counted(gate) -> int:
    """Turns the flock lane's counts have, whatever their outcome."""
    from lanelock.store import counts

    found = counts.read(gate.lock_path[:-len(".lock")] + ".counts")
    return sum(number or 0 for number in found["turns"].values())


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


@pytest.mark.parametrize("store", ["flock", "postgresql"])
def test_the_event_loop_never_waits_for_the_store(store, request, monkeypatch):
    """Settling a deflected turn's count and the proxy's Retry-After ran store work on
    the loop. 50 tasks (20 on PostgreSQL) take turns and as many deflect, round after round, while
    a 1 ms ticker measures the loop's lag over 1,000 ticks: p99 under 100 ms. Measured on the
    2-core machine: 8-10 ms idle, 16 ms beside two busy loops, 35 ms on a CI box also running a
    chaos suite; what remains is the GIL shared with the thread pool (the same pool doing plain
    JSON work instead: p99 80 ms). The stall test below is the decisive one (a store call on the
    loop freezes it for the whole second); this one keeps the figure in sight (a bound, not a
    benchmark)."""
    if store == "postgresql":
        monkeypatch.setenv("LANELOCK_STORE", request.getfixturevalue("postgres").dsn)
        backend = f"127.0.0.1:{20000 + os.getpid() % 20000}"
    else:
        backend = BACKEND
    gate = Gate(backend, warn=lambda message: pytest.fail(f"the gate failed open: {message}"))
    # Each PostgreSQL turn holds a server connection: 20 + 20 stay within the server's limit.
    lags = loop_lag_while_turns_run(gate, 50 if store == "flock" else 20)
    assert len(lags) >= 1000
    assert p99(lags) < 0.100, f"p99 loop lag {p99(lags) * 1000:.1f} ms, max {max(lags) * 1000:.1f} ms"
