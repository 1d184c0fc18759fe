"""`lanelock proxy` end to end: real processes, real clients, no mocks.

Every engine here is the contention-detecting stand-in (lanelock.testing.standin) or a tiny
recorder of request headers, each in its own process; every proxy is `python -m lanelock proxy`,
synchronised on its one startup line (read through a pipe). Clients nobody here wrote -- curl, the
official openai SDK, simonw's llm -- are run as they would be by a user. Lane state is asked of
`lanelock probe`, `status`, `history` and of waiting `lanelock run` turns, never guessed from time.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.cli import LANELOCK, TIMEOUT
from support.http import read_all
from support.kernel_locks import is_waiting
from support.processes import read_line, wait_for
from lanelock import locks
from support.engine import Engine
from support.ports import free_port
from support.proxy import (CHAT, Proxy, Recorder, chat_body, history, lane_status, lock_path,
                           open_stream, probe, raw_request, read_until, request, turn_state)

pytest.importorskip("aiohttp")

PYTHON = sys.executable
needs_curl = pytest.mark.skipif(shutil.which("curl") is None, reason="curl not found")
README = Path(__file__).resolve().parent.parent / "docs" / "proxy.md"   # the proxy's page


# -- 1. streaming is relayed live ---------------------------------------------------------------
def curl_stream(procs, url, tmp_path, label):
    """curl -N URL with a streaming chat body: (bytes, curl's time_starttransfer, time_total,
    seconds between the first byte reaching our pipe and EOF, the lane probe taken meanwhile)."""
    headers = tmp_path / f"{label}.headers"
    proc = procs.start(["curl", "-sN", "-D", str(headers), "-H", "Content-Type: application/json",
                        "--data-binary", chat_body(stream=True).decode(),
                        "-w", "%{stderr}%{time_starttransfer} %{time_total}", url + CHAT],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = os.read(proc.stdout.fileno(), 65536)
    first_at = time.monotonic()
    return proc, first, first_at, headers


def finish_curl(proc, first, first_at):
    rest = proc.stdout.read()
    eof_at = time.monotonic()
    timings = proc.stderr.read().decode().split()
    assert proc.wait(timeout=TIMEOUT) == 0
    return first + rest, float(timings[0]), float(timings[1]), eof_at - first_at


@needs_curl
def test_streaming_is_relayed_live_byte_for_byte_and_holds_the_lane(procs, lanelock, tmp_path):
    engine = Engine(procs, tokens=25, interval=0.05)   # 24 gaps of 50 ms: 1.2 s an answer
    proxy = Proxy(procs, engine.backend)

    proc, first, first_at, _ = curl_stream(procs, engine.url, tmp_path, "direct")
    direct, direct_ttfb, direct_total, direct_live = finish_curl(proc, first, first_at)

    proc, first, first_at, headers = curl_stream(procs, proxy.url, tmp_path, "proxied")
    assert first.startswith(b"data: "), first
    held_meanwhile = probe(lanelock, engine.backend)    # while the answer is still streaming
    proxied, proxied_ttfb, proxied_total, proxied_live = finish_curl(proc, first, first_at)
    after = turn_state(lanelock, engine.backend, "--wait", "5")

    print(f"\ntime to first byte: direct {direct_ttfb * 1000:.1f} ms, "
          f"proxy {proxied_ttfb * 1000:.1f} ms; answer {direct_total:.2f} s / "
          f"{proxied_total:.2f} s")
    assert proxied == direct                              # the same bytes, event for event
    assert proxied.count(b"data: ") == 26 and proxied.endswith(b"data: [DONE]\n\n")
    assert direct_total >= 1.0 and proxied_total >= 1.0
    assert proxied_ttfb < 0.5                              # generous: exact figures are bench's
    assert proxied_live >= 0.8 and direct_live >= 0.8      # events came as made, not at the end
    assert "x-lanelock-state: held" in headers.read_text().lower()
    assert held_meanwhile == 1
    assert after == (0, "held")
    released = [event for event in history(lanelock, engine.backend)
                if event["event"] == "released" and event.get("via") == "proxy"]
    assert len(released) == 1 and released[0]["duration"] >= 1.0   # held for the whole answer
    assert released[0]["exit_status"] == 200


# -- 2. real clients nobody here wrote ------------------------------------------------------------
OPENAI_SCRIPT = r"""
import json, sys
from openai import OpenAI

client = OpenAI(base_url=sys.argv[1], api_key="not-checked",
                default_headers={"X-Lanelock-Session": "sdk"})
raw = client.chat.completions.with_raw_response.create(
    model="stand-in", messages=[{"role": "user", "content": "hi"}])
answer = raw.parse().choices[0].message.content
stream = client.chat.completions.create(model="stand-in", stream=True,
                                        messages=[{"role": "user", "content": "hi"}])
words = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
print(json.dumps({"answer": answer, "state": raw.headers.get("x-lanelock-state"),
                  "streamed": words}))
"""


def test_real_clients_openai_sdk_llm_and_curl(procs, lanelock, run_cmd, tmp_path):
    pytest.importorskip("openai")
    llm = str(Path(sys.executable).with_name("llm"))     # the venv's own, else PATH's
    llm = llm if os.access(llm, os.X_OK) else shutil.which("llm") or llm
    if not os.access(llm, os.X_OK):
        pytest.skip("simonw's llm CLI not installed")
    engine = Engine(procs, delay=0.05, tokens=5, interval=0.01)
    proxy = Proxy(procs, engine.backend)

    sdk = run_cmd([PYTHON, "-c", OPENAI_SCRIPT, proxy.url + "/v1"])
    assert sdk.returncode == 0, sdk.stderr
    assert json.loads(sdk.stdout) == {"answer": "answer from stand-in", "state": "held",
                                      "streamed": "tok0 tok1 tok2 tok3 tok4 "}

    # llm's --no-stream needs the answer's "usage", which the stand-in does not send: that one
    # goes through a second proxy, in front of the recorder (which answers as OpenAI does).
    recorder = Recorder(procs)
    # --no-witness: the recorder writes down every request, the witness's looks included.
    recorded = Proxy(procs, f"127.0.0.1:{recorder.port}", "--no-witness")
    user_path = tmp_path / "llm"
    user_path.mkdir()
    (user_path / "extra-openai-models.yaml").write_text(
        f"- model_id: lanelocked\n  model_name: stand-in\n  api_base: \"{proxy.url}/v1\"\n"
        f"- model_id: recorded\n  model_name: recorded\n  api_base: \"{recorded.url}/v1\"\n")
    llm_env = {"LLM_USER_PATH": user_path, "OPENAI_API_KEY": "not-checked"}
    streamed = run_cmd([llm, "-m", "lanelocked", "hi"], env=llm_env)
    assert streamed.returncode == 0, streamed.stderr
    assert streamed.stdout.strip() == "tok0 tok1 tok2 tok3 tok4"
    whole = run_cmd([llm, "-m", "recorded", "--no-stream", "hi"], env=llm_env)
    assert whole.returncode == 0, whole.stderr
    assert whole.stdout.strip() == "answer from recorder"
    seen = recorder.next_request()
    assert seen["path"] == CHAT and json.loads(seen["body"])["stream"] is False
    assert [event["event"] for event in history(lanelock, f"127.0.0.1:{recorder.port}")] == \
        ["acquired", "released"]

    if shutil.which("curl"):
        curled = run_cmd(["curl", "-sN", "-H", "Content-Type: application/json", "--data-binary",
                          chat_body(stream=True).decode(), proxy.url + CHAT])
        assert curled.returncode == 0 and curled.stdout.endswith("data: [DONE]\n\n")

    events = [event for event in history(lanelock, engine.backend) if event.get("via") == "proxy"]
    turns = 4 if shutil.which("curl") else 3
    acquired = [event for event in events if event["event"] == "acquired"]
    released = [event for event in events if event["event"] == "released"]
    assert len(acquired) == len(released) == turns, events
    assert all(event["path"] == CHAT and event["model"] == "stand-in" for event in acquired)
    assert [event["session"] for event in acquired[:2]] == ["sdk", "sdk"]
    # The HTTP status; None when the client hung up first -- the openai SDK closes a stream as
    # soon as it reads `data: [DONE]`, sometimes before the proxy has relayed the last chunk.
    assert released[0]["exit_status"] == 200
    assert {event["exit_status"] for event in released} <= {200, None}, released
    assert engine.stats()["max_in_flight"] == 1 and engine.stats()["total"] == turns
    assert probe(lanelock, engine.backend) == 0


# -- 3. contention: proxies, run turns and a Gate, all at once -------------------------------------
PROXIED_CLIENT = r"""
import http.client, json, os, sys
port, session = int(sys.argv[1]), sys.argv[2]
conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
conn.connect()
print("ready", flush=True)
os.read(0, 1)   # the barrier: EOF on stdin when the test closes the pipe
conn.request("POST", "/v1/chat/completions",
             json.dumps({"model": "stand-in", "messages": [{"role": "user", "content": "hi"}]}),
             {"Content-Type": "application/json", "X-Lanelock-Session": session})
response = conn.getresponse()
body = response.read().decode()
print(json.dumps({"status": response.status, "state": response.getheader("X-Lanelock-State"),
                  "reason": response.getheader("X-Lanelock-Reason"),
                  "retry_after": response.getheader("Retry-After"), "body": body}), flush=True)
"""

GATE_CLIENT = r"""
import asyncio, json, os, sys
from lanelock import Gate
from lanelock.testing.standin import ask
backend = sys.argv[1]
gate = Gate(backend)
print("ready", flush=True)
os.read(0, 1)

async def turn():
    async with gate.turn(session="gate-process") as turn:
        answer = await asyncio.to_thread(ask, "http://" + backend) if turn.proceed else None
        return {"state": turn.state, "answer": answer and answer["content"]}

print(json.dumps(asyncio.run(turn())), flush=True)
"""


def test_contention_two_proxies_run_turns_and_a_gate_never_overlap(procs, lanelock):
    engine = Engine(procs, delay=1.0)
    cloud = Engine(procs, delay=0.05, name="cloud")
    with_fallback = Proxy(procs, engine.backend, "--fallback", cloud.url + "/v1")
    without = Proxy(procs, engine.backend)

    barrier_read, barrier_write = os.pipe()
    started = []

    def start(kind, argv):
        proc = procs.start(argv, stdin=barrier_read, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE)
        started.append((kind, proc))

    try:
        for index in range(8):
            proxy = with_fallback if index % 2 == 0 else without
            start("fallback" if proxy is with_fallback else "no-fallback",
                  [PYTHON, "-c", PROXIED_CLIENT, str(proxy.port), f"client-{index}"])
        for index in range(3):
            start("run", ["sh", "-c", 'echo ready; read go; exec "$@"', "sh", *LANELOCK, "run",
                          "-q", "-b", engine.backend, "-s", f"run-{index}", "--", PYTHON, "-m",
                          "lanelock.testing", "client", engine.url])
        start("gate", [PYTHON, "-c", GATE_CLIENT, engine.backend])
        os.close(barrier_read)
        for kind, proc in started:
            assert read_line(proc.stdout) == "ready\n", kind
    finally:
        os.close(barrier_write)    # everyone goes at once
    outcomes = []
    for kind, proc in started:
        out, err = proc.communicate(timeout=TIMEOUT)
        outcomes.append((kind, proc.returncode, out.decode(), err.decode()))

    assert engine.stats()["max_in_flight"] == 1, outcomes
    held = deflected = busy = 0
    for kind, status, out, err in outcomes:
        if kind == "run":
            assert status in (0, 75), (status, err)
            held += status == 0
            if status == 0:
                assert out == "answer from stand-in\n"
            continue
        answer = json.loads(out)
        if kind == "gate":
            assert answer["state"] in ("held", "deflected"), answer
            held += answer["state"] == "held"
            continue
        if answer["state"] == "held":
            held += 1
            assert answer["status"] == 200 and "answer from stand-in" in answer["body"]
        elif kind == "fallback":
            deflected += 1
            assert answer["state"] == "deflected" and answer["status"] == 200, answer
            assert answer["reason"] == "local_backend_busy"
            assert "answer from cloud" in answer["body"]
        else:
            busy += 1
            assert answer["status"] == 503 and answer["state"] == "busy", answer
            assert answer["reason"] == "local_backend_busy"
            assert int(answer["retry_after"]) >= 1
            assert json.loads(answer["body"])["error"]["type"] == "local_backend_busy"
    print(f"\ncontention: {held} held, {deflected} deflected to the fallback, {busy} busy (503), "
          f"{len(outcomes) - held - deflected - busy} run/Gate turns deflected")
    assert held >= 1 and deflected >= 1 and busy >= 1, outcomes
    assert engine.stats()["total"] == held       # every generation on the engine was a held turn
    assert cloud.stats()["total"] == deflected
    assert with_fallback.stop() == 0 and without.stop() == 0


def test_local_fallback_takes_its_own_lane_and_is_skipped_when_busy(procs, lanelock, holder):
    engine = Engine(procs, delay=0.01)
    small = Engine(procs, delay=0.01, name="small")
    proxy = Proxy(procs, engine.backend, "--fallback", f"@{small.backend}")
    first = holder("-b", engine.backend, "-s", "primary-holder")
    status, headers, body = request(proxy.port, "POST", "/completion", b'{"prompt": "hi"}')
    assert (status, headers["X-Lanelock-State"]) == (200, "deflected")
    assert json.loads(body)["content"] == "answer from small"     # native paths go to @ engines
    taken = [event for event in history(lanelock, small.backend) if event["event"] == "acquired"]
    assert len(taken) == 1 and taken[0]["via"] == "proxy"          # on the small engine's lane
    second = holder("-b", small.backend, "-s", "small-holder")
    status, headers, _ = request(proxy.port, "POST", "/completion", b'{"prompt": "hi"}')
    assert (status, headers["X-Lanelock-State"]) == (503, "busy")
    proxy.said("fallback 1 skipped")
    assert first.release() == 0 and second.release() == 0
    assert engine.stats()["total"] == 0 and small.stats()["total"] == 1


def test_a_fallback_on_the_busy_lane_itself_is_skipped_in_runs_words(procs, lanelock, holder):
    """One rule for @HOST:PORT fallbacks (lanelock/fallback_lane.py): the proxy says what `run`
    says of an entry that names the busy lane itself (it skipped it silently), and the busy
    answer names it."""
    engine = Engine(procs, delay=0.01)
    spelled = f"localhost:{engine.port}"   # another spelling of the same lane
    proxy = Proxy(procs, engine.backend, "--fallback", f"@{spelled}", "--no-witness")
    held = holder("-b", engine.backend)
    status, headers, body = request(proxy.port, "POST", CHAT, chat_body())
    assert (status, headers["X-Lanelock-State"]) == (503, "busy")
    words = f"fallback 1 skipped: @{spelled} is the busy lane itself"
    assert words in json.loads(body)["error"]["message"], body
    proxy.said(words)
    ran = lanelock("run", "-b", engine.backend, "-f", f"@{spelled} true", "--", "true")
    assert ran.returncode == 75 and words in ran.stderr, ran.stderr
    assert held.release() == 0


def test_busy_answers_leave_no_waits_behind(procs, lanelock, holder, lock_dir):
    engine = Engine(procs, delay=0.01)
    proxy = Proxy(procs, engine.backend)
    busy = holder("-b", engine.backend, "-s", "long-job")
    for _ in range(20):
        assert request(proxy.port, "POST", CHAT, chat_body())[0] == 503
    view = locks.kernel_view(os.stat(lock_path(lock_dir, engine)))
    threads = len(os.listdir(f"/proc/{proxy.proc.pid}/task"))
    descriptors = len(os.listdir(f"/proc/{proxy.proc.pid}/fd"))
    assert busy.release() == 0
    # Nothing waits in the kernel for a request that has been answered.
    left = view.waiters.count(proxy.proc.pid)
    assert left == 0 and threads < 10 and descriptors < 20, (view, threads, descriptors)


def waiting_gauge(lanelock, backend) -> float:
    scraped = lanelock("metrics", "-b", backend)
    assert scraped.returncode == 0, scraped.stderr
    (value,) = re.findall(r"^lanelock_lane_waiters\{[^}]*\} (\S+)$", scraped.stdout, re.M)
    return float(value)


@pytest.mark.parametrize("wait", ["0", "0.3"])
def test_a_busy_answer_leaves_no_phantom_waiter(procs, lanelock, holder, lock_dir, wait):
    """A 503 -- after --wait 0's grace, or after waiting all of its wait --
    left the proxy's waiter thread blocked in flock(2) until the holder let go, and `status` said
    [1 waiting] and lanelock_lane_waiters 1 with nobody waiting. The answer is sent once nothing
    waits for it any more: no kernel wait, no queue entry, and every view says so."""
    engine = Engine(procs, delay=0.01)
    proxy = Proxy(procs, engine.backend, "--wait", "5", "--no-witness")
    busy = holder("-b", engine.backend, "-s", "long-job")
    lock = lock_path(lock_dir, engine)
    status, headers, _ = request(proxy.port, "POST", CHAT, chat_body(),
                                 {"X-Lanelock-Wait": wait})
    assert (status, headers["X-Lanelock-State"]) == (503, "busy")
    assert not is_waiting(lock, proxy.proc.pid), locks.kernel_view(os.stat(lock))
    lane = lane_status(lanelock, engine.backend)
    assert (lane["waiters"], lane["queue"]) == ([], []), lane
    plain = lanelock("status", "-b", engine.backend).stdout
    assert "waiting" not in plain, plain
    assert waiting_gauge(lanelock, engine.backend) == 0
    assert busy.release() == 0


# -- 4. a client that hangs up mid-stream ---------------------------------------------------------
def test_client_hang_up_mid_stream_frees_the_lane_at_once(procs, lanelock, lock_dir):
    engine = Engine(procs, tokens=200, interval=0.05)    # 10 s if nobody hung up
    proxy = Proxy(procs, engine.backend)
    sock = open_stream(proxy.port)
    read_until(sock, b"data: ")
    waiter = procs.start([*LANELOCK, "run", "--wait", "10", "-b", engine.backend, "-s", "waiter",
                          "--", "true"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wait_for(lambda: is_waiting(lock_path(lock_dir, engine), waiter.pid),
             what="the waiting turn to queue in the kernel")
    closed_at = time.monotonic()
    sock.close()
    assert waiter.wait(timeout=TIMEOUT) == 0
    events = history(lanelock, engine.backend)
    (acquired,) = [event for event in events
                   if event["event"] == "acquired" and event["pid"] == waiter.pid]
    free_after = acquired["monotonic"] - closed_at
    print(f"\nlane taken by the waiting turn {free_after * 1000:.1f} ms after the hang-up")
    assert free_after < 0.1
    stats = wait_for(lambda: (lambda seen: seen if seen["hangups"] == 1 else None)(engine.stats()),
                     what="the stand-in to see the hang-up")
    assert stats["in_flight"] == 0 and stats["max_in_flight"] == 1


def test_client_hang_up_while_waiting_abandons_the_wait(procs, lanelock, holder, lock_dir):
    """The hung-up request's wait stayed blocked in the kernel (status: [1
    waiting]) until the holder let go, and history never showed it. Now nothing waits for it
    once the proxy has seen it go, and the journal says it was abandoned, after how long."""
    engine = Engine(procs, delay=0.01)
    proxy = Proxy(procs, engine.backend, "--wait", "30", "-v", "--no-witness")
    busy = holder("-b", engine.backend, "-s", "holder")
    lock = lock_path(lock_dir, engine)
    sock = open_stream(proxy.port, chat_body(), {"X-Lanelock-Session": "gone"})
    wait_for(lambda: is_waiting(lock, proxy.proc.pid),
             what="the proxied request to wait for the lane")
    sock.close()
    # The proxy's -v line for the request comes once it is done with it (on its stderr pipe).
    proxy.said(" client gone ")
    assert not is_waiting(lock, proxy.proc.pid), locks.kernel_view(os.stat(lock))
    lane = lane_status(lanelock, engine.backend)
    assert (lane["waiters"], lane["queue"]) == ([], []), lane
    (gone,) = [event for event in history(lanelock, engine.backend)
               if event.get("session") == "gone"]
    assert gone["event"] == "abandoned" and gone["reason"] == "client_gone", gone
    assert gone["waited"] > 0 and gone["wait"] == 30 and gone["via"] == "proxy", gone
    shown = lanelock("history", "-b", engine.backend).stdout
    assert "abandoned" in shown and "the client hung up after waiting" in shown, shown
    assert busy.release() == 0
    assert turn_state(lanelock, engine.backend, "--wait", "5") == (0, "held")
    assert engine.stats()["total"] == 0            # the abandoned request was never forwarded
    assert proxy.stop() == 0


# -- 5. kill -9 of the proxy mid-stream -----------------------------------------------------------
def test_proxy_killed_mid_stream_frees_the_lane(procs, lanelock):
    engine = Engine(procs, tokens=200, interval=0.05)
    proxy = Proxy(procs, engine.backend)
    sock = open_stream(proxy.port)
    read_until(sock, b"data: ")
    assert probe(lanelock, engine.backend) == 1
    assert proxy.stop(signal.SIGKILL) == -signal.SIGKILL
    assert turn_state(lanelock, engine.backend) == (0, "held")
    read_all(sock)     # the client's answer ends (EOF or reset): nobody relays it any more
    sock.close()


# -- 6. linger -------------------------------------------------------------------------------------
def status_in_process(backend) -> dict:
    """`lanelock status -b BACKEND --json` through the CLI's entry point (no process start, so
    it fits comfortably inside a one-second linger)."""
    import contextlib
    import io

    from lanelock.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["status", "-b", backend, "--json"]) == 0
    (lane,) = json.loads(out.getvalue())["lanes"]
    return lane


def test_linger_keeps_the_lane_for_the_same_session_only(procs, lanelock):
    engine = Engine(procs, delay=0.05)
    proxy = Proxy(procs, engine.backend, "--linger", "1")
    alice, bob = {"X-Lanelock-Session": "alice"}, {"X-Lanelock-Session": "bob"}

    first = request(proxy.port, "POST", CHAT, chat_body(), alice)
    lingering = status_in_process(engine.backend)
    other = request(proxy.port, "POST", CHAT, chat_body(), bob)
    second = request(proxy.port, "POST", CHAT, chat_body(), alice)
    ended_at = time.monotonic()
    waiter = lanelock("run", "--wait", "5", "-b", engine.backend, "-s", "waiter", "--", "true")

    assert first[0] == 200 and first[1]["X-Lanelock-State"] == "held"
    assert lingering["state"] == "held" and lingering["holder"]["session"] == "alice", lingering
    assert other[0] == 503 and other[1]["X-Lanelock-State"] == "busy", other
    assert other[1]["X-Lanelock-Reason"] == "local_backend_busy"
    assert second[0] == 200 and second[1]["X-Lanelock-State"] == "held"
    assert waiter.returncode == 0, waiter.stderr
    events = history(lanelock, engine.backend)
    acquired = [event for event in events if event["event"] == "acquired"]
    assert [event["session"] for event in acquired] == ["alice", "waiter"]   # one turn for alice
    taken_after = acquired[-1]["monotonic"] - ended_at
    assert taken_after >= 0.9, taken_after   # the linger (1 s) ran from the end of the last answer
    assert engine.stats()["total"] == 2 and engine.stats()["max_in_flight"] == 1


def test_linger_never_lets_another_session_generate_beside_it(procs, lanelock):
    """Regression: a turn kept for a session outlives the request's task, and a later request's
    task could get the same id() and pass as nested in it -- then generate beside the session's
    next request (the engine saw two generations at once)."""
    engine = Engine(procs, delay=0.3)
    proxy = Proxy(procs, engine.backend, "--linger", "5")
    assert request(proxy.port, "POST", CHAT, chat_body(), {"X-Lanelock-Session": "alice"})[0] == 200
    for index in range(5):   # each a new connection, so a new handler task
        status, headers, _ = request(proxy.port, "POST", CHAT, chat_body(),
                                     {"X-Lanelock-Session": f"bob-{index}"})
        assert (status, headers["X-Lanelock-State"]) == (503, "busy")
    assert engine.stats()["total"] == 1
    assert proxy.stop() == 0     # a lingering lane is let go on shutdown
    assert probe(lanelock, engine.backend) == 0


# -- 7. fail open, errors and limits ---------------------------------------------------------------
def test_unusable_lock_root_fails_open_with_one_warning(procs, lanelock, lock_dir):
    lock_dir.write_text("a regular file where the lock root should be\n")
    engine = Engine(procs, delay=0.01)
    proxy = Proxy(procs, engine.backend)
    for _ in range(10):
        status, headers, body = request(proxy.port, "POST", CHAT, chat_body())
        assert status == 200 and headers["X-Lanelock-State"] == "fail-open"
        assert b"answer from stand-in" in body
    assert proxy.stop() == 0
    warnings = [line for line in proxy.lines if "warning" in line]
    assert len(warnings) == 1 and "gate unavailable" in warnings[0], proxy.stderr()
    assert engine.stats()["total"] == 10


def test_dead_backend_answers_502_and_frees_the_lane(procs, lanelock):
    backend = f"127.0.0.1:{free_port()}"
    proxy = Proxy(procs, backend)
    status, headers, body = request(proxy.port, "POST", CHAT, chat_body(user="dora"))
    assert status == 502 and headers["Content-Type"].startswith("application/json")
    error = json.loads(body)["error"]
    assert error["type"] == error["code"] == "local_backend_down"
    assert error["message"].startswith(f"local model not answering (the local engine at "
                                       f"http://{backend} did not answer: ")
    assert (headers["X-Lanelock-State"], headers["X-Lanelock-Reason"]) == \
        ("down", "local_backend_down")
    assert probe(lanelock, backend) == 0      # released before the answer was sent
    released = [event for event in history(lanelock, backend) if event["event"] == "released"]
    assert len(released) == 1 and released[0]["exit_status"] == 502
    assert released[0]["session"] == "dora"        # no session header: the body's "user"
    proxy.said("local_backend_down: local model not answering")


def test_oversized_bodies_and_headers_are_refused(procs, lanelock):
    engine = Engine(procs, delay=0.01)
    proxy = Proxy(procs, engine.backend)
    frame = b'{"messages": [], "pad": ""}'
    largest = frame[:-2] + b"x" * ((32 << 20) - len(frame)) + frame[-2:]    # exactly 32 MiB
    assert request(proxy.port, "POST", CHAT, largest)[0] == 200
    status, _, body = request(proxy.port, "POST", CHAT, largest[:-2] + b'x"}')
    assert status == 413 and json.loads(body)["error"]["type"] == "request_too_large"
    longest = {"X-Padding": "y" * ((16 << 10) - len("X-Padding"))}          # exactly 16 KiB
    assert request(proxy.port, "POST", CHAT, chat_body(), longest)[0] == 200
    field = request(proxy.port, "POST", CHAT, chat_body(), {"X-Padding": "y" * (16 << 10)})
    assert field[0] == 431 and json.loads(field[2])["error"]["type"] == \
        "request_header_fields_too_large"
    many = {f"X-Padding-{index}": "z" * (15 << 10) for index in range(5)}   # 75 KiB in all
    assert request(proxy.port, "POST", CHAT, chat_body(), many)[0] == 431
    for count in (257, 300, 20000):       # too many fields: the same JSON 431, not aiohttp's 400
        fields = {f"X-F{index}": "v" for index in range(count)}
        status, _, body = raw_request(proxy.port, "POST", CHAT, chat_body(), fields)
        assert status == 431 and json.loads(body)["error"]["type"] == \
            "request_header_fields_too_large", (count, body[:200])
    # (the stand-in, Python's http.server, takes at most 100 fields itself)
    fine = request(proxy.port, "POST", CHAT, chat_body(), {f"X-F{index}": "v" for index in range(90)})
    assert fine[0] == 200, fine[2]
    assert engine.stats()["total"] == 3       # only the three within the limits reached it
    assert not [event for event in history(lanelock, engine.backend)
                if event["event"] not in ("acquired", "released")]


def test_token_is_required_and_never_forwarded(procs, lanelock):
    recorder = Recorder(procs)
    token = secrets.token_hex(16)
    proxy = Proxy(procs, f"127.0.0.1:{recorder.port}", "--token-env", "LANELOCK_TEST_TOKEN",
                  "--no-witness", env={"LANELOCK_TEST_TOKEN": token})   # the recorder records all

    missing = request(proxy.port, "POST", CHAT, chat_body())
    wrong = request(proxy.port, "POST", CHAT, chat_body(), {"Authorization": "Bearer nope"})
    ungated = request(proxy.port, "GET", "/v1/models")
    right = request(proxy.port, "POST", CHAT, chat_body(), {"Authorization": f"Bearer {token}"})
    spellings = [request(proxy.port, "POST", CHAT, chat_body(), {"Authorization": f"{scheme} {token}"})[0]
                 for scheme in ("bearer", "BEARER", "BeArEr")]    # RFC 7235: case-insensitive
    assert [missing[0], wrong[0], ungated[0], right[0]] == [401, 401, 401, 200]
    assert spellings == [200, 200, 200]
    assert json.loads(missing[2])["error"]["type"] == "unauthorized"
    assert b"answer from recorder" in right[2]
    for _ in range(4):                      # only the authorised requests reached the engine
        seen = recorder.next_request()
        assert seen["path"] == CHAT and "authorization" not in seen["headers"]
    assert proxy.stop() == 0 and token not in proxy.stderr()


@pytest.mark.parametrize("listen", ["0.0.0.0:0", "[::]:0", "192.0.2.1:0"])
def test_non_loopback_listen_needs_a_token(lanelock, listen):
    refused = lanelock("proxy", "--listen", listen, "-b", "127.0.0.1:9")
    assert refused.returncode == 2
    assert "--token-env" in refused.stderr and "loopback" in refused.stderr


@pytest.mark.parametrize("listen", ["127.1:0", "0x7f.0.0.1:0", "LOCALHOST:0",
                                    "http://127.0.0.1:0/", "0"])
def test_loopback_spellings_listen_on_loopback_without_a_token(procs, listen):
    """127.1 is 127.0.0.1 here as in every backend (inet_aton); the URL a client is given and a
    bare port are what users type too."""
    proxy = Proxy(procs, "127.0.0.1:9", "--listen", listen)
    assert "listening on http://127.0.0.1:" in proxy.found.string   # later lines may follow
    status, _, body = request(proxy.port, "GET", "/lanelock/status")
    assert status == 200 and json.loads(body)["lanes"][0]["lane"] == "localhost:9"
    assert proxy.stop() == 0


@pytest.mark.parametrize("listen", [":0", "https://127.0.0.1:0", "127.0.0.1:0/v1", "127.0.0.1:"])
def test_a_listen_address_that_is_not_one_says_so(lanelock, listen):
    refused = lanelock("proxy", "--listen", listen, "-b", "127.0.0.1:9")
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.startswith("lanelock: --listen ") and refused.stderr.count("\n") == 1
    assert "expected HOST:PORT or a port" in refused.stderr


def test_fallback_key_reaches_the_fallback_and_nowhere_else(procs, lanelock, holder, lock_dir):
    engine = Engine(procs, delay=0.01)
    cloud = Recorder(procs)
    key = "sk-lanelock-test-" + secrets.token_hex(12)
    proxy = Proxy(procs, engine.backend, "--fallback", cloud.url + "/v1", "--fallback-model",
                  "cloud-model", "--fallback-key-env", "LANELOCK_TEST_FALLBACK_KEY",
                  env={"LANELOCK_TEST_FALLBACK_KEY": key})
    busy = holder("-b", engine.backend, "-s", "holder")
    status, headers, body = request(proxy.port, "POST", CHAT, chat_body(),
                                    {"Authorization": "Bearer the-clients-own"})
    assert status == 200 and headers["X-Lanelock-State"] == "deflected"
    assert json.loads(body)["choices"][0]["message"]["content"] == "answer from recorder"
    seen = cloud.next_request()
    assert seen["path"] == CHAT and seen["headers"]["authorization"] == f"Bearer {key}"
    assert json.loads(seen["body"])["model"] == "cloud-model"
    assert busy.release() == 0
    assert request(proxy.port, "POST", CHAT, chat_body())[1]["X-Lanelock-State"] == "held"

    shown = [request(proxy.port, "GET", "/lanelock/status")[2].decode(),
             lanelock("status", "-b", engine.backend, "--json").stdout,
             lanelock("history", "-b", engine.backend, "--json").stdout]
    assert proxy.stop() == 0
    shown.append(proxy.stderr())
    shown += [path.read_text(errors="replace") for path in lock_dir.iterdir() if path.is_file()]
    assert any("deflected" in text for text in shown)   # the records were there to look at
    assert not [text for text in shown if key in text]


# -- 8. SIGTERM with an answer in flight -----------------------------------------------------------
def test_sigterm_lets_the_answer_in_flight_finish(procs, lanelock):
    engine = Engine(procs, tokens=20, interval=0.05)
    proxy = Proxy(procs, engine.backend)
    sock = open_stream(proxy.port)
    seen = read_until(sock, b"data: ")
    proxy.proc.send_signal(signal.SIGTERM)
    seen = read_all(sock, seen)
    sock.close()
    assert proxy.wait() == 0      # once: a second SIGTERM could land after asyncio let go of it
    assert seen.count(b"data: ") == 21 and b"data: [DONE]\n\n" in seen
    assert seen.endswith(b"0\r\n\r\n")          # the chunked answer's proper end
    assert "proxy stopping" in proxy.stderr()
    assert probe(lanelock, engine.backend) == 0
    assert engine.stats()["hangups"] == 0


@pytest.mark.slow   # it waits out the whole 10 s bound, which is what it proves: CI's slow tier
def test_sigterm_with_a_longer_stream_in_flight_ends_within_the_documented_bound(procs, lanelock):
    """README: SIGTERM lets answers in flight finish for up to 10 s, then closes (21-22 s,
    past the systemd unit's TimeoutStopSec=15). A 20 s stream is cut, the lane is let go."""
    bound = float(re.search(r"finish for up to (\d+) s", README.read_text()).group(1))
    unit_stop = float(re.search(r"TimeoutStopSec=(\d+)", README.read_text()).group(1))
    assert bound < unit_stop
    engine = Engine(procs, tokens=400, interval=0.05)
    proxy = Proxy(procs, engine.backend)
    sock = open_stream(proxy.port)
    read_until(sock, b"data: ")
    signalled = time.monotonic()
    proxy.proc.send_signal(signal.SIGTERM)
    assert proxy.wait() == 0
    took = time.monotonic() - signalled
    sock.close()
    assert took < bound + 1.0, f"the proxy took {took:.1f}s to stop"
    assert probe(lanelock, engine.backend) == 0
