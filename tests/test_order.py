"""One order above every store (store/order.py): the waiting walk is the same on the
flock store, on PostgreSQL, and on support/contract_store.py's store given only a medium for it
(OrderedContractStore), so the same real-process scenes hold on all three.

The scene that stalled (2538e49) and deadlocked PostgreSQL: an aging step that falls between the
look a waiter takes at the order and the wait that look decides. support/order_driver.py holds a
waiter up, after its look, until its own next step has passed -- the hook store/order.py keeps for
this (after_look), so the product itself never sleeps for it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.cli import LANELOCK, TIMEOUT

ORDER_DRIVER = str(Path(__file__).parent / "support" / "order_driver.py")
STORE_DRIVER = str(Path(__file__).parent / "support" / "store_driver.py")
AGING = 2.0   # long enough for three started processes to queue before the first step
ARRIVALS_APART = 0.7


@pytest.fixture(params=["flock", "postgresql", "contract-ordered"])
def store(request, tmp_path):
    """contract-ordered: support/contract_store.py's store given a medium for the order (its
    ContractLine) and nothing of the policy -- the same scene holds on it."""
    if request.param == "postgresql":
        return request.param, request.getfixturevalue("postgres").dsn
    return request.param, str(tmp_path / "root")


@pytest.fixture
def backend(request) -> str:
    return f"127.0.0.1:{20000 + abs(hash(request.node.nodeid)) % 20000}"


def waiter(procs, store, backend, session, priority, *mode):
    return procs.start([sys.executable, ORDER_DRIVER, *store, backend, session, priority, *mode],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def ready(procs, store, backend, session, priority, *mode):
    """A waiter started and imported, joining the queue only at go(): the scene's clock starts
    after every interpreter has started, however loaded the machine."""
    process = procs.start([sys.executable, ORDER_DRIVER, *store, backend, session, priority,
                           *mode, "ready"],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)
    assert line(process) == {"ready": True}
    return process


def go(process):
    process.stdin.write("go\n")
    process.stdin.flush()
    return process


def holding(procs, store, backend):
    """A process holding the lane until let_go()."""
    holder = procs.start([sys.executable, STORE_DRIVER, *store, backend, "hold", "holder"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().startswith("held ")
    return holder


def let_go(holder) -> None:
    holder.stdin.write("go\n")
    holder.stdin.flush()
    assert holder.wait(TIMEOUT) == 0


def two_in_line(procs, store, backend) -> tuple:
    """Two normal waiters: the first waits for the lane, the second on the first's entry."""
    first = waiter(procs, store, backend, "w1", "normal")
    assert line(first)["look"] is None
    second = waiter(procs, store, backend, "w2", "normal")
    assert line(second)["look"] == str(first.pid)
    return first, second


def line(process) -> dict:
    text = process.stdout.readline()
    assert text, process.stderr.read()
    return json.loads(text)


def look_past(process, gone) -> dict:
    """The process's next look that does not find the killed waiter `gone` ahead."""
    while (found := line(process)).get("look") == str(gone.pid):
        pass
    return found


def until_held(process) -> dict:
    while "held" not in (found := line(process)):
        pass
    return found


def test_an_aging_step_between_a_look_and_its_wait_stalls_nobody(store, backend, procs,
                                                                  monkeypatch):
    monkeypatch.setenv("LANELOCK_PRIORITY_AGING", str(AGING))
    holder = holding(procs, store, backend)
    first = ready(procs, store, backend, "x", "interactive")
    normal = ready(procs, store, backend, "w2", "normal")
    batch = ready(procs, store, backend, "w1", "batch", f"stall-behind={normal.pid}")
    assert line(go(first))["look"] is None                  # X: first in the queue
    assert line(go(batch))["look"] == str(first.pid)        # W1 (batch) behind X
    time.sleep(ARRIVALS_APART)   # the clock: W2's own step comes well after W1's
    assert line(go(normal))["look"] == str(first.pid)       # W2 (normal) behind X, before W1
    os.kill(first.pid, signal.SIGKILL)
    first.wait(TIMEOUT)
    # Both wake. W2 is first now; W1 finds W2 ahead with its own step still to come -- and is
    # held up past that step, between the look and the wait. (A look may still find the killed
    # X ahead once, while the store sees it go: passed over.)
    assert look_past(normal, first)["look"] is None
    looked, looked_at = look_past(batch, first), time.monotonic()
    assert looked["look"] == str(normal.pid) and 0 < looked["step"] < AGING, looked
    # The holder lets go after W1's step, while W1 is still held up: W2 takes the lane, finds W1
    # (normal now, and come before it) ahead and lets go for it. W1, back from its look, must
    # look again at once -- its step has passed -- rather than wait on W2, who waits on it.
    # (A quarter second past the step: on PostgreSQL the step W2's look judges W1 by is the
    # server's reading of W1's wait, which can trail W1's own by tens of ms on a loaded machine --
    # 0.05 s once let W2 keep the lane; W1 stays held up for half a second past its step.)
    time.sleep(max(0.0, looked["step"] - (time.monotonic() - looked_at)) + 0.25)   # the clock
    released = time.monotonic()
    let_go(holder)
    one, two = until_held(batch), until_held(normal)
    assert one["state"] == two["state"] == "held"
    assert one["stalled"], "the step never fell between a look and its wait"
    assert released < one["at"] < two["at"]
    # The lane never sat free for a step: W1 had it as soon as the holder let go.
    assert one["at"] - released < AGING / 2
    for process in (batch, normal):
        assert process.wait(TIMEOUT) == 0
        err = process.stderr.read()
        assert "gate unavailable" not in err and "warning" not in err, err


def test_a_queue_that_breaks_while_a_turn_waits_never_lets_it_run_beside_the_holder(
        postgres, backend, procs):
    """A store error in the queue (here its table gone) while a turn waits behind another: the
    turn waits in the server's order for the lane itself, said once -- it never fails open while
    the holder still holds (it did: GateUnavailable from the queue's query, and the turn ran
    ungated)."""
    import psycopg

    store = ("postgresql", postgres.dsn)
    holder = holding(procs, store, backend)
    ahead, behind = two_in_line(procs, store, backend)
    with psycopg.connect(postgres.dsn, autocommit=True) as admin:
        admin.execute("ALTER TABLE lanelock_queue RENAME TO lanelock_queue_away")
        try:
            os.kill(ahead.pid, signal.SIGKILL)   # W2 wakes and looks at a queue that is gone
            ahead.wait(TIMEOUT)
            said = behind.stderr.readline()
            assert "queue unavailable" in said and "server's order" in said, said
        finally:
            admin.execute("DROP TABLE IF EXISTS lanelock_queue")
            admin.execute("ALTER TABLE lanelock_queue_away RENAME TO lanelock_queue")
    released = time.monotonic()
    let_go(holder)
    got = until_held(behind)
    assert got["state"] == "held" and got["at"] > released
    assert behind.wait(TIMEOUT) == 0
    assert "gate unavailable" not in behind.stderr.read()


@pytest.mark.parametrize("kind", ["flock", "postgresql", "contract-ordered"])
def test_a_stopped_waiter_is_passed_over_and_goes_next_once_continued(kind, tmp_path, backend,
                                                                     procs, request):
    """kill -STOP (or ^Z) of the first waiter held every turn back -- those queued
    behind it, and every plain turn (no barging past it) -- until someone found it. Passed over
    while stopped, it keeps its arrival and class and goes next once continued."""
    where = request.getfixturevalue("postgres").dsn if kind == "postgresql" \
        else str(tmp_path / "root")
    store = (kind, where)
    holder = holding(procs, store, backend)
    first, second = two_in_line(procs, store, backend)   # W2 waits on W1's entry
    os.kill(first.pid, signal.SIGSTOP)
    assert line(second)["look"] is None                 # W1 stopped: passed over (a timed look)
    if kind != "contract-ordered":   # the CLI opens the flock and PostgreSQL stores only
        where_flag = ["--store", where] if kind == "postgresql" else ["--lock-dir", where]
        metrics = subprocess.run([*LANELOCK, "metrics", "-b", backend, *where_flag],
                                 capture_output=True, text=True, timeout=TIMEOUT)
        assert f'lanelock_lane_waiters_stopped{{lane="' in metrics.stdout, metrics.stderr
        assert [line_ for line_ in metrics.stdout.splitlines()
                if line_.startswith("lanelock_lane_waiters_stopped{")][0].endswith(" 1.0")
    let_go(holder)
    assert until_held(second)["state"] == "held"
    assert second.wait(TIMEOUT) == 0
    plain = procs.start([sys.executable, STORE_DRIVER, *store, backend, "turn", "plain", "0"],
                        stdout=subprocess.PIPE, text=True)
    assert json.loads(plain.communicate(timeout=TIMEOUT)[0])["state"] == "held"
    os.kill(first.pid, signal.SIGCONT)                  # its place kept: it goes next
    assert until_held(first)["state"] == "held"
    assert first.wait(TIMEOUT) == 0


def plain_turn(procs, store, backend) -> dict:
    """One turn that does not wait (a try), of the default class: its facts."""
    plain = procs.start([sys.executable, STORE_DRIVER, *store, backend, "turn", "plain", "0"],
                        stdout=subprocess.PIPE, text=True)
    return json.loads(plain.communicate(timeout=TIMEOUT)[0])


def test_a_free_lane_is_not_taken_past_a_queued_waiter(store, backend, procs):
    """No barging, the same rule on every store: a waiter frozen between the look that makes it
    first and its take (the lane free, its entry queued) keeps the lane from a turn of its class
    that does not queue; once it walks on, it takes the lane."""
    holder = holding(procs, store, backend)
    first = procs.start([sys.executable, ORDER_DRIVER, *store, backend, "w1", "normal", "freeze"],
                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                        text=True)
    assert line(first)["look"] is None   # first, and frozen before its take
    let_go(holder)   # the lane free, the waiter still queued
    tried = plain_turn(procs, store, backend)
    assert tried["state"] != "held", tried
    first.stdin.write("go\n")
    first.stdin.flush()
    assert until_held(first)["state"] == "held"
    assert first.wait(TIMEOUT) == 0
    assert plain_turn(procs, store, backend)["state"] == "held"


def test_a_killed_turns_command_keeps_the_lane_until_it_ends(store, backend, procs):
    """The same rule on every store: a turn killed (kill -9) while its command runs on in a
    session of its own leaves the lane to no one until that command ends -- a try is busy, a
    waiter waits for it and takes the lane the moment it is gone."""
    killed = procs.start([sys.executable, STORE_DRIVER, *store, backend, "command", "killed"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    said = killed.stdout.readline().split()
    assert said[0] == "held", said
    command = int(said[2])
    try:
        os.kill(killed.pid, signal.SIGKILL)
        killed.wait(TIMEOUT)
        tried = plain_turn(procs, store, backend)
        assert tried["state"] != "held", tried
        waiting = procs.start([sys.executable, STORE_DRIVER, *store, backend, "turn", "next",
                               "60"], stdout=subprocess.PIPE, text=True)
        os.kill(command, signal.SIGKILL)
        assert json.loads(waiting.communicate(timeout=TIMEOUT)[0])["state"] == "held"
    finally:
        try:
            os.kill(command, signal.SIGKILL)
        except ProcessLookupError:
            pass
