"""The witness: every generation the engine runs is a turn the gate saw, or lanelock
says so. Real processes: the stand-in engine (lanelock.testing serve, with llama.cpp's /slots and
the documented shapes of llama-swap, vLLM, SGLang and Ollama -- servers this machine cannot run),
`lanelock watch`, `lanelock proxy`, `lanelock run` and the API."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from support.cli import LANELOCK, TIMEOUT, environ, json_of
from support.processes import read_line, wait_for

PYTHON = sys.executable
INTERVAL = 0.2
LATE = 0.15   # how late a poll may come on a loaded 2-core machine


class StandIn:
    """`python -m lanelock.testing serve` in its own process, on a free loopback port."""

    def __init__(self, procs, tmp_path, *args, port: int = 0, delay: float = 0.6):
        port_file = tmp_path / f"engine-{time.monotonic_ns()}.port"
        self.proc = procs.start([PYTHON, "-m", "lanelock.testing", "serve", "--port", str(port),
                                 "--delay", str(delay), "--port-file", str(port_file),
                                 *map(str, args)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + TIMEOUT
        while not port_file.exists():   # written (renamed into place) once it listens
            assert self.proc.poll() is None, "the stand-in exited"
            assert time.monotonic() < deadline, "the stand-in never listened"
            time.sleep(0.01)
        self.port = int(port_file.read_text())
        self.backend = f"127.0.0.1:{self.port}"
        self.url = f"http://{self.backend}"

    def stats(self) -> dict:
        with urllib.request.urlopen(self.url + "/stats", timeout=TIMEOUT) as response:
            return json.load(response)

    def ask(self, prompt: str = "straight to the engine") -> None:
        body = json.dumps({"messages": [{"role": "user", "content": prompt}]}).encode()
        request = urllib.request.Request(self.url + "/v1/chat/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=TIMEOUT) as response:
            response.read()

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(TIMEOUT)


class Watch:
    """`lanelock watch` with its stderr read line by line as it comes."""

    def __init__(self, procs, backend: str, *args, interval: float = INTERVAL, env=None,
                 started: bool = True):
        self.proc = procs.start([*LANELOCK, "watch", "-b", backend, "--interval", str(interval),
                                 *map(str, args)], env=environ(env), stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE)
        self.lines: list[str] = []
        if started:
            self.wait_for("watching the engine")

    def next_line(self, timeout: float = TIMEOUT) -> str:
        line = read_line(self.proc.stderr, timeout)
        self.lines.append(line)
        return line

    def wait_for(self, needle: str, timeout: float = TIMEOUT) -> str:
        deadline = time.monotonic() + timeout
        while True:
            line = self.next_line(max(0.1, deadline - time.monotonic()))
            assert line, f"watch ended before saying {needle!r}: {self.lines}"
            assert "Traceback" not in line, self.lines
            if needle in line:
                return line

    def stop(self, signo=signal.SIGTERM) -> tuple[int, list[str]]:
        """Signal it; (exit status, every line it said)."""
        self.proc.send_signal(signo)
        rest = self.proc.stderr.read().decode(errors="replace").splitlines(keepends=True)
        self.lines += rest
        return self.proc.wait(TIMEOUT), self.lines


def unseen_lines(lines) -> list[str]:
    return [line for line in lines if "unseen generation" in line]


def engine_of(json_of, backend: str) -> dict:
    return json_of(["status", "-b", backend, "--json"])["lanes"][0]["engine"]


def unseen_events(json_of, backend: str) -> list[dict]:
    return [event for event in json_of(["history", "-b", backend, "--json"])["events"]
            if event["event"] == "unseen"]


# -- the verdicts -------------------------------------------------------------------------------------
def test_a_direct_generation_is_unseen_within_two_intervals_and_timed_within_one(procs, tmp_path):
    engine = StandIn(procs, tmp_path, delay=1.2)
    watch = Watch(procs, engine.backend)
    engine.ask()
    line = watch.wait_for("unseen generation")
    assert f"unseen generation on localhost:{engine.port}: the engine is generating" in line
    assert "while no turn held the lane (1 slot, " in line, line
    assert line.rstrip().endswith("-- a client reaches the engine without lanelock"), line
    ended = watch.wait_for("the generation unseen on")
    assert "ended: the engine generated" in ended and ended.rstrip().endswith(", 3 tokens")
    status, lines = watch.stop()
    assert status == 0 and len(unseen_lines(lines)) == 1, lines
    (event,) = unseen_events(json_of, engine.backend)
    (generation,) = engine.stats()["generations"]
    # Detected within two intervals of the engine's own start; its length within one interval.
    # (Plus LATE: the watcher's polls come every interval on an idle machine, later on a loaded
    # one -- a poll is first seen at most an interval late, its last sighting at most one early.)
    assert 0 <= event["ts"] - generation["started"] <= 2 * INTERVAL + LATE, (event, generation)
    real = generation["ended"] - generation["started"]
    assert abs(event["duration"] - real) <= INTERVAL + LATE, (event, generation)
    assert (event["slots"], event["turns"], event["witness"], event["kind"]) == \
        (1, 0, "watch", "llama.cpp")
    found = engine_of(json_of, engine.backend)
    assert (found["unseen"], found["kind"], found["generating"], found["slots"]) == \
        (1, "llama.cpp", 0, 1)
    assert found["unseen_seconds"] == event["duration"]
    assert found["witness"]["witness"] == "watch" and found["last_unseen"]["slots"] == 1
    # Watching made no lock: a lane no turn used is still never-used.
    assert json_of(["status", "-b", engine.backend, "--json"])["lanes"][0]["verdict"] == \
        "never-used"


@pytest.mark.slow   # a soak: thirty turns through three paths
def test_thirty_gated_turns_from_run_the_api_and_the_proxy_are_never_unseen(procs, lanelock, tmp_path):
    engine = StandIn(procs, tmp_path, delay=0.15)
    watch = Watch(procs, engine.backend)
    client = [PYTHON, "-m", "lanelock.testing", "client", engine.url]
    for _ in range(10):
        assert lanelock("run", "-b", engine.backend, "--", *client).returncode == 0
    api = (
        "import sys\n"
        "from lanelock import Gate\n"
        "from lanelock.testing.standin import complete\n"
        "gate = Gate(sys.argv[1])\n"
        "for _ in range(10):\n"
        "    with gate.turn(session='api', wait=30) as turn:\n"
        "        assert turn.held, turn.state\n"
        "        complete(sys.argv[2])\n")
    assert procs.start([PYTHON, "-c", api, engine.backend, engine.url]).wait(TIMEOUT) == 0
    from support.proxy import Proxy, chat_body, request

    proxy = Proxy(procs, engine.backend, "--no-witness")
    for _ in range(10):
        status, headers, _ = request(proxy.port, "POST", "/v1/chat/completions", chat_body())
        assert status == 200 and headers.get("X-Lanelock-State") == "held"
    assert "witness" not in proxy.stderr()
    status, lines = watch.stop()
    assert status == 0 and unseen_lines(lines) == [], lines
    assert engine.stats()["total"] == 30
    assert engine_of(json_of, engine.backend)["unseen"] == 0
    assert unseen_events(json_of, engine.backend) == []


def test_a_turn_that_holds_before_it_generates_counts_held_idle(procs, lanelock, tmp_path):
    engine = StandIn(procs, tmp_path, delay=0.2)
    watch = Watch(procs, engine.backend)
    command = (f"import time; time.sleep(1.0); from lanelock.testing.standin import complete; "
               f"complete({engine.url!r})")
    assert lanelock("run", "-b", engine.backend, "--", PYTHON, "-c", command).returncode == 0
    status, lines = watch.stop()   # a stopping witness counts what it held in memory
    assert status == 0 and unseen_lines(lines) == [], lines
    idle = engine_of(json_of, engine.backend)["held_idle_seconds"]
    assert 0.8 <= idle <= 3.0, idle
    metrics = lanelock("metrics", "-b", engine.backend).stdout
    assert f'lanelock_lane_held_idle_seconds_total{{lane="localhost:{engine.port}"}} {idle}' \
        in metrics


def test_a_generation_that_outlives_its_turn_briefly_is_not_unseen(procs, lanelock, tmp_path):
    """The turn's command starts a streamed request, waits until the engine streams, and ends,
    leaving a child to read the rest: the engine generates on for ~1 s after the release,
    inside the outlived grace (2 s)."""
    engine = StandIn(procs, tmp_path, "--tokens", 10, "--token-interval", 0.12)
    watch = Watch(procs, engine.backend)
    leave = (
        "import os, subprocess, sys\n"
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
    assert lanelock("run", "-b", engine.backend, "--", PYTHON, "-c", leave,
                    engine.url).returncode == 0
    deadline = time.monotonic() + TIMEOUT
    while engine.stats()["in_flight"]:   # the left-behind stream ends on its own
        assert time.monotonic() < deadline
        time.sleep(0.05)
    status, lines = watch.stop()
    assert status == 0 and unseen_lines(lines) == [], lines
    (generation,) = engine.stats()["generations"]
    released = [event for event in json_of(["history", "-b", engine.backend, "--json"])["events"]
                if event["event"] == "released"][-1]
    assert generation["ended"] > released["ts"] + 0.5   # it did outlive its turn


def test_a_generation_that_begins_after_the_turns_own_ended_is_unseen_at_once(
        procs, lanelock, tmp_path):
    """Inside the grace too: the engine names its tasks, the witness saw the turn's own end,
    so the next one is nobody's."""
    engine = StandIn(procs, tmp_path, delay=0.8)
    watch = Watch(procs, engine.backend)
    client = [PYTHON, "-m", "lanelock.testing", "client", engine.url]
    assert lanelock("run", "-b", engine.backend, "--", *client).returncode == 0
    engine.ask()   # right after the release: well inside the 2 s grace
    watch.wait_for("unseen generation")
    status, lines = watch.stop()
    assert len(unseen_lines(lines)) == 1, lines
    (event,) = unseen_events(json_of, engine.backend)
    generation = engine.stats()["generations"][-1]
    assert abs(event["duration"] - (generation["ended"] - generation["started"])) <= INTERVAL


def test_two_slots_generating_beside_one_held_turn_is_unseen(procs, holder, tmp_path):
    engine = StandIn(procs, tmp_path, "--parallel", 2, delay=1.0)
    watch = Watch(procs, engine.backend)
    held = holder("-b", engine.backend, command=[
        PYTHON, "-c", "import sys, threading\n"
        "from lanelock.testing.standin import complete\n"
        "threading.Thread(target=complete, args=(sys.argv[1],), daemon=True).start()\n"
        "print('ready', __import__('os').getpid(), flush=True)\n"
        "sys.stdin.readline()\n", engine.url])
    engine.ask()   # beside the holder's own generation
    line = watch.wait_for("unseen generation")
    assert "2 slots generating, 1 turn holds the lane" in line, line
    held.release()
    status, lines = watch.stop()
    assert len(unseen_lines(lines)) == 1, lines
    (event,) = unseen_events(json_of, engine.backend)
    assert (event["slots"], event["turns"]) == (2, 1)


# -- what it says, and when ------------------------------------------------------------------------
def stream(url: str, max_tokens: int | None = None):
    """A streamed chat completion straight to the engine, generating once its first event is
    read: it runs on until read to its end or hung up (close())."""
    fields = {"messages": [{"role": "user", "content": "straight to the engine"}], "stream": True}
    if max_tokens:
        fields["max_tokens"] = max_tokens
    request = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(fields).encode(),
                                     headers={"Content-Type": "application/json"})
    response = urllib.request.urlopen(request, timeout=TIMEOUT)
    assert response.readline().startswith(b"data: ")
    return response


def generation_of(engine, task: int | None = None) -> dict:
    generations = engine.stats()["generations"]
    return generations[-1] if task is None else next(g for g in generations if g["id"] == task)


@pytest.mark.parametrize("kind, tokens", [   # one kind in the default tier, the rest in the slow
    ("llama.cpp", 80), pytest.param("llama.cpp-legacy", 40, marks=pytest.mark.slow),
    pytest.param("llama-swap", 40, marks=pytest.mark.slow)])
def test_a_long_direct_generation_is_said_while_it_runs_and_at_its_end_with_its_final_count(
        procs, lanelock, tmp_path, kind, tokens):
    """The first line comes while the engine still generates (the stand-in says so), the last
    when it ended, with the count of tokens the engine decoded: the one the stand-in gave,
    not the last sample's -- the engine finished between the witness's last look and the end.
    Today's llama-server resets a finished slot's n_decoded and keeps its context; older ones
    keep n_decoded; llama-swap passes its model's /slots on."""
    engine = StandIn(procs, tmp_path, "--kind", kind, "--token-interval", 0.04)
    watch = Watch(procs, engine.backend)
    response = stream(engine.url, max_tokens=tokens)   # 3.2 s of tokens, or 1.6 s
    first = watch.wait_for("unseen generation")
    assert generation_of(engine)["ended"] is None, first   # said while it runs
    assert re.search(rf"lanelock: unseen generation on localhost:{engine.port}: the engine is "
                     r"generating, first seen at \d\d:\d\d:\d\d while no turn held the lane "
                     r"\(1 slot, \d+ tokens? so far\) -- a client reaches the engine without "
                     r"lanelock$", first.rstrip()), first
    response.read()
    response.close()
    last = watch.wait_for("the generation unseen on")
    generation = generation_of(engine)
    assert generation["decoded"] == tokens and generation["ended"] is not None, generation
    assert re.search(rf"lanelock: the generation unseen on localhost:{engine.port} ended: the "
                     r"engine generated \d+\.\d s while no turn held the lane \(1 slot\), "
                     rf"{tokens} tokens$", last.rstrip()), last
    status, lines = watch.stop()
    assert status == 0 and len(unseen_lines(lines)) == 1, lines
    (event,) = unseen_events(json_of, engine.backend)
    assert (event["tokens"], event["tokens_final"]) == (tokens, True), event
    assert engine_of(json_of, engine.backend)["last_unseen"]["tokens"] == tokens
    assert f"(1 slot generating, {tokens} tokens; seen by watch" in \
        lanelock("history", "-b", engine.backend).stdout


def test_a_generation_cut_by_its_client_is_counted_as_the_engine_counted_it(procs, tmp_path):
    """No max_tokens (n_remain -1): the client hangs up after the first line; the count is
    what the stand-in had decoded when it noticed."""
    engine = StandIn(procs, tmp_path, "--tokens", 1000, "--token-interval", 0.02)
    watch = Watch(procs, engine.backend)
    response = stream(engine.url)
    watch.wait_for("unseen generation")
    # Three intervals of tokens: the witness has seen it decode (its first look may have come
    # before the first token, when the engine cannot yet tell the prompt's size).
    wait_for(lambda: generation_of(engine)["decoded"] >= 3 * INTERVAL / 0.02,
             "the stand-in to decode three intervals of tokens")
    response.close()
    line = watch.wait_for("the generation unseen on")
    decoded = generation_of(engine)["decoded"]
    assert 1 <= decoded < 1000 and line.rstrip().endswith(f", {decoded} tokens"), (line, decoded)
    watch.stop()
    (event,) = unseen_events(json_of, engine.backend)
    assert (event["tokens"], event["tokens_final"]) == (decoded, True), event


@pytest.mark.slow   # the default tier's time: the slow tier (CI) runs it
def test_a_count_the_engine_no_longer_keeps_is_said_as_at_least(procs, lanelock, tmp_path):
    """Two direct streams on one slot: the second waits in the engine's queue and takes the
    slot the moment the first ends, so no look ever finds the first one's slot still naming
    it. Its count is then at least its last sample's -- never a wrong exact number."""
    engine = StandIn(procs, tmp_path, "--token-interval", 0.04)
    watch = Watch(procs, engine.backend)
    first = stream(engine.url, max_tokens=40)
    second = stream(engine.url, max_tokens=80)   # queued behind the first, longer
    watch.wait_for("unseen generation")
    first.read(), second.read()
    first.close(), second.close()
    line = watch.wait_for("the generation unseen on")
    assert re.search(r"ended: the engine generated \d+\.\d s while no turn held the lane "
                     r"\(1 slot\), at least \d+ tokens$", line.rstrip()), line
    status, lines = watch.stop()
    assert status == 0 and len(unseen_lines(lines)) == 1, lines
    (event,) = unseen_events(json_of, engine.backend)
    # The second's final count (80) and at least one of the first's.
    assert event["tokens_final"] is False and 80 < event["tokens"] < 120, event
    history = lanelock("history", "-b", engine.backend).stdout
    assert f", at least {event['tokens']} tokens; seen by watch" in history, history


@pytest.mark.parametrize("kind, endpoint", [   # one kind in the default tier, the rest in the slow
    ("llama.cpp", "/slots"), pytest.param("llama-swap", "/running", marks=pytest.mark.slow),
    pytest.param("vllm", "/metrics", marks=pytest.mark.slow)])
def test_an_engine_down_is_named_by_the_endpoint_of_the_kind_witnessed(procs, tmp_path, kind,
                                                                       endpoint):
    """Once a witness saw the engine (the lane's counts keep its kind), an engine that does not
    answer is named by that kind's endpoint -- in status, and by a watch or a proxy whose
    witness starts while it is down -- not by /running, the first thing detection asks."""
    engine = StandIn(procs, tmp_path, "--kind", kind, "--metrics")
    assert watch_until_detected(procs, engine)
    engine.stop()
    problem = engine_of(json_of, engine.backend)["problem"]
    assert problem.startswith(f"not answering: {engine.url}{endpoint}: "), problem
    later = Watch(procs, engine.backend, started=False)
    line = later.wait_for("watching the engine")
    assert f"(not answering yet: {engine.url}{endpoint}: " in line, line
    later.stop()
    from support.proxy import Proxy

    proxy = Proxy(procs, engine.backend, "--witness-interval", INTERVAL)   # its witness too
    log = proxy.said("witness: cannot read the engine")
    assert f"({engine.url}{endpoint}: " in log, log
    assert proxy.stop() == 0


def watch_until_detected(procs, engine) -> bool:
    """A witness that saw the engine at work: it has counted, so the lane's counts name the
    engine and its kind."""
    watch = Watch(procs, engine.backend)
    response = stream(engine.url, max_tokens=20)   # 1.5 s: several looks
    watch.wait_for("unseen generation")
    response.read()
    status, lines = watch.stop()
    return status == 0 and "(not answering" not in lines[0]


# -- where it runs ------------------------------------------------------------------------------------
def test_the_proxy_witnesses_its_engine_by_default(procs, tmp_path):
    from support.proxy import Proxy

    engine = StandIn(procs, tmp_path, delay=0.8)
    proxy = Proxy(procs, engine.backend, "--witness-interval", INTERVAL)
    engine.ask()
    # Its words are watch's: when first seen, then when it ended with the engine's count.
    log = proxy.said(f"the generation unseen on localhost:{engine.port} ended: ")
    first, last = log.index("unseen generation on"), log.index("the generation unseen on")
    assert first < last and "while no turn held the lane (1 slot), 3 tokens\n" in log[last:], log
    with urllib.request.urlopen(proxy.url + "/metrics", timeout=TIMEOUT) as response:
        metrics = response.read().decode()
    assert f'lanelock_engine_unseen_total{{lane="localhost:{engine.port}"}} 1.0' in metrics
    assert f'lanelock_engine_generating{{lane="localhost:{engine.port}"}} 0.0' in metrics
    (event,) = unseen_events(json_of, engine.backend)
    assert event["witness"] == "proxy"
    assert proxy.stop() == 0
    assert len(unseen_lines(proxy.stderr().splitlines())) == 1


@pytest.mark.parametrize("signo", [signal.SIGTERM, signal.SIGINT])
def test_watch_ends_within_a_second_of_a_signal(procs, tmp_path, signo):
    engine = StandIn(procs, tmp_path)
    watch = Watch(procs, engine.backend, interval=5)   # asleep between looks
    began = time.monotonic()
    status, lines = watch.stop(signo)
    assert status == 0 and time.monotonic() - began < 1.0, lines
    assert not any("Traceback" in line for line in lines)


@pytest.mark.parametrize("kind", ["llama-swap", "vllm", "sglang"])
def test_documented_shapes_of_other_engines_are_witnessed(procs, tmp_path, kind):
    """llama-swap, vLLM and SGLang cannot run here: the stand-in answers in their documented
    shapes (lanelock/testing/standin.py), and the witness reads them like any other."""
    engine = StandIn(procs, tmp_path, "--kind", kind, "--metrics", delay=1.0)
    watch = Watch(procs, engine.backend)
    shown = {"llama-swap": "llama-swap", "vllm": "vLLM", "sglang": "SGLang"}[kind]
    assert f"({shown}, " in watch.lines[-1], watch.lines
    engine.ask()
    watch.wait_for("unseen generation")
    status, lines = watch.stop()
    assert status == 0 and len(unseen_lines(lines)) == 1, lines
    assert engine_of(json_of, engine.backend)["kind"] == shown
    # llama-swap: only models /running lists were asked (asking another would load it).
    assert engine.stats().get("loads", []) == []


# -- what cannot be witnessed, and bad input ------------------------------------------------------------
@pytest.mark.parametrize("args, words", [
    (["--no-slots"], "slots disabled (501)"),
    (["--kind", "ollama"], "Ollama reports no work in flight"),
])
def test_engines_that_cannot_be_witnessed_say_so(procs, lanelock, tmp_path, args, words):
    engine = StandIn(procs, tmp_path, *args)
    done = lanelock("watch", "-b", engine.backend)
    assert done.returncode == 69, done
    assert done.stderr.startswith("lanelock: cannot witness") and words in done.stderr
    assert len(done.stderr.splitlines()) == 1, done.stderr
    plain = lanelock("status", "-b", engine.backend).stdout
    assert f"cannot witness: {words}" in plain, plain


@pytest.mark.parametrize("kind, words", [
    ("garbage", "not JSON"),
    ("odd", "lists something that is not a model"),
    ("redirect", "not followed"),
])
def test_an_engine_that_answers_nonsense_is_said_once(procs, tmp_path, kind, words):
    engine = StandIn(procs, tmp_path, "--kind", kind)
    watch = Watch(procs, engine.backend, started=False)
    line = watch.wait_for("watching the engine")
    assert "(not answering yet: " in line and words in line, line
    status, lines = watch.stop()
    assert status == 0 and len(lines) == 1, lines   # said once
    assert not any("Traceback" in line for line in lines)


def test_an_engine_down_then_up_is_said_once_each_way(procs, tmp_path, lanelock):
    from support.ports import free_port

    port = free_port()
    watch = Watch(procs, f"127.0.0.1:{port}", started=False)
    line = watch.wait_for("watching the engine")
    assert "(not answering yet: " in line and "Connection refused" in line, line
    engine = StandIn(procs, tmp_path, port=port)
    assert "answer again (llama.cpp)" in watch.wait_for("answer again")
    engine.stop()
    line = watch.wait_for("witness: cannot read the engine")
    assert "still trying" in line, line   # refused, or reset by the engine's death
    status, lines = watch.stop()
    assert status == 0 and sum("cannot read" in line for line in lines) == 1, lines
    assert sum("answer again" in line for line in lines) == 1, lines


def test_a_slow_engine_is_not_answering(procs, tmp_path):
    engine = StandIn(procs, tmp_path, "--slow", 3)
    watch = Watch(procs, engine.backend, started=False)
    line = watch.wait_for("watching the engine")
    assert "not answering yet: " in line and "did not answer within" in line, line
    watch.stop()


def test_a_broken_lock_root_is_said_once_and_the_engine_still_read(procs, tmp_path):
    """The lane's store cannot be had (the root under a regular file): one line; no turn could
    hold the lane there either (they fail open), and the witness never touches one."""
    engine = StandIn(procs, tmp_path)
    (tmp_path / "file").write_text("")
    watch = Watch(procs, engine.backend, env={"LANELOCK_DIR": str(tmp_path / "file" / "locks")})
    line = watch.wait_for("witness: cannot read the lane's store")
    assert "turns are not affected" in line, line
    status, lines = watch.stop()
    assert status == 0 and sum("cannot read" in line for line in lines) == 1, lines


@pytest.mark.parametrize("args, words", [
    (["--engine", "ftp://127.0.0.1:8080"], "expected an http:// or https:// URL"),
    (["--engine", "http://"], "names no host"),
    (["--engine", "http://127.0.0.1:99999"], "--engine"),
    (["--engine", "http://u:p@127.0.0.1:8080"], "base URL only"),
    (["--engine", "x" * 100_000], "longer than DNS allows"),
    (["--interval", "0"], "more than 0"),
    (["--interval", "-1"], "negative"),
    (["--interval", "soon"], "not a duration"),
    (["--interval", "nan"], "'nan' is not a duration"),
    (["--engine", "http://[::1"], "--engine"),
    (["-b", "api.openai.com:443"], "not a local lane"),
])
def test_bad_input_is_one_line_and_exit_2(lanelock, args, words):
    """And HOST:PORT for --engine is http://HOST:PORT, as -b takes it (test below)."""
    done = lanelock("watch", *(["-b", "127.0.0.1:1"] if "-b" not in args else []), *args)
    assert done.returncode == 2, done
    assert done.stderr.startswith("lanelock: ") and words in done.stderr, done.stderr
    assert len(done.stderr.splitlines()) == 1 and "Traceback" not in done.stderr


def test_status_history_and_metrics_show_an_unseen_generation(procs, lanelock, tmp_path):
    engine = StandIn(procs, tmp_path, delay=0.6)
    watch = Watch(procs, engine.backend)
    engine.ask()
    watch.wait_for("unseen generation")
    watch.stop()
    plain = lanelock("status", "-b", engine.backend).stdout
    assert f"engine http://127.0.0.1:{engine.port} (llama.cpp): 0 of 1 slot generating; " \
           "unseen: 1 generation" in plain, plain
    history = lanelock("history", "-b", engine.backend).stdout
    assert "unseen" in history and "the engine generated" in history, history
    assert "UNSEEN 1 generation" in history.splitlines()[-1], history
    metrics = lanelock("metrics", "-b", engine.backend).stdout
    assert f'lanelock_engine_unseen_total{{lane="localhost:{engine.port}"}} 1.0' in metrics
    assert "lanelock_engine_unseen_seconds_total" in metrics


def test_status_says_when_no_engine_answers(lanelock):
    """In the JSON, and in the plain line: nothing answers there (a wrong port must not read as
    a quiet lane). Its kind unknown, no endpoint is named (the first one detection asks is
    llama-swap's)."""
    engine = engine_of(json_of, "127.0.0.1:1")
    assert engine["problem"].startswith("not answering: http://127.0.0.1:1: "), engine
    assert (engine["url"], engine["generating"], engine["unseen"], engine["witness"]) == \
        ("http://127.0.0.1:1", None, 0, None)
    plain = lanelock("status", "-b", "127.0.0.1:1").stdout
    assert plain.endswith("; engine: nothing answers on 127.0.0.1:1\n"), plain


def test_one_witness_per_lane_the_other_stands_by_and_takes_over(procs, tmp_path):
    """A proxy and a watch (or two hosts' proxies) on one engine: one counts, the other stands
    by; kill -9 of the first and the second takes over (the kernel lets go of the claim)."""
    engine = StandIn(procs, tmp_path, delay=0.6)
    first = Watch(procs, engine.backend)
    second = Watch(procs, engine.backend)
    line = second.wait_for("standing by")
    assert f"is witnessed already (watch pid {first.proc.pid} on " in line, line
    engine.ask()
    first.wait_for("the generation unseen on")   # ended: journaled
    first.proc.kill()
    first.proc.wait(TIMEOUT)
    assert f"watch pid {first.proc.pid}" in second.wait_for("taking over")
    engine.ask()
    second.wait_for("unseen generation")
    status, lines = second.stop()
    assert status == 0 and len(unseen_lines(lines)) == 1, lines   # the first one was not its
    assert len(unseen_events(json_of, engine.backend)) == 2


def test_engine_spellings(procs, tmp_path):
    engine = StandIn(procs, tmp_path)
    for spelled in (f"127.0.0.1:{engine.port}", f"HTTP://LOCALHOST:{engine.port}/",
                    f" http://127.0.0.1:{engine.port} "):
        watch = Watch(procs, engine.backend, "--engine", spelled)
        assert "(llama.cpp, /slots)" in watch.lines[-1], watch.lines
        assert watch.stop()[0] == 0


def test_a_plain_flock_holder_covers_the_engine_too(procs, tmp_path, lock_dir):
    """A holder that writes no record -- `flock(1)` on the lane's lock file -- is a turn: the
    witness asks the kernel before it calls a generation unseen."""
    import shutil

    if shutil.which("flock") is None:
        pytest.skip("flock(1) not found")
    engine = StandIn(procs, tmp_path, delay=0.8)
    watch = Watch(procs, engine.backend)
    lock_dir.mkdir(exist_ok=True)
    lock = lock_dir / f"localhost-{engine.port}.lock"
    done = procs.start(["flock", str(lock), PYTHON, "-m", "lanelock.testing", "client",
                        engine.url], stdout=subprocess.DEVNULL).wait(TIMEOUT)
    assert done == 0
    status, lines = watch.stop()
    assert status == 0 and unseen_lines(lines) == [], lines
    assert engine.stats()["total"] == 1
