"""Nesting by hand-over only: a process is part of a turn only when the turn
handed it over -- `lanelock run`'s command and its descendants, or a subprocess given `turn.env`.

Every way in that ancestry alone used to let through is tried with real processes: a job started
a moment before the turn, a multiprocessing spawn worker started before it, a `lanelock run` from
another thread, a child handed an earlier turn of the same process, a daemon left behind by an
ended turn, a copied token in a process outside the holder's tree. Each must find the lane busy;
a subprocess given `turn.env` (sync, asyncio, PostgreSQL) runs straight through as part of it.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import subprocess
import sys
import threading

import pytest

from support.cli import LANELOCK, STEM, TIMEOUT
from support.processes import read_line
from lanelock import Gate

BACKEND = "127.0.0.1:8080"
STATE = [*LANELOCK, "run", "-b", BACKEND, "--", "printenv", "LANELOCK_STATE"]
# A job that waits for "go" on stdin, then takes a turn of its own and prints its state.
WAITING_JOB = ["sh", "-c", 'read go; exec "$@"', "job", *STATE]


def journal_pids(lock_dir) -> set[int]:
    import json

    path = lock_dir / f"{STEM}.journal"
    if not path.exists():
        return set()
    return {json.loads(line)["pid"] for line in path.read_text().splitlines() if line.strip()}


def start_waiting_job(procs, env=None):
    return procs.start(WAITING_JOB, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True, env=env)


def go(job) -> tuple[int, str, str]:
    out, err = job.communicate("go\n", timeout=TIMEOUT)
    return job.returncode, out.strip(), err


def test_a_job_started_before_the_turn_is_not_part_of_it(procs, lock_dir):
    job = start_waiting_job(procs)
    with Gate(BACKEND).turn() as turn:
        assert turn.held
        status, out, err = go(job)
    assert (status, out) == (75, ""), err
    assert "local_backend_busy" in err


def _spawned_turn(ready, start, answer) -> None:
    ready.set()
    start.wait(TIMEOUT)
    with Gate(BACKEND).turn() as turn:
        answer.put(turn.state)


def test_a_spawn_worker_started_before_the_turn_is_not_part_of_it(lock_dir):
    context = multiprocessing.get_context("spawn")
    ready, start, answer = context.Event(), context.Event(), context.Queue()
    worker = context.Process(target=_spawned_turn, args=(ready, start, answer))
    worker.start()
    try:
        assert ready.wait(TIMEOUT)
        with Gate(BACKEND).turn() as turn:
            assert turn.held
            start.set()
            assert answer.get(timeout=TIMEOUT) == "deflected"
    finally:
        worker.join(TIMEOUT)
        if worker.is_alive():
            worker.kill()
            worker.join()


def test_a_run_started_by_another_thread_is_not_part_of_the_turn(procs):
    results = []

    def other_thread() -> None:
        proc = procs.start(STATE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = proc.communicate(timeout=TIMEOUT)
        results.append((proc.returncode, out.strip(), err))

    with Gate(BACKEND).turn() as turn:
        assert turn.held
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join(TIMEOUT)
    assert len(results) == 1 and results[0][:2] == (75, ""), results


def test_a_subprocess_given_turn_env_is_part_of_the_turn(lanelock, lock_dir):
    with Gate(BACKEND).turn() as turn:
        env = turn.env
        assert env["LANELOCK_STATE"] == "held" and env["LANELOCK_LANE"] == "localhost:8080"
        done = lanelock("run", "-b", "localhost:8080", "-v", "--", "sh", "-c",
                        # and what that command starts, through another nested run
                        f"{' '.join(LANELOCK)} run -b '[::1]:8080' -- printenv LANELOCK_STATE",
                        env=env)
        assert (done.returncode, done.stdout.strip()) == (0, "held"), done.stderr
        assert "nested in the holder's turn" in done.stderr
        # the documented spelling: the caller's environment plus the hand-over
        direct = subprocess.run(STATE, env={**os.environ, **turn.env}, capture_output=True,
                                text=True, timeout=TIMEOUT)
        assert (direct.returncode, direct.stdout.strip()) == (0, "held"), direct.stderr
    # nothing journaled by the nested turns: one turn, the holder's
    assert journal_pids(lock_dir) == {os.getpid()}


def test_a_child_handed_an_earlier_turn_is_not_part_of_the_next(procs, lock_dir):
    """The same holder process, its own child, the previous turn's token: only the token tells
    that the turn it was handed has ended."""
    gate = Gate(BACKEND)
    with gate.turn() as first:
        job = start_waiting_job(procs, env={**os.environ, **first.env})
    with gate.turn() as second:
        assert second.held and second.token != first.token
        status, out, err = go(job)
    assert (status, out) == (75, ""), err


def test_a_daemon_left_by_an_ended_turn_finds_the_next_holder_busy(procs, holder):
    with Gate(BACKEND).turn() as turn:
        daemon = start_waiting_job(procs, env={**os.environ, **turn.env})
    other = holder("-b", BACKEND)
    status, out, err = go(daemon)
    assert (status, out) == (75, ""), err
    assert other.release() == 0


def test_a_copied_token_outside_the_holders_tree_does_not_nest(holder, lanelock):
    """The token is read from inside the holder's tree and given to a process outside it (this
    test's own children are not the holder's descendants)."""
    held = holder("-b", BACKEND, command=["sh", "-c", 'echo "ready $$"; echo "$LANELOCK_TURNS";'
                                          ' read code; exit "${code:-0}"'])
    token = held.read_line().strip()
    assert len(token) == 32
    copied = lanelock("run", "-b", BACKEND, "--", "true", env={"LANELOCK_TURNS": token})
    assert copied.returncode == 75, copied.stderr
    assert held.release() == 0


def test_a_command_of_the_wrapper_hands_the_turn_to_its_descendants(lanelock):
    done = lanelock("run", "-b", BACKEND, "--", "sh", "-c",
                    f"sh -c '{' '.join(LANELOCK)} run -b localhost:8080 -- printenv LANELOCK_STATE'")
    assert (done.returncode, done.stdout.strip()) == (0, "held"), done.stderr


def test_the_same_thread_reentering_its_turn_nests_and_hands_over_the_same_turn(lanelock):
    gate = Gate(BACKEND)
    with gate.turn() as outer:
        with gate.turn() as inner:
            assert inner.held and inner.nested and inner.token == outer.token
            done = lanelock(*STATE[3:], env=inner.env)
            assert (done.returncode, done.stdout.strip()) == (0, "held"), done.stderr


def test_turn_env_of_a_turn_that_did_not_hold_hands_nothing_over(holder):
    held = holder("-b", BACKEND)
    with Gate(BACKEND).turn() as turn:
        assert turn.state == "deflected"
        assert "LANELOCK_TURNS" not in turn.env
        assert turn.env["LANELOCK_FAILOVER_REASON"] == "local_backend_busy"
    assert held.release() == 0


def test_an_asyncio_turn_hands_over_through_turn_env_and_only_through_it(lock_dir):
    async def main():
        async with Gate(BACKEND).turn() as turn:
            assert turn.held
            handed = await asyncio.create_subprocess_exec(
                *STATE, env={**os.environ, **turn.env}, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE)
            other = await asyncio.create_subprocess_exec(
                *STATE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            results = []
            for proc in (handed, other):
                out, err = await asyncio.wait_for(proc.communicate(), TIMEOUT)
                results.append((proc.returncode, out.decode().strip()))
            return results

    assert asyncio.run(main()) == [(0, "held"), (75, "")]


def test_the_hand_over_on_the_postgresql_store(postgres, monkeypatch, procs):
    monkeypatch.setenv("LANELOCK_STORE", postgres.dsn)
    port = 20000 + os.getpid() % 20000
    backend = f"127.0.0.1:{port}"
    argv = [*LANELOCK, "run", "-b", backend, "--", "printenv", "LANELOCK_STATE"]
    gate = Gate(backend)
    with gate.turn() as first:
        assert first.held
        handed = subprocess.run(argv, env={**os.environ, **first.env}, capture_output=True,
                                text=True, timeout=TIMEOUT)
        outside = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT)
        stale = procs.start(["sh", "-c", 'read go; exec "$@"', "job", *argv],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, **first.env})
    assert (handed.returncode, handed.stdout.strip()) == (0, "held"), handed.stderr
    assert outside.returncode == 75, outside.stderr
    with gate.turn() as second:
        assert second.held
        status, out, err = go(stale)
    assert (status, out) == (75, ""), err


def test_the_hand_over_variable_stays_bounded_through_many_lanes(lanelock):
    """Each held lane adds its token; an inherited list is kept to the last 16 turns."""
    from lanelock import handover

    value = None
    for number in range(40):
        value = handover.with_token(value, f"{number:032x}")
    assert len(value.split()) == 16 and value.split()[-1] == f"{39:032x}"
