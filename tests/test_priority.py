"""Who goes next: priority classes and a fair queue for the turns that wait.

Every waiter is a real `lanelock run` process (or a turn of this process where the API is the
point); the order they are served in is the order their commands append to a file. Arrival order
is made certain by waiting until each waiter shows in the lane's queue (the store's survey, what
`status` reads) before the next starts. Aging is set per test through LANELOCK_PRIORITY_AGING:
an hour where only class and arrival should decide.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading

import pytest

from support.cli import LANELOCK, STEM, TIMEOUT
from support.processes import wait_for, wait_stopped
from lanelock import Gate

BACKEND = "127.0.0.1:8080"
NO_AGING = {"LANELOCK_PRIORITY_AGING": "3600"}


def queue(env=None) -> list[dict]:
    """The lane's queue in order, as `status` reads it."""
    aging = (env or {}).get("LANELOCK_PRIORITY_AGING")
    if aging:
        os.environ["LANELOCK_PRIORITY_AGING"] = aging
    try:
        gate = Gate(BACKEND)
        [facts] = gate.store.survey(gate.lane)
        return facts.queue
    finally:
        os.environ.pop("LANELOCK_PRIORITY_AGING", None)


def queued(procs, order_file, name: str, klass: str, env=None, extra=(), prefix=()):
    """A `lanelock run --wait --priority KLASS` that appends NAME to order_file once it holds;
    returned once it shows in the queue. prefix: words before it (strace ...)."""
    waiter = procs.start([*prefix, *LANELOCK, "run", "--wait", "120", "--priority", klass, "-s", name,
                          "-b", BACKEND, *extra, "--", "sh", "-c", f'echo {name} >> "$0"',
                          str(order_file)],
                         env={**os.environ, **(env or {})}, stderr=subprocess.PIPE)
    # Its own entry, by its session: a count of entries can rise for another reason (on
    # PostgreSQL a host's head moving from the host lane to the server's queue).
    wait_for(lambda: name in [entry["session"] for entry in queue(env)], f"{name} to queue")
    return waiter


def finished(waiters) -> None:
    for waiter in waiters:
        assert waiter.wait(TIMEOUT) == 0, waiter.stderr.read()


@pytest.fixture(params=["flock", "postgresql"])
def store(request, monkeypatch):
    """The store the lane lives in: flock under the test's root, or the PostgreSQL server (every
    process of the test inherits LANELOCK_STORE)."""
    if request.param == "postgresql":
        monkeypatch.setenv("LANELOCK_STORE", request.getfixturevalue("postgres").dsn)
    return request.param


def test_waiters_are_served_by_class_then_by_arrival(store, holder, procs, tmp_path):
    order = tmp_path / "order"
    first = holder("-b", BACKEND, "-s", "first")
    arrivals = [("b1", "batch"), ("n1", "normal"), ("i1", "interactive"), ("n2", "normal"),
                ("b2", "batch"), ("i2", "interactive")]
    waiters = [queued(procs, order, name, klass, NO_AGING) for name, klass in arrivals]
    expected = [("i1", "interactive"), ("i2", "interactive"), ("n1", "normal"),
                ("n2", "normal"), ("b1", "batch"), ("b2", "batch")]
    # The listing as status reads it, once every waiter has settled where it waits (on
    # PostgreSQL a host's head moves to the server's queue as a higher class arrives).
    wait_for(lambda: [(entry["session"], entry["class"]) for entry in queue(NO_AGING)]
             == expected, "the queue in class then arrival order")
    assert first.release() == 0
    finished(waiters)
    assert order.read_text().split() == ["i1", "i2", "n1", "n2", "b1", "b2"]


def test_status_shows_the_queue_in_order(store, holder, procs, tmp_path, lanelock):
    first = holder("-b", BACKEND, "-s", "first")
    waiters = [queued(procs, tmp_path / "order", name, klass, NO_AGING)
               for name, klass in (("cron", "batch"), ("chat", "interactive"))]
    shown = json.loads(lanelock("status", "--json", env=NO_AGING).stdout)["lanes"][0]["queue"]
    assert [(entry["position"], entry["session"], entry["class"], entry["effective_class"])
            for entry in shown] == [(1, "chat", "interactive", "interactive"),
                                    (2, "cron", "batch", "batch")]
    assert [entry["pid"] for entry in shown] == [waiters[1].pid, waiters[0].pid]
    assert all(entry["waited"] >= 0 for entry in shown)
    plain = lanelock("status", env=NO_AGING).stdout
    # a line per waiter, in order (after the lane's line: its waiters, then its engine)
    assert re.search(r"\[2 waiting\](; engine[^\n]*)?\n  1\. interactive pid ", plain), plain
    assert plain.index("session chat") < plain.index("session cron")
    assert first.release() == 0
    finished(waiters)


# A waiter frozen in the moment between a release and its take: its real queue entry (the flock
# store's Queue.join), held by a process that never walks on (it waits for a line on stdin).
FROZEN = """
import os, sys
from lanelock.store.flock.queue import Queue
root = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)
ticket = Queue(root, sys.argv[2], 3600.0).join(int(sys.argv[3]), {"session": "frozen"})
print("queued", flush=True)
sys.stdin.readline()
ticket.leave()
"""


def test_a_turn_arriving_at_a_free_lane_does_not_barge_past_a_waiter(holder, procs, tmp_path,
                                                                       lanelock, lock_dir):
    """The moment between a release and the woken waiter's take, frozen: a waiter queued (normal)
    that has not taken the free lane yet. A deflect-mode turn of its class or lower finds the
    lane free yet deflects, naming the waiter the lane goes to; one of a higher class takes it.
    (It was frozen with SIGSTOP; a stopped waiter is now passed over: test_order.py.)"""
    first = holder("-b", BACKEND, "-s", "first")
    frozen = procs.start([sys.executable, "-c", FROZEN, str(lock_dir), STEM, "1"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert frozen.stdout.readline() == "queued\n"
    assert first.release() == 0
    for klass in ("normal", "batch"):
        barging = lanelock("run", "-b", BACKEND, "--priority", klass, "--", "true", env=NO_AGING)
        assert barging.returncode == 75, barging.stderr
        assert "local_backend_busy" in barging.stderr
        assert f"pid {frozen.pid}, session frozen" in barging.stderr, barging.stderr
        assert "first in the queue (normal)" in barging.stderr, barging.stderr
    higher = lanelock("run", "-b", BACKEND, "--priority", "interactive", "--", "true",
                      env=NO_AGING)
    assert higher.returncode == 0, higher.stderr
    frozen.stdin.write("go\n")
    frozen.stdin.flush()
    assert frozen.wait(TIMEOUT) == 0


def test_aging_puts_a_long_waiting_batch_turn_ahead_of_later_interactive_ones(holder, procs,
                                                                             tmp_path):
    """A batch turn that waited two aging steps counts as interactive, and came first."""
    aging = {"LANELOCK_PRIORITY_AGING": "0.5"}
    order = tmp_path / "order"
    first = holder("-b", BACKEND, "-s", "first")
    batch = queued(procs, order, "batch", "batch", aging)
    wait_for(lambda: queue(aging)[0]["effective_class"] == "interactive",
             "the batch turn to age two steps")
    later = [queued(procs, order, f"chat{index}", "interactive", aging) for index in range(3)]
    assert [entry["session"] for entry in queue(aging)] == ["batch", "chat0", "chat1", "chat2"]
    assert first.release() == 0
    finished([batch, *later])
    assert order.read_text().split() == ["batch", "chat0", "chat1", "chat2"]


@pytest.mark.slow   # the default tier's time: the slow tier (CI) runs it
def test_aging_lets_a_batch_turn_through_a_steady_stream_of_interactive_ones(holder, procs,
                                                                             tmp_path, lanelock):
    """Interactive turns keep arriving, each holding a moment, more than the lane can serve:
    without aging the batch turn would wait for ever. It waits at most about two aging steps
    plus the holds ahead of it."""
    aging = {"LANELOCK_PRIORITY_AGING": "1"}
    order = tmp_path / "order"
    first = holder("-b", BACKEND, "-s", "first")
    batch = queued(procs, order, "batch", "batch", aging)
    stream, stop = [], threading.Event()

    def keep_arriving():
        index = 0
        while not stop.is_set() and index < 40:
            stream.append(procs.start(
                [*LANELOCK, "run", "--wait", "120", "--priority", "interactive",
                 "-s", f"chat{index}", "-b", BACKEND, "--", "sh", "-c",
                 f'echo chat{index} >> "$0"; sleep 0.2', str(order)],
                env={**os.environ, **aging}, stderr=subprocess.DEVNULL))
            index += 1
            stop.wait(0.1)   # two arrivals per hold: the stream outpaces the lane

    arrivals = threading.Thread(target=keep_arriving)
    arrivals.start()
    try:
        wait_for(lambda: len(queue(aging)) >= 3, "interactive turns to queue")
        assert first.release() == 0
        assert batch.wait(TIMEOUT) == 0, batch.stderr.read()
    finally:
        stop.set()
        arrivals.join()
    for turn in stream:
        turn.wait(TIMEOUT)
    events = [json.loads(line) for line in (tmp_path / "locks" / f"{STEM}.journal")
              .read_text().splitlines()]
    waited = [event for event in events if event["event"] == "waited"
              and event["session"] == "batch"]
    assert waited and waited[0]["priority"] == "batch"
    # Two steps of 1 s, then the interactive turns that arrived before it counted as one of
    # them (each holds ~0.2 s): well under the 8 s the stream lasts.
    assert waited[0]["waited"] < 6, waited
    served = order.read_text().split()
    assert served.index("batch") < len(served) - 1, "the batch turn went last: no aging"


def test_kill_9_of_a_queued_waiter_or_of_the_holder_never_stalls_the_queue(store, holder, procs,
                                                                          tmp_path):
    order = tmp_path / "order"
    first = holder("-b", BACKEND, "-s", "first")
    doomed = queued(procs, order, "doomed", "interactive", NO_AGING)
    second = queued(procs, order, "second", "normal", NO_AGING)
    third = queued(procs, order, "third", "batch", NO_AGING)
    os.kill(doomed.pid, signal.SIGKILL)   # the first in the queue dies while waiting
    doomed.wait(TIMEOUT)
    wait_for(lambda: [entry["session"] for entry in queue(NO_AGING)] == ["second", "third"],
             "the dead waiter to leave the queue")
    os.kill(first.pid, signal.SIGKILL)    # and the holder dies holding
    finished([second, third])
    assert order.read_text().split() == ["second", "third"]


JOIN_MIDWAY = """
import os, signal, sys
from lanelock.store.flock.queue import Queue
queue = Queue(os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY), sys.argv[2], 3600)
queue.open(create=True)
print(queue.locked_file(b"{}\\n")[0], flush=True)   # made and locked, not yet named an entry
if sys.argv[3] == "killed":
    os.kill(os.getpid(), signal.SIGKILL)
sys.stdin.read()
"""


def test_a_join_killed_before_its_entry_was_named_leaves_no_file_for_good(holder, procs,
                                                                         tmp_path, lock_dir):
    """A turn killed -9 in the middle of joining the queue (its file made and locked, not yet
    renamed into the queue) leaves a file no listing counts and nothing else would remove; the
    next waiting turn's look removes it once it is unlocked and old. A join still going on keeps
    its file locked, and keeps it, however old."""
    first = holder("-b", BACKEND, "-s", "first")
    made = {}
    for how in ("killed", "joining"):
        join = procs.start([sys.executable, "-c", JOIN_MIDWAY, str(lock_dir), STEM, how],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        made[how] = (lock_dir / f"{STEM}.queue" / join.stdout.readline().strip(), join)
    made["killed"][1].wait(TIMEOUT)
    for path, _ in made.values():
        os.utime(path, (path.stat().st_atime - 60, path.stat().st_mtime - 60))
    order = tmp_path / "order"
    waiter = queued(procs, order, "waiter", "normal", NO_AGING)
    wait_for(lambda: not made["killed"][0].exists(), "the killed join's file to be removed")
    assert first.release() == 0
    finished([waiter])
    assert made["joining"][0].exists()
    made["joining"][1].stdin.close()
    assert made["joining"][1].wait(TIMEOUT) == 0


def test_threads_of_one_process_wait_in_class_order(holder, tmp_path):
    first = holder("-b", BACKEND, "-s", "first")
    os.environ["LANELOCK_PRIORITY_AGING"] = "3600"
    try:
        gate = Gate(BACKEND)
        served, threads = [], []

        def take(name, klass):
            with gate.turn(session=name, wait=None, priority=klass) as turn:
                assert turn.held
                served.append(name)

        for name, klass in (("b", "batch"), ("n", "normal"), ("i", "interactive")):
            before = len(gate.store.survey(gate.lane)[0].queue)
            thread = threading.Thread(target=take, args=(name, klass))
            thread.start()
            threads.append(thread)
            wait_for(lambda: len(gate.store.survey(gate.lane)[0].queue) > before,
                     f"{name} to queue")
        assert first.release() == 0
        for thread in threads:
            thread.join(TIMEOUT)
    finally:
        os.environ.pop("LANELOCK_PRIORITY_AGING", None)
    assert served == ["i", "n", "b"]


def test_history_records_each_turns_class_and_wait(holder, procs, tmp_path, lanelock):
    first = holder("-b", BACKEND, "-s", "first")
    waiter = queued(procs, tmp_path / "order", "cron", "batch", NO_AGING)
    assert first.release() == 0
    finished([waiter])
    events = json.loads(lanelock("history", "--json").stdout)["events"]
    mine = {event["event"]: event for event in events if event["session"] == "cron"}
    assert mine["waited"]["priority"] == "batch" and mine["waited"]["waited"] > 0
    assert mine["acquired"]["priority"] == "batch"


def test_a_bad_class_flag_is_a_usage_error_and_a_bad_variable_the_default(lanelock):
    done = lanelock("run", "--priority", "urgent", "--", "true")
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and "urgent" in done.stderr
    assert "Traceback" not in done.stderr
    # a crontab's typo must not stop the job: normal, with one warning
    done = lanelock("run", "--", "printenv", "LANELOCK_STATE", env={"LANELOCK_PRIORITY": "urgent"})
    assert (done.returncode, done.stdout) == (0, "held\n"), done.stderr
    assert done.stderr.count("\n") == 1 and "urgent" in done.stderr and "'normal'" in done.stderr


def test_a_class_is_read_whatever_its_case(lanelock, procs):
    """Odd spellings of the same class: the flag, the environment, the config file, the proxy's
    flags and the API all read INTERACTIVE, Batch and ' normal ' as the class they name, and the
    records say it in one spelling."""
    spellings = [(("--priority", "INTERACTIVE"), None, "interactive"),
                 ((), {"LANELOCK_PRIORITY": "Batch"}, "batch")]
    for args, env, klass in spellings:
        done = lanelock("run", *args, "-s", klass, "--", "true", env=env)
        assert done.returncode == 0, done.stderr
    assert lanelock("config", "set", "priority", "Interactive").returncode == 0
    done = lanelock("run", "-s", "from-config", "--", "true")
    assert done.returncode == 0, done.stderr
    with Gate(BACKEND).turn(session="api", priority=" NORMAL ") as turn:
        assert turn.held and turn.priority == "normal"
    events = json.loads(lanelock("history", "--json").stdout)["events"]
    said = {event["session"]: event["priority"] for event in events
            if event["event"] == "acquired"}
    assert said == {"interactive": "interactive", "batch": "batch",
                    "from-config": "interactive", "api": "normal"}, said
    from support.proxy import Proxy

    proxy = Proxy(procs, BACKEND, "--priority", "BATCH", "--max-priority", "Normal")
    assert "Invalid value" not in proxy.stderr()


def test_a_broken_queue_fails_open_to_the_kernels_order_with_one_warning(holder, procs,
                                                                        lock_dir):
    first = holder("-b", BACKEND, "-s", "first")
    (lock_dir / f"{STEM}.queue").write_text("not a directory\n")
    waiter = procs.start([*LANELOCK, "run", "--wait", "60", "-b", BACKEND, "--", "true"],
                         stderr=subprocess.PIPE, text=True)
    assert first.release() == 0
    assert waiter.wait(TIMEOUT) == 0
    said = waiter.stderr.read()
    assert said.count("\n") == 1 and "queue" in said and "unavailable" in said, said


def test_metrics_count_waiters_and_waits_by_class(holder, procs, tmp_path, lanelock):
    pytest.importorskip("prometheus_client")
    first = holder("-b", BACKEND, "-s", "first")
    waiters = [queued(procs, tmp_path / "order", name, klass, NO_AGING)
               for name, klass in (("cron", "batch"), ("chat", "interactive"),
                                   ("scan", "batch"))]
    during = lanelock("metrics", "-b", BACKEND, env=NO_AGING).stdout
    assert 'lanelock_lane_queued{class="batch",lane="localhost:8080"} 2.0' in during
    assert 'lanelock_lane_queued{class="interactive",lane="localhost:8080"} 1.0' in during
    assert 'lanelock_lane_queued{class="normal",lane="localhost:8080"} 0.0' in during
    assert first.release() == 0
    finished(waiters)
    after = lanelock("metrics", "-b", BACKEND).stdout
    assert 'lanelock_lane_class_wait_seconds_count{class="batch",lane="localhost:8080"} 2.0' \
        in after
    assert 'lanelock_lane_class_wait_seconds_count{class="interactive",lane="localhost:8080"} ' \
        '1.0' in after
    assert 'lanelock_lane_queued{class="batch",lane="localhost:8080"} 0.0' in after


def test_asyncio_tasks_wait_in_class_order(holder):
    """Tasks of one event loop queue like processes: by class, then arrival."""
    import asyncio

    first = holder("-b", BACKEND, "-s", "first")
    os.environ["LANELOCK_PRIORITY_AGING"] = "3600"
    try:
        gate = Gate(BACKEND)
        served = []

        async def take(name, klass):
            async with gate.turn(session=name, wait=None, priority=klass) as turn:
                assert turn.held
                served.append(name)

        def queued_now() -> int:
            return len(gate.store.survey(gate.lane)[0].queue)

        async def main():
            tasks = []
            for name, klass in (("b", "batch"), ("n1", "normal"), ("i", "interactive"),
                                ("n2", "normal")):
                before = queued_now()
                tasks.append(asyncio.ensure_future(take(name, klass)))
                await asyncio.to_thread(wait_for, lambda: queued_now() > before,
                                        f"{name} to queue")
            await asyncio.to_thread(first.release)
            await asyncio.gather(*tasks)

        asyncio.run(main())
    finally:
        os.environ.pop("LANELOCK_PRIORITY_AGING", None)
    assert served == ["i", "n1", "n2", "b"]


@pytest.mark.skipif(not shutil.which("strace"), reason="needs strace")
def test_a_deflection_never_reads_proc_locks(holder, procs, tmp_path, run_cmd):
    """A turn that deflects named its holder from /proc/locks (and its queue from it
    too), a cold read of 8-15 ms that stalls every flock() on the machine -- the hand-off under
    way included (bench measure 9: +3.7 ms above flock(1) with turns deflecting, +2.0 without).
    It now names the holder from its record (a live turn's, on this lock file) and asks each queue
    entry itself; the line says the same."""
    held = holder("-b", BACKEND, "-s", "first")
    waiter = queued(procs, tmp_path / "order", "waiter", "normal", NO_AGING)
    trace = tmp_path / "trace"
    done = run_cmd(["strace", "-f", "-qq", "-e", "trace=openat,open", "-o", str(trace),
                    *LANELOCK, "run", "-b", BACKEND, "--", "true"], env={**os.environ, **NO_AGING})
    assert done.returncode == 75, done.stderr
    assert f"pid {held.pid}, session first" in done.stderr, done.stderr
    assert "/proc/locks" not in trace.read_text()
    assert held.release() == 0
    finished([waiter])


@pytest.mark.skipif(not shutil.which("strace"), reason="needs strace")
def test_a_waiting_turn_never_reads_proc_locks(holder, procs, tmp_path):
    """The waiter that got the lane read /proc/locks to see which queue entries lived
    (8-15 ms cold, every flock() on the machine waiting meanwhile). A waiter queued behind
    another, then first, then holding: each entry is asked itself, and /proc/locks never."""
    order, trace = tmp_path / "order", tmp_path / "trace"
    held = holder("-b", BACKEND, "-s", "first")
    ahead = queued(procs, order, "ahead", "normal", NO_AGING)
    behind = queued(procs, order, "behind", "normal", NO_AGING,
                    prefix=["strace", "-f", "-qq", "-e", "trace=openat,open", "-o", str(trace)])
    assert held.release() == 0
    finished([ahead, behind])
    assert order.read_text().split() == ["ahead", "behind"]
    assert "/proc/locks" not in trace.read_text()
