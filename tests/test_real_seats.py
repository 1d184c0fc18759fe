"""Real tier (pytest -m real): seats on a real llama-server. Behind a lane of two seats, two
sessions (`lanelock run` of a client) generate together on a --parallel 2 engine -- both slots
busy in its own /slots at once -- and never three: a third deflects naming both. The witness
counts each held seat as one generation covered, and reports a client straight at the engine,
beside the two, as unseen."""

from __future__ import annotations

import subprocess
import time

import pytest

from support.cli import LANELOCK, TIMEOUT
from support.processes import read_line
from support.real_backend import CLIENT, llama_server, slots_busy, two_slots  # noqa: F401

pytestmark = pytest.mark.real

STORY = "Write a long story about a lighthouse keeper and the ships she saw."


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


def session(procs, url: str, name: str, tokens: int = 300):
    """A session's turn: `lanelock run` of a client that generates a long answer."""
    return procs.start([*LANELOCK, "run", "-b", url.removeprefix("http://"), "-s", name, "--",
                        *CLIENT, "--max-tokens", str(tokens), "--prompt", STORY, url],
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def until_busy(url: str, count: int, *turns) -> None:
    """Until the engine's own /slots says `count` slots are processing at once."""
    deadline = time.monotonic() + 120
    while slots_busy(url) != count:
        assert all(turn.poll() is None for turn in turns), [t.stderr.read() for t in turns]
        assert time.monotonic() < deadline, f"never {count} slots busy at once"
        time.sleep(0.05)


def seats(lanelock, url: str, count: int) -> None:
    done = lanelock("seats", "-b", url.removeprefix("http://"), str(count))
    assert done.returncode == 0, done.stderr


def test_two_sessions_generate_together_behind_two_seats_and_a_third_deflects(
        two_slots, procs, lanelock):
    url, backend = two_slots, two_slots.removeprefix("http://")
    seats(lanelock, url, 2)
    watch = Watch(procs, backend)
    first, second = session(procs, url, "first"), session(procs, url, "second")
    until_busy(url, 2, first, second)          # both slots busy in the engine's /slots at once
    third = lanelock("run", "-b", backend, "-s", "third", "--fallback", "echo cloud", "--",
                     *CLIENT, "--max-tokens", "8", url, timeout=120)
    assert third.returncode == 0 and third.stdout == "cloud\n", third.stderr
    assert "local_backend_busy" in third.stderr and "2 of 2 seats: " in third.stderr, third.stderr
    for name, turn in (("first", first), ("second", second)):
        assert f"pid {turn.pid}, session {name}" in third.stderr, third.stderr
    assert first.wait(300) == 0 and second.wait(300) == 0
    lines = watch.stop()
    assert unseen(lines) == [], lines          # two held seats cover two slots generating


def test_the_witness_reports_a_third_client_straight_at_the_engine(procs, lanelock):
    """An engine of three slots behind a lane of two seats: the third generation comes from a
    client that never asked lanelock."""
    with llama_server(3) as url:
        backend = url.removeprefix("http://")
        seats(lanelock, url, 2)
        watch = Watch(procs, backend)
        first, second = session(procs, url, "first"), session(procs, url, "second")
        until_busy(url, 2, first, second)
        direct = subprocess.run([*CLIENT, "--max-tokens", "48", "--prompt", STORY, url],
                                capture_output=True, text=True, timeout=300)
        assert direct.returncode == 0, direct.stderr
        line = watch.wait_for("unseen generation")
        assert "3 slots generating, 2 turns hold the lane" in line, line
        assert first.wait(300) == 0 and second.wait(300) == 0
        lines = watch.stop()
    assert len(unseen(lines)) == 1, lines
