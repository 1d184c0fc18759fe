"""The witness on a real llama.cpp server (pytest -m real): its own /slots account, held against
the lane, finds the client that bypasses lanelock, and never a gated one."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from support.cli import LANELOCK, TIMEOUT, json_of
from support.processes import read_line
from support.real_backend import CLIENT, servers, slots_busy  # noqa: F401 - servers is a fixture

pytestmark = pytest.mark.real


class Watch:
    def __init__(self, procs, backend: str):
        self.proc = procs.start([*LANELOCK, "watch", "-b", backend, "--interval", "0.25"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.lines = [read_line(self.proc.stderr, 60)]
        assert "(llama.cpp, /slots)" in self.lines[0], self.lines

    def wait_for(self, needle: str, timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        while True:
            line = read_line(self.proc.stderr, max(0.1, deadline - time.monotonic()))
            assert line, self.lines
            self.lines.append(line)
            if needle in line:
                return line

    def stop(self) -> list[str]:
        self.proc.terminate()
        self.lines += self.proc.stderr.read().decode(errors="replace").splitlines()
        assert self.proc.wait(TIMEOUT) == 0
        return self.lines


def unseen(lines) -> list[str]:
    return [line for line in lines if "unseen generation" in line]


def test_a_direct_client_is_reported_and_twenty_gated_turns_are_not(servers, procs,
                                                                         lanelock):
    local = servers["local"]
    backend = local.removeprefix("http://")
    watch = Watch(procs, backend)
    # Straight to the engine, no lanelock; long enough to be seen decoding (a look that only
    # ever finds it reading its prompt cannot tell its count).
    done = subprocess.run([*CLIENT, "--max-tokens", "96", "--prompt",
                           "Write a long story about a lighthouse keeper.", "--json", local],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    line = watch.wait_for("unseen generation")
    assert "while no turn held the lane" in line, line
    answer = json.loads(done.stdout)
    # Said again when it ended, with the engine's own count: the answer's completion tokens.
    ended = watch.wait_for("the generation unseen on")
    tokens = answer["usage"]["completion_tokens"]
    assert ended.rstrip().endswith(f"), {tokens} token{'' if tokens == 1 else 's'}"), \
        (ended, answer["usage"])
    for _ in range(20):
        turn = lanelock("run", "-b", backend, "--", *CLIENT, "--max-tokens", "16", local,
                        timeout=300)
        assert turn.returncode == 0, turn.stderr
    lines = watch.stop()
    assert len(unseen(lines)) == 1, lines   # the direct client's, none of the 20 turns
    (event,) = [e for e in json_of(["history", "-b", backend, "--json"])["events"]
                if e["event"] == "unseen"]
    assert event["kind"] == "llama.cpp" and event["slots"] == 1 and event["turns"] == 0
    assert (event["tokens"], event["tokens_final"]) == (tokens, True), event
    # Its length within an interval of the client's own (which adds the HTTP round trip).
    assert abs(event["duration"] - (answer["ended"] - answer["started"])) <= 0.25 + 0.1
    status = json_of(["status", "-b", backend, "--json"])["lanes"][0]["engine"]
    assert (status["kind"], status["slots"], status["unseen"]) == ("llama.cpp", 2, 1)


def test_a_direct_client_beside_a_held_turn_on_two_slots_is_reported(servers, procs, lanelock):
    local = servers["local"]                 # --parallel 2: both generate at once
    backend = local.removeprefix("http://")
    watch = Watch(procs, backend)
    held = procs.start([*LANELOCK, "run", "-b", backend, "--", *CLIENT, "--max-tokens", "400",
                        "--prompt", "Write a long story about a lighthouse keeper.", local],
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not slots_busy(local):             # the engine says so: nothing else reports it
        assert held.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    done = subprocess.run([*CLIENT, "--max-tokens", "32", local], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    line = watch.wait_for("unseen generation")
    assert "2 slots generating, 1 turn holds the lane" in line, line
    assert held.wait(300) == 0
    lines = watch.stop()
    assert len(unseen(lines)) == 1, lines
