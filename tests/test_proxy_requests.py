"""What a request asks of `lanelock proxy`, and what it is told: an API turn's own
requests (turn.headers), the class and wait headers, Retry-After, and an engine that is down.

Real processes and real clients as in test_proxy.py (its engines, proxies and helpers): the
official openai and anthropic SDKs, curl, a `python -c` process holding an API turn.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import struct
import subprocess
import sys
import threading

import pytest

from support.cli import TIMEOUT
from support.http import read_all
from support.processes import read_line, wait_for
from support.engine import Engine
from support.ports import free_port
from support.proxy import (CHAT, Proxy, Recorder, chat_body, history, open_stream, probe, raw_request,
                           request)

pytest.importorskip("aiohttp")
PYTHON = sys.executable
needs_curl = pytest.mark.skipif(shutil.which("curl") is None, reason="curl not found")


# -- item 1: an API turn's requests through the proxy ----------------------------------------------
# A process holding an API turn that calls the proxy with the openai SDK: with turn.headers (as
# the client's default headers, and per request), and without them while asking to wait 30 s.
# Inside the turn it prints turn.headers and waits for a line on stdin (the test meanwhile tries
# the copied header from outside the holder's tree).
API_TURN = r"""
import asyncio, json, os, sys, time
import openai
from lanelock import Gate

backend, base, flavour = sys.argv[1:4]
MESSAGES = [{"role": "user", "content": "hi"}]

def described(started, raw=None, error=None):
    seconds = round(time.monotonic() - started, 3)
    if error is not None:
        return {"status": error.status_code, "seconds": seconds, "message": error.message,
                "state": error.response.headers.get("x-lanelock-state"),
                "retry": error.response.headers.get("x-should-retry")}
    return {"status": raw.status_code, "seconds": seconds,
            "state": raw.headers.get("x-lanelock-state"),
            "content": raw.parse().choices[0].message.content}

def ask(call):
    started = time.monotonic()
    try:
        return described(started, raw=call())
    except openai.APIStatusError as error:
        return described(started, error=error)

async def ask_async(call):
    started = time.monotonic()
    try:
        return described(started, raw=await call())
    except openai.APIStatusError as error:
        return described(started, error=error)

def told(turn):
    print(json.dumps(turn.headers), flush=True)
    sys.stdin.readline()

def sync():
    with Gate(backend).turn(session="agent") as turn:
        told(turn)
        handed = openai.OpenAI(base_url=base, api_key="unused", default_headers=turn.headers)
        plain = openai.OpenAI(base_url=base, api_key="unused")
        create = lambda client, **extra: client.chat.completions.with_raw_response.create(
            model="stand-in", messages=MESSAGES, **extra)
        return {"default_headers": ask(lambda: create(handed)),
                "extra_headers": ask(lambda: create(plain, extra_headers=turn.headers)),
                "without": ask(lambda: create(plain, extra_headers={"X-Lanelock-Wait": "30"}))}

async def asynchronous():
    async with Gate(backend).turn(session="agent") as turn:
        told(turn)
        handed = openai.AsyncOpenAI(base_url=base, api_key="unused", default_headers=turn.headers)
        plain = openai.AsyncOpenAI(base_url=base, api_key="unused")
        create = lambda client, **extra: client.chat.completions.with_raw_response.create(
            model="stand-in", messages=MESSAGES, **extra)
        return {"default_headers": await ask_async(lambda: create(handed)),
                "extra_headers": await ask_async(lambda: create(plain, extra_headers=turn.headers)),
                "without": await ask_async(lambda: create(plain,
                                                          extra_headers={"X-Lanelock-Wait": "30"}))}

result = sync() if flavour == "sync" else asyncio.run(asynchronous())
print(json.dumps({"pid": os.getpid(), **result}), flush=True)
"""


@pytest.fixture(params=["flock", pytest.param("postgresql", marks=pytest.mark.slow)])
def store(request, monkeypatch) -> str:
    """Each store in turn: the flock store of the test's LANELOCK_DIR, or the session's
    PostgreSQL server (skipped without one)."""
    if request.param == "postgresql":
        monkeypatch.setenv("LANELOCK_STORE", request.getfixturevalue("postgres").dsn)
    return request.param


@needs_curl
@pytest.mark.parametrize("flavour", ["sync", "asyncio"])
def test_an_api_turn_sends_turn_headers_to_be_part_of_its_turn(flavour, store, procs, lanelock):
    """turn.headers makes the API turn's own requests part of it; without them the holder is
    told at once (not after the 30 s it asked to wait, not retried by the SDK) what to send; the
    header copied into a process outside the holder's tree is busy like anyone else."""
    pytest.importorskip("openai")
    engine = Engine(procs, delay=0.01)
    proxy = Proxy(procs, engine.backend, "--wait", "30")
    client = procs.start([PYTHON, "-c", API_TURN, engine.backend, proxy.url + "/v1", flavour],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    headers = json.loads(read_line(client.stdout))
    assert list(headers) == ["X-Lanelock-Turns"] and re.fullmatch(r"[0-9a-f]{32}",
                                                                   headers["X-Lanelock-Turns"])
    copied = subprocess.run(["curl", "-s", "-D", "-", "-o", "/dev/null", "-H",
                             "Content-Type: application/json", "-H", "X-Lanelock-Wait: 0", "-H",
                             f"X-Lanelock-Turns: {headers['X-Lanelock-Turns']}",
                             "--data-binary", chat_body().decode(), proxy.url + CHAT],
                            capture_output=True, text=True, timeout=TIMEOUT)
    assert re.search(r"^HTTP/\S+ 503", copied.stdout, re.M), copied.stdout
    assert re.search(r"^X-Lanelock-State: busy", copied.stdout, re.M | re.I), copied.stdout
    out, err = client.communicate(b"go\n", timeout=TIMEOUT)
    assert client.returncode == 0, err.decode()
    report = json.loads(out.decode().strip().splitlines()[-1])
    for way in ("default_headers", "extra_headers"):
        assert report[way]["status"] == 200, report
        assert report[way]["state"] == "held" and report[way]["content"] == "answer from stand-in"
    without = report["without"]
    assert (without["status"], without["state"], without["retry"]) == (503, "busy", "false")
    assert without["message"].endswith(   # after the SDK's "Error code: 503 - "
        f" - this process holds the lane (pid {report['pid']}, session agent): send turn.headers "
        "with the request to make it part of the turn"), without
    assert without["seconds"] < 10, without      # it asked for 30 s: never waits for itself
    assert engine.stats()["total"] == 2 and engine.stats()["max_in_flight"] == 1
    acquired = [event for event in history(lanelock, engine.backend)
                if event["event"] == "acquired"]
    assert [event["session"] for event in acquired] == ["agent"], "part of the turn: no turn of "\
        "their own"
    assert probe(lanelock, engine.backend) == 0


def test_turn_headers_are_never_forwarded(procs, holder):
    """The token names a turn on this machine: neither the engine nor a fallback is sent it."""
    recorder = Recorder(procs)
    cloud = Recorder(procs)
    proxy = Proxy(procs, f"127.0.0.1:{recorder.port}", "--no-witness", "--fallback",
                  cloud.url + "/v1")
    sent = {"X-Lanelock-Turns": "0" * 32}
    assert request(proxy.port, "POST", CHAT, chat_body(), sent)[0] == 200
    assert "x-lanelock-turns" not in recorder.next_request()["headers"]
    busy = holder("-b", f"127.0.0.1:{recorder.port}")
    status, headers, _ = request(proxy.port, "POST", CHAT, chat_body(), sent)
    assert (status, headers["X-Lanelock-State"]) == (200, "deflected")
    assert "x-lanelock-turns" not in cloud.next_request()["headers"]
    assert busy.release() == 0


# -- item 5: the class and wait headers ---------------------------------------------------------
@needs_curl
def test_a_malformed_class_or_wait_header_is_a_400_naming_it(procs, lanelock):
    """Each spelling that says nothing usable is refused in the client's dialect, by the SDKs as
    their BadRequestError, before the lane is asked: the engine never hears of them."""
    openai = pytest.importorskip("openai")
    anthropic = pytest.importorskip("anthropic")
    engine = Engine(procs, delay=0.01)
    proxy = Proxy(procs, engine.backend)
    gpt = openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0)
    for header, value in (("X-Lanelock-Wait", "abc"), ("X-Lanelock-Wait", "-1"),
                          ("X-Lanelock-Wait", "nan"), ("X-Lanelock-Wait", ""),
                          ("X-Lanelock-Priority", "bogus"), ("X-Lanelock-Priority", "")):
        with pytest.raises(openai.BadRequestError) as refused:
            gpt.chat.completions.create(model="stand-in", messages=[
                {"role": "user", "content": "hi"}], extra_headers={header: value})
        assert refused.value.param == header and refused.value.code == "invalid_lanelock_header"
        assert refused.value.body["message"].startswith(f"{header}: {value!r} is not ")
    claude = anthropic.Anthropic(base_url=proxy.url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.create(model="local", max_tokens=8, extra_headers={
            "X-Lanelock-Priority": "urgent"}, messages=[{"role": "user", "content": "hi"}])
    assert refused.value.body["error"]["type"] == "invalid_request_error"
    assert refused.value.body["error"]["message"].startswith(
        "X-Lanelock-Priority: 'urgent' is not a class: interactive, normal, batch")
    curled = subprocess.run(["curl", "-s", "-D", "-", "-H", "X-Lanelock-Wait: 5 seconds",
                             "--data-binary", "{}", proxy.url + "/api/chat"],
                            capture_output=True, text=True, timeout=TIMEOUT)
    head, _, body = curled.stdout.partition("\n\n")   # text mode: CRLF reads as \n
    assert head.startswith("HTTP/1.1 400") and json.loads(body) == {
        "error": "X-Lanelock-Wait: '5 seconds' is not a number of seconds, 0 or more ('inf': "
                 "as long as the proxy's --max-wait allows)"}
    assert engine.stats()["total"] == 0 and history(lanelock, engine.backend) == []


def test_every_gated_answer_says_the_class_and_wait_it_applied_and_the_caps(procs, holder):
    """Under --max-wait 2 and --max-priority normal: a wait of 10 is 2, interactive is normal,
    and each answer -- held, busy, deflected -- says so; without the headers, the proxy's own
    (--wait 1, --priority batch)."""
    engine = Engine(procs, delay=0.01)
    cloud = Engine(procs, delay=0.01, name="cloud")
    proxy = Proxy(procs, engine.backend, "--wait", "1", "--max-wait", "2", "--max-priority",
                  "normal", "--priority", "batch")
    deflecting = Proxy(procs, engine.backend, "--fallback", cloud.url + "/v1", "--max-wait", "0")
    asked = {"X-Lanelock-Wait": "10", "X-Lanelock-Priority": "Interactive"}

    def told(headers) -> tuple:
        return tuple(headers.get(name) for name in (
            "X-Lanelock-State", "X-Lanelock-Priority", "X-Lanelock-Wait",
            "X-Lanelock-Max-Priority", "X-Lanelock-Max-Wait"))

    status, headers, _ = request(proxy.port, "POST", CHAT, chat_body(), asked)
    assert (status, *told(headers)) == (200, "held", "normal", "2", "normal", "2")
    status, headers, _ = request(proxy.port, "POST", CHAT, chat_body())
    assert (status, *told(headers)) == (200, "held", "batch", "1", "normal", "2")
    busy = holder("-b", engine.backend)
    status, headers, _ = request(proxy.port, "POST", CHAT, chat_body(),
                                 {"X-Lanelock-Wait": "0.2", "X-Lanelock-Priority": "batch"})
    assert (status, *told(headers)) == (503, "busy", "batch", "0.2", "normal", "2")
    status, headers, _ = request(deflecting.port, "POST", CHAT, chat_body(), asked)
    assert (status, *told(headers)) == (200, "deflected", "interactive", "0", "interactive",
                                        "0")
    assert busy.release() == 0


# -- item 7: the local engine down -----------------------------------------------------------------
class Resetting:
    """An engine that accepts each connection and resets it before answering a byte (SO_LINGER
    0: the kernel sends RST), on a thread of the test's own."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.recv(65536)   # the request arrived: now reset it
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()

    def close(self):
        self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self.thread.join(TIMEOUT)


def test_a_dead_engine_sends_the_request_down_the_fallback_chain(procs, lanelock):
    """Refused, or reset before a byte came back: the fallbacks are walked as for a busy lane
    (an unreachable one skipped), with reason local_backend_down; the lane is let go."""
    cloud = Recorder(procs)
    second = Engine(procs, delay=0.01, name="second")
    dead = free_port()
    resetting = Resetting()
    try:
        for backend in (f"127.0.0.1:{dead}", f"127.0.0.1:{resetting.port}"):
            proxy = Proxy(procs, backend, "--no-witness", "--fallback",
                          f"http://127.0.0.1:{free_port()}/v1", "--fallback", cloud.url + "/v1")
            status, headers, body = request(proxy.port, "POST", CHAT, chat_body())
            assert (status, headers["X-Lanelock-State"], headers["X-Lanelock-Reason"]) == \
                (200, "deflected", "local_backend_down"), body
            assert json.loads(body)["choices"][0]["message"]["content"] == \
                "answer from recorder"
            assert cloud.next_request()["path"] == CHAT
            assert probe(lanelock, backend) == 0
            proxy.said("local_backend_down: local model not answering (the local engine at "
                       f"http://{backend} did not answer: ")
            released = [event for event in history(lanelock, backend)
                        if event["event"] == "released"]
            assert [event["exit_status"] for event in released] == [502]
        # another local engine, on its own lane
        proxy = Proxy(procs, f"127.0.0.1:{dead}", "--no-witness",
                      "--fallback", f"@{second.backend}")
        status, headers, body = raw_request(proxy.port, "POST", CHAT, chat_body())
        assert (status, headers["x-lanelock-state"], headers["x-lanelock-reason"]) == \
            (200, "deflected", "local_backend_down")
        assert second.stats()["total"] == 1
    finally:
        resetting.close()


def test_a_dead_engine_with_no_fallback_left_is_a_502_naming_each_attempt(procs):
    dead, gone = free_port(), free_port()
    proxy = Proxy(procs, f"127.0.0.1:{dead}", "--no-witness", "--fallback",
                  f"http://127.0.0.1:{gone}/v1", "--fallback", f"anthropic=http://127.0.0.1:{gone}")
    status, headers, body = request(proxy.port, "POST", CHAT, chat_body())
    error = json.loads(body)["error"]
    assert (status, error["type"], headers["X-Lanelock-Reason"]) == \
        (502, "local_backend_down", "local_backend_down")
    assert error["message"].startswith(f"local model not answering (the local engine at "
                                       f"http://127.0.0.1:{dead} did not answer: ")
    assert f"; fallback 1 http://127.0.0.1:{gone}/v1 failed: " in error["message"]
    assert "fallback 2" not in error["message"]    # an anthropic fallback takes no OpenAI request
    status, headers, body = raw_request(proxy.port, "POST", "/v1/messages", chat_body())
    answer = json.loads(body)
    assert (status, answer["type"], answer["error"]["type"]) == (502, "error", "api_error")
    assert f"fallback 2 http://127.0.0.1:{gone} failed: " in answer["error"]["message"]


# -- item 2: Retry-After ---------------------------------------------------------------------------
def test_retry_after_counts_holds_not_the_time_requests_waited(procs, holder):
    """Eight requests queue behind a turn and are served in 0.3 s holds, the last after waiting
    two seconds and more: the next busy answer expects the holder's hold, not a median of waits.
    -v prints each request's wait and hold apart."""
    engine = Engine(procs, delay=0.3)
    proxy = Proxy(procs, engine.backend, "--wait", "60", "-v")
    first = holder("-b", engine.backend)
    gate = __import__("lanelock").Gate(engine.backend)
    socks = []
    for count in range(1, 9):
        socks.append(open_stream(proxy.port, chat_body()))
        wait_for(lambda: len(gate.store.survey(gate.lane)[0].queue) == count,
                 what=f"request {count} to queue")
    assert first.release() == 0
    answers = [read_all(sock) for sock in socks]
    for sock in socks:
        sock.close()
    assert all(answer.startswith(b"HTTP/1.1 200") for answer in answers)
    second = holder("-b", engine.backend)
    status, headers, _ = request(proxy.port, "POST", CHAT, chat_body(), {"X-Lanelock-Wait": "0"})
    assert (status, headers["Retry-After"]) == (503, "1")
    assert second.release() == 0
    proxy.until(lambda log: log.count("] POST ") == 9, "nine request lines")
    lines = [line for line in proxy.stderr().splitlines() if "] POST " in line]   # [session]
    times = [re.search(r" 200 held on seat 1 \(waited (\d+\.\d+)s, held (\d+\.\d+)s\)$", line)
             for line in lines[:8]]
    assert all(times), lines
    waited = [float(found.group(1)) for found in times]
    held = [float(found.group(2)) for found in times]
    assert all(0.3 <= seconds < waited[-1] for seconds in held), lines
    assert re.search(r" 503 busy \(waited \d+\.\d+s\)$", lines[8]), lines[8]


def test_retry_after_is_the_holders_rest_then_a_hold_per_waiter_ahead():
    """The estimate itself: the waiters of the request's class and higher (as aged) go first."""
    from lanelock.estimate import ahead, until_lane as estimate

    queue = [{"effective_class": klass} for klass in
             ("interactive", "interactive", "normal", "batch", "batch", "batch")]
    assert [ahead(queue, klass) for klass in ("interactive", "normal", "batch")] == [2, 3, 6]
    assert estimate(2.0, 0.5, 0) == 2           # the rest of the holder's hold
    assert estimate(2.0, 5.0, 0) == 1           # held past typical: soon, but never 0
    assert estimate(2.0, 5.0, 3) == 6           # ... and a hold per waiter ahead
    assert estimate(2.0, 0.5, 3) == 8
