"""The store contract (lanelock/store/base.py), held to the same tests on every store: flock(2),
PostgreSQL, and support/contract_store.py -- a store of the twelve abstract methods alone, on a
medium neither real store uses (OFD record locks). What passes on all three is what the gate, the
judge and the read commands get from any store that keeps the contract.

Turns are taken by real processes (support/store_driver.py) and by this one; nothing here reaches
into a store's own files or tables."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from support.cli import TIMEOUT
from lanelock import Gate
from lanelock.inspection.status import statuses
from lanelock.store.base import LaneStore
from support.contract_store import ContractStore

DRIVER = str(Path(__file__).parent / "support" / "store_driver.py")
STORES = ["flock", "postgresql", "contract"]


@pytest.fixture(params=STORES)
def store(request, tmp_path):
    """(kind, where): the lock root, the store URL, or the contract store's directory."""
    kind = request.param
    if kind == "postgresql":
        return kind, request.getfixturevalue("postgres").dsn
    return kind, str(tmp_path / kind)


@pytest.fixture
def backend(request) -> str:
    # One lane per test: the PostgreSQL server is shared by the whole session.
    return f"127.0.0.1:{20000 + abs(hash(request.node.nodeid)) % 20000}"


def gate(store, backend) -> Gate:
    kind, where = store
    if kind == "contract":
        return Gate(backend, lane_store=ContractStore(where))
    if kind == "postgresql":
        return Gate(backend, store=where)
    return Gate(backend, lock_dir=where)


def driver(store, backend, *args) -> list[str]:
    return [sys.executable, DRIVER, *store, backend, *args]


def hold(procs, store, backend, session="holder"):
    """A process holding the lane until its stdin gets a line; (process, its pid)."""
    holder = procs.start(driver(store, backend, "hold", session), stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    line = holder.stdout.readline()
    assert line.startswith("held "), line
    return holder, int(line.split()[1])


def let_go(holder) -> None:
    holder.stdin.write("go\n")
    holder.stdin.flush()
    assert holder.wait(TIMEOUT) == 0


def turn(procs, store, backend, session="asker", wait="0") -> dict:
    asker = procs.start(driver(store, backend, "turn", session, wait), stdout=subprocess.PIPE,
                        text=True)
    out, _ = asker.communicate(timeout=TIMEOUT)
    assert asker.returncode == 0
    return json.loads(out)


def test_the_contract_store_is_made_of_the_abstract_methods_alone():
    """The proof holds only if the contract store leans on no default: it defines exactly the
    abstract methods, and they are about a dozen."""
    abstract = LaneStore.__abstractmethods__
    assert len(abstract) <= 13, sorted(abstract)
    own = {name for name, value in vars(ContractStore).items()
           if callable(value) and not name.startswith("_")} - {"offset"}
    assert own == set(abstract)


def test_one_holder_and_the_other_deflects_naming_it(store, backend, procs):
    holder, pid = hold(procs, store, backend)
    deflected = turn(procs, store, backend)
    assert deflected["state"] == "deflected" and deflected["reason"] == "local_backend_busy"
    assert deflected["holder"]["pid"] == pid and deflected["holder"]["session"] == "holder"
    let_go(holder)
    assert turn(procs, store, backend)["state"] == "held"


def test_a_waiting_turn_gets_the_lane_when_the_holder_lets_go(store, backend, procs):
    holder, _ = hold(procs, store, backend)
    waiter = procs.start(driver(store, backend, "turn", "waiter", "forever"),
                         stdout=subprocess.PIPE, text=True)
    let_go(holder)
    out, _ = waiter.communicate(timeout=TIMEOUT)
    assert json.loads(out)["state"] == "held"


def test_a_wait_that_times_out_deflects(store, backend, procs):
    holder, pid = hold(procs, store, backend)
    timed = turn(procs, store, backend, wait="0.5")
    assert timed["state"] == "deflected" and timed["holder"]["pid"] == pid
    assert timed["waited"] >= 0.45
    let_go(holder)


def test_kill_9_of_the_holder_frees_the_lane_and_status_says_it_died(store, backend, procs):
    holder, pid = hold(procs, store, backend)
    os.kill(pid, signal.SIGKILL)
    holder.wait(TIMEOUT)
    after = turn(procs, store, backend, wait="10")   # the store's own janitor: no reaper
    assert after["state"] == "held"
    lane = gate(store, backend)
    [status] = statuses(lane.store, lane.lane)
    assert status["verdict"] == "released"   # the asker's own turn, released cleanly
    events, _ = lane.store.events(lane.lane, None)
    assert [event["pid"] for event in events if event["event"] == "acquired"][-2:] == \
        [pid, after["pid"]]


def test_status_names_the_holder_then_the_release(store, backend, procs):
    lane = gate(store, backend)
    [before] = statuses(lane.store, lane.lane)
    assert before["state"] == "free" and before["verdict"] == "never-used"
    holder, pid = hold(procs, store, backend)
    [held] = statuses(lane.store, lane.lane)
    assert held["state"] == "held" and held["verdict"] == "held"
    assert held["holder"]["pid"] == pid and held["holder"]["session"] == "holder"
    assert lane.busy() is True and lane.probe()["state"] == "busy"
    assert lane.probe()["holder"]["pid"] == pid
    let_go(holder)
    [released] = statuses(lane.store, lane.lane)
    assert released["verdict"] == "released" and released["last"]["pid"] == pid
    assert lane.busy() is False and lane.probe()["state"] == "free"
    assert lane.lane.name in lane.store.lane_names()


def test_a_dead_holders_record_is_judged_died(store, backend, procs):
    holder, pid = hold(procs, store, backend)
    os.kill(pid, signal.SIGKILL)
    holder.wait(TIMEOUT)
    lane = gate(store, backend)
    [status] = statuses(lane.store, lane.lane)
    assert status["state"] == "free" and status["verdict"] == "died", status


def test_events_and_counts_of_held_and_deflected_turns(store, backend, procs):
    holder, pid = hold(procs, store, backend)
    turn(procs, store, backend, session="deflected-one")
    let_go(holder)
    lane = gate(store, backend)
    events, bad = lane.store.events(lane.lane, None)
    assert bad == 0
    kinds = [(event["event"], event["session"]) for event in events]
    assert kinds == [("acquired", "holder"), ("deflected", "deflected-one"),
                     ("released", "holder")]
    [facts] = lane.store.survey(lane.lane)
    counts = lane.store.counts(facts)
    assert counts["turns"]["local"] == 1 and counts["turns"]["deflected"] == 1
    assert counts["hold"]["count"] == 1


def test_the_same_thread_nests_another_thread_deflects(store, backend):
    lane = gate(store, backend)
    seen = {}
    with lane.turn(session="outer") as outer:
        with lane.turn(session="inner") as inner:
            assert outer.held and inner.held and inner.nested

        def other():
            with lane.turn(session="other") as turn_:
                seen["other"] = turn_.state

        thread = threading.Thread(target=other)
        thread.start()
        thread.join(TIMEOUT)
    assert seen["other"] == "deflected"
    # The flock store's waiter thread, left blocked by the deflected turn, takes the lock at the
    # release and lets go at once (store/flock/waiting.py): done before the teardown looks at the lane.
    for waiter in [t for t in threading.enumerate() if t.name == "lanelock-wait"]:
        waiter.join(TIMEOUT)


def test_only_a_process_handed_the_turn_is_part_of_it(store, backend, procs):
    asker = procs.start(driver(store, backend, "handover", "parent"), stdout=subprocess.PIPE,
                        text=True)
    out, _ = asker.communicate(timeout=TIMEOUT)
    children = json.loads(out)
    assert children["handed"]["state"] == "held" and children["handed"]["nested"]
    assert children["plain"]["state"] == "deflected"


def test_asyncio_tasks_take_turns_one_at_a_time(store, backend):
    lane = gate(store, backend)
    inside, most = [0], [0]

    async def one(index):
        async with lane.turn(session=f"task-{index}", wait=None) as turn_:
            assert turn_.held
            inside[0] += 1
            most[0] = max(most[0], inside[0])
            await asyncio.sleep(0.005)
            inside[0] -= 1

    async def main():
        await asyncio.gather(*[one(index) for index in range(8)])

    asyncio.run(main())
    assert most[0] == 1
