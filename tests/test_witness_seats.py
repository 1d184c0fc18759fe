"""The witness on a lane of N seats: each held seat covers one generation; more slots generating
than seats held is unseen. Real processes: the stand-in engine with --parallel slots, `lanelock
seats`, `lanelock watch`, and turns that hold seats (`lanelock run`) while their command
generates on the engine."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

import pytest

from support.cli import LANELOCK, TIMEOUT, json_of
from support.processes import read_line

PYTHON = sys.executable
INTERVAL = 0.2

# A turn's command: one generation on the engine in a thread, "ready PID" once it is under way
# (the holder fixture waits for it), then it holds its seat until told to release.
GENERATE = ("import sys, threading\n"
            "from lanelock.testing.standin import complete\n"
            "threading.Thread(target=complete, args=(sys.argv[1],), daemon=True).start()\n"
            "print('ready', __import__('os').getpid(), flush=True)\n"
            "sys.stdin.readline()\n")


class StandIn:
    """`python -m lanelock.testing serve --parallel N` on a free loopback port."""

    def __init__(self, procs, tmp_path, parallel: int, delay: float, *args):
        port_file = tmp_path / f"engine-{time.monotonic_ns()}.port"
        self.proc = procs.start([PYTHON, "-m", "lanelock.testing", "serve", "--port", "0",
                                 "--parallel", str(parallel), "--delay", str(delay),
                                 "--port-file", str(port_file), *map(str, args)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + TIMEOUT
        while not port_file.exists():   # renamed into place once it listens
            assert self.proc.poll() is None, "the stand-in exited"
            assert time.monotonic() < deadline, "the stand-in never listened"
            time.sleep(0.01)
        self.port = int(port_file.read_text())
        self.backend = f"127.0.0.1:{self.port}"
        self.url = f"http://{self.backend}"

    def stats(self) -> dict:
        with urllib.request.urlopen(self.url + "/stats", timeout=TIMEOUT) as response:
            return json.load(response)

    def ask(self) -> None:
        """A generation straight at the engine, not through lanelock."""
        body = json.dumps({"messages": [{"role": "user", "content": "straight"}]}).encode()
        request = urllib.request.Request(self.url + "/v1/chat/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=TIMEOUT) as response:
            response.read()

    def wait_ended(self, count: int) -> list[dict]:
        """The engine's generations once `count` of them ended (the engine says when)."""
        deadline = time.monotonic() + TIMEOUT
        while True:
            generations = self.stats()["generations"]
            if sum(1 for g in generations if g["ended"] is not None) >= count:
                return generations
            assert time.monotonic() < deadline, generations
            time.sleep(0.05)


class Watch:
    def __init__(self, procs, backend: str, *args):
        self.proc = procs.start([*LANELOCK, "watch", "-b", backend, "--interval", str(INTERVAL),
                                 *args],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.lines: list[str] = []
        self.wait_for("watching the engine")

    def wait_for(self, needle: str) -> str:
        deadline = time.monotonic() + TIMEOUT
        while True:
            line = read_line(self.proc.stderr, max(0.1, deadline - time.monotonic()))
            assert line and "Traceback" not in line, self.lines
            self.lines.append(line)
            if needle in line:
                return line

    def stop(self) -> list[str]:
        self.proc.terminate()
        self.lines += self.proc.stderr.read().decode(errors="replace").splitlines(keepends=True)
        assert self.proc.wait(TIMEOUT) == 0, self.lines
        return self.lines


def unseen_lines(lines) -> list[str]:
    return [line for line in lines if "unseen generation" in line]


def unseen_events(backend: str, *args) -> list[dict]:
    return [event for event in json_of(["history", "-b", backend, "--json", *args])["events"]
            if event["event"] == "unseen"]


def seats(lanelock, backend: str, count: int, *args) -> None:
    done = lanelock("seats", "-b", backend, str(count), *args)
    assert done.returncode == 0, done.stderr


def test_two_held_seats_generating_at_once_are_covered(procs, holder, lanelock, tmp_path):
    engine = StandIn(procs, tmp_path, parallel=2, delay=1.5)
    seats(lanelock, engine.backend, 2)
    watch = Watch(procs, engine.backend)
    first = holder("-b", engine.backend, command=[PYTHON, "-c", GENERATE, engine.url])
    second = holder("-b", engine.backend, command=[PYTHON, "-c", GENERATE, engine.url])
    a, b = engine.wait_ended(2)
    # The two generations ran together for a while (the witness samples every 0.2 s).
    assert min(a["ended"], b["ended"]) - max(a["started"], b["started"]) >= 3 * INTERVAL, (a, b)
    first.release()
    second.release()
    lines = watch.stop()
    assert unseen_lines(lines) == [], lines
    assert unseen_events(engine.backend) == []


def test_a_generation_straight_at_the_engine_beside_two_held_seats_is_unseen(
        procs, holder, lanelock, tmp_path):
    """An engine of three slots behind a lane of two seats: a third generation beside the two
    held turns' own reaches it without lanelock."""
    engine = StandIn(procs, tmp_path, parallel=3, delay=1.5)
    seats(lanelock, engine.backend, 2)
    watch = Watch(procs, engine.backend)
    first = holder("-b", engine.backend, command=[PYTHON, "-c", GENERATE, engine.url])
    second = holder("-b", engine.backend, command=[PYTHON, "-c", GENERATE, engine.url])
    engine.ask()
    line = watch.wait_for("unseen generation")
    assert "3 slots generating, 2 turns hold the lane" in line, line
    first.release()
    second.release()
    lines = watch.stop()
    assert len(unseen_lines(lines)) == 1, lines
    (event,) = unseen_events(engine.backend)
    assert (event["slots"], event["turns"]) == (3, 2), event


# A turn's command that starts a streamed generation, waits until the engine streams, and ends,
# leaving a child to read the rest: the engine generates on after the turn released its seat.
LEAVE = ("import os, subprocess, sys\n"
         "read, write = os.pipe()\n"
         "reader = ('import json, os, sys, urllib.request\\n'\n"
         "          'body = json.dumps({\"stream\": True, \"messages\": []}).encode()\\n'\n"
         "          'answer = urllib.request.urlopen(sys.argv[1] + \"/v1/chat/completions\", body)\\n'\n"
         "          'answer.readline()\\n'\n"
         "          'os.write(int(sys.argv[2]), b\"streaming\\\\n\")\\n'\n"
         "          'answer.read()\\n')\n"
         "subprocess.Popen([sys.executable, '-c', reader, sys.argv[1], str(write)],\n"
         "                 pass_fds=(write,), start_new_session=True)\n"
         "os.close(write)\n"
         "assert os.read(read, 100) == b'streaming\\n'\n")


def test_a_generation_outliving_its_seat_beside_a_held_one_is_not_unseen(
        procs, holder, lanelock, tmp_path):
    """Seat 1 held and generating; a turn on seat 2 ends while its stream goes on ~1 s: inside
    the outlived grace (2 s) it is its released turn's, not an unseen one."""
    engine = StandIn(procs, tmp_path, 2, 4.0, "--tokens", 10, "--token-interval", 0.12)
    seats(lanelock, engine.backend, 2)
    watch = Watch(procs, engine.backend)
    held = holder("-b", engine.backend, command=[PYTHON, "-c", GENERATE, engine.url])
    left = lanelock("run", "-b", engine.backend, "--", PYTHON, "-c", LEAVE, engine.url)
    assert left.returncode == 0, left.stderr
    generations = engine.wait_ended(1)   # the stream ends first, on its own
    assert generations[0]["ended"] is None or generations[1]["ended"] is None, generations
    held.release()
    lines = watch.stop()
    assert unseen_lines(lines) == [], lines
    released = [event for event in json_of(["history", "-b", engine.backend, "--json"])["events"]
                if event["event"] == "released"][0]
    stream = min(generations, key=lambda g: g["ended"] or float("inf"))
    assert stream["ended"] > released["ts"] + 0.5   # it did outlive its turn, beside the held one


@pytest.mark.slow   # the default tier's time: the slow tier (CI) runs it
def test_on_the_postgresql_store_each_held_seat_covers_one_generation(
        procs, holder, lanelock, tmp_path, postgres):
    """The store's default count of held seats (survey(): every seat's facts): two turns held
    through the store generate together, covered; a third generation straight at the engine is
    unseen beside the two."""
    store = ["--store", postgres.dsn]
    engine = StandIn(procs, tmp_path, 3, 1.5)
    seats(lanelock, engine.backend, 2, *store)
    watch = Watch(procs, engine.backend, *store)
    first = holder("-b", engine.backend, *store, command=[PYTHON, "-c", GENERATE, engine.url])
    second = holder("-b", engine.backend, *store, command=[PYTHON, "-c", GENERATE, engine.url])
    engine.ask()
    line = watch.wait_for("unseen generation")   # the first said is the direct one's
    assert "3 slots generating, 2 turns hold the lane" in line, line
    first.release()
    second.release()
    lines = watch.stop()
    assert len(unseen_lines(lines)) == 1, lines
    (event,) = unseen_events(engine.backend, *store)
    assert (event["slots"], event["turns"]) == (3, 2), event


@pytest.mark.slow   # the default tier's time: the slow tier (CI) runs it
def test_the_proxys_witness_on_two_seats_covers_two_requests_generating_at_once(
        procs, lanelock, tmp_path):
    """Through `lanelock proxy` each request is a turn on a seat of its own: two streams at once
    on a lane of two seats are two generations covered, none unseen."""
    pytest.importorskip("aiohttp")
    from support.proxy import Proxy, open_stream, read_until

    engine = StandIn(procs, tmp_path, 2, 0.1, "--tokens", 20, "--token-interval", 0.1)
    seats(lanelock, engine.backend, 2)
    proxy = Proxy(procs, engine.backend, "--witness-interval", INTERVAL)
    streams = [open_stream(proxy.port) for _ in range(2)]
    for sock in streams:
        assert b"data: " in read_until(sock, b"data: ")
    assert engine.stats()["in_flight"] == 2      # both generating at once, for ~2 s
    for sock in streams:
        read_until(sock, b"[DONE]")
        sock.close()
    a, b = engine.wait_ended(2)
    assert min(a["ended"], b["ended"]) - max(a["started"], b["started"]) >= 3 * INTERVAL, (a, b)
    assert proxy.stop() == 0
    assert "unseen generation" not in proxy.log(), proxy.log()
    assert unseen_events(engine.backend) == []
