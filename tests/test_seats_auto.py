"""`lanelock seats -b B auto`: the lane's seat count set to its engine's own slot count
(lanelock/engine_slots.py), read from a stand-in engine in its own process; where the engine
cannot tell, exit 69 with one line and the count left as it was."""

from __future__ import annotations

import os
import socket

import pytest

from support.standin_kind import Served


def test_seats_auto_sets_the_engines_slot_count(procs, tmp_path, lanelock):
    engine = Served(procs, tmp_path, "--kind", "llama.cpp", "--parallel", "3")
    done = lanelock("seats", "-b", engine.backend, "auto")
    assert (done.returncode, done.stderr) == (0, "")
    # what answered, said before the count is set from it: anything may answer on a port
    assert done.stdout == (f"localhost:{engine.port}: http://127.0.0.1:{engine.port}/props "
                           f"(llama.cpp): 3 slots\nlocalhost:{engine.port}: 3 seats (was 1)\n")
    assert lanelock("seats", "-b", engine.backend).stdout == "3\n"
    # Every process reads the same count: one with no environment but the lock root.
    again = lanelock("seats", "-b", engine.backend,
                     prefix=("env", "-i", f"LANELOCK_DIR={os.environ['LANELOCK_DIR']}"))
    assert again.stdout == "3\n"


def test_seats_auto_through_llama_swap_reads_the_running_model(procs, tmp_path, lanelock):
    engine = Served(procs, tmp_path, "--kind", "llama-swap", "--parallel", "2")
    done = lanelock("seats", "-b", engine.backend, "auto")
    assert done.returncode == 0, done.stderr
    assert lanelock("seats", "-b", engine.backend).stdout == "2\n"
    assert engine.stats()["loads"] == []


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("kind, why", [
    ("ollama", "Ollama does not say how many requests it serves at once"),
    ("vllm", "vLLM says its max_num_seqs only at /server_info"),
    ("garbage", "answered something that is not JSON"),
    (None, "Connection refused"),
])
def test_seats_auto_where_the_engine_cannot_tell_exits_69_and_keeps_the_count(
        procs, tmp_path, lanelock, kind, why):
    if kind is None:
        backend = f"127.0.0.1:{closed_port()}"
    else:
        backend = Served(procs, tmp_path, "--kind", kind, "--parallel", "3").backend
    assert lanelock("seats", "-b", backend, "2").returncode == 0
    done = lanelock("seats", "-b", backend, "auto")
    assert done.returncode == 69
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"lanelock: cannot tell the seats of localhost:"
                               f"{backend.rpartition(':')[2]} from its engine: ")
    assert why in lines[0]
    assert lanelock("seats", "-b", backend).stdout == "2\n"


def test_seats_auto_of_a_model_lane_asks_that_model_only_when_it_runs(procs, tmp_path, lanelock):
    engine = Served(procs, tmp_path, "--kind", "llama-swap", "--parallel", "2",
                    name="tiny/model-1")
    lane = ("-b", engine.backend, "--key-by", "model")
    done = lanelock("seats", *lane, "-m", "tiny/model-1", "auto")
    assert done.returncode == 0, done.stderr
    assert lanelock("seats", *lane, "-m", "tiny/model-1").stdout == "2\n"
    other = lanelock("seats", *lane, "-m", "other/model", "auto")
    assert other.returncode == 69
    assert other.stderr.count("\n") == 1
    assert "llama-swap does not run other/model now (asking it would load it)" in other.stderr
    assert engine.stats()["loads"] == []            # asked nothing that would load it
    assert lanelock("seats", *lane, "-m", "other/model").stdout == "1\n"


def test_seats_auto_refuses_more_slots_than_a_lane_seats(procs, tmp_path, lanelock):
    """vLLM's default max_num_seqs (256 and up) is a batch size: more than 256 is no seat count."""
    engine = Served(procs, tmp_path, "--kind", "vllm", "--vllm-dev-mode", "--parallel", "1024")
    done = lanelock("seats", "-b", engine.backend, "auto")
    assert done.returncode == 69
    assert done.stderr == (f"lanelock: the engine of localhost:{engine.port} serves 1024 at "
                           f"once, more than the 256 seats a lane has; set a count\n")
    assert lanelock("seats", "-b", engine.backend).stdout == "1\n"
