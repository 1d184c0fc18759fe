"""The contention detector: many real `lanelock run` turns at one stand-in backend; the backend itself
counts generations in flight, so an overlap cannot hide behind the lock's own bookkeeping."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from lanelock import testing


@pytest.fixture
def backends():
    """A 'local' stand-in and a 'cloud' fallback, each in a server thread of the test process."""
    servers = [testing.make_server(0, delay, name) for delay, name in ((0.4, "local"), (0.05, "cloud"))]
    threads = [threading.Thread(target=server.serve_forever, daemon=True) for server in servers]
    for thread in threads:
        thread.start()
    yield servers
    for server in servers:
        server.shutdown()
        server.server_close()


def turn_argv(local_port: int, cloud_port: int) -> list[str]:
    client = [sys.executable, "-m", "lanelock.testing", "client"]
    fallback = " ".join(client + [f"http://127.0.0.1:{cloud_port}"])
    return [sys.executable, "-m", "lanelock", "run", "-b", f"127.0.0.1:{local_port}",
            "-f", fallback, "--"] + client + [f"http://127.0.0.1:{local_port}"]


def run_wave(procs, local, cloud, clients: int) -> list[subprocess.CompletedProcess]:
    """clients turns started at once, each run to its end."""
    argv = turn_argv(local.server_address[1], cloud.server_address[1])
    turns = [procs.start(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(clients)]
    results = []
    for turn in turns:
        out, err = turn.communicate(timeout=120)
        results.append(subprocess.CompletedProcess(argv, turn.returncode, out, err))
    return results


@pytest.mark.parametrize("clients", [6, 8])
def test_max_in_flight_is_one_and_the_rest_fall_back(backends, clients, procs):
    local, cloud = backends
    results = run_wave(procs, local, cloud, clients)
    assert all(r.returncode == 0 for r in results), [r.stderr for r in results]
    answers = [r.stdout.strip() for r in results]
    on_local = answers.count("answer from local")
    on_cloud = answers.count("answer from cloud")
    assert local.counter.max_in_flight == 1
    assert on_local + on_cloud == clients
    assert on_local >= 1 and on_cloud >= 1
    assert local.counter.total == on_local and cloud.counter.total == on_cloud
    deflected = [r for r in results if "answer from cloud" in r.stdout]
    assert all("local_backend_busy" in r.stderr and "local model in use by another session" in r.stderr
               for r in deflected)


@pytest.mark.slow
def test_stress_waves_never_overlap(backends, procs):
    local, cloud = backends
    total = 0
    for _ in range(10):
        results = run_wave(procs, local, cloud, 10)
        assert all(r.returncode == 0 for r in results)
        total += len(results)
    assert local.counter.max_in_flight == 1
    assert local.counter.total + cloud.counter.total == total


def test_stand_in_server_counts_overlap_without_the_gate(backends):
    """The detector itself must see an overlap when nothing gates the turns (else it proves nothing)."""
    local, _ = backends
    url = f"http://127.0.0.1:{local.server_address[1]}"
    barrier = threading.Barrier(4)
    answers = []

    def ask():
        barrier.wait(timeout=30)
        answers.append(testing.complete(url))

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert answers == ["answer from local"] * 4
    assert local.counter.max_in_flight >= 2
