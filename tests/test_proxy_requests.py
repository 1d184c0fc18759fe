"""What a request asks of `lanelock proxy`, and what it is told (issue 31): an API turn's own
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

from conftest import TIMEOUT, read_line, wait_for
from test_proxy import (CHAT, Engine, Proxy, Recorder, chat_body, free_port, history,
                        open_stream, probe, raw_request, read_all, request)

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


@needs_curl
@pytest.mark.parametrize("flavour", ["sync", "asyncio"])
def test_an_api_turn_sends_turn_headers_to_be_part_of_its_turn(flavour, procs, lanelock):
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
    assert (f"this process holds the lane (pid {report['pid']}, session agent): send "
            "turn.headers with the request to make it part of the turn") in without["message"]
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
