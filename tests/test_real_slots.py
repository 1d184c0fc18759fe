"""Real tier (pytest -m real): what a real llama-server (--parallel 2) says of its slots, and what it
does with a request's id_slot -- the two behaviours the stand-in copies (GET /props, a busy slot
named again waits for it) and engine_slots.slot_count reads."""

from __future__ import annotations

import http.client
import json
import threading
import urllib.parse
import urllib.request

import pytest

from support.cli import TIMEOUT
from support.processes import wait_for
from lanelock.engine_slots import slot_count
from support.real_backend import two_slots  # noqa: F401 - a fixture
from support.standin_kind import Served

pytestmark = pytest.mark.real


def get(url: str):
    with urllib.request.urlopen(url, timeout=TIMEOUT) as response:
        return json.load(response)


def test_a_real_llama_server_says_its_slots_as_the_stand_in_does(two_slots, procs, tmp_path):
    assert slot_count(two_slots) == 2
    real = get(two_slots + "/props")
    standin = get(Served(procs, tmp_path, "--kind", "llama.cpp", "--parallel", "2").url + "/props")
    assert standin.keys() <= real.keys(), standin.keys() - real.keys()
    for field in ("total_slots", "endpoint_slots", "endpoint_metrics", "model_alias",
                  "build_info", "is_sleeping"):
        assert type(standin[field]) is type(real[field]), field
    assert standin["total_slots"] == real["total_slots"] == 2
    settings, real_settings = standin["default_generation_settings"], \
        real["default_generation_settings"]
    assert settings["params"].keys() <= real_settings["params"].keys()
    assert isinstance(real_settings["n_ctx"], int)


def completion(url: str, body: dict) -> dict:
    request = urllib.request.Request(url + "/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=TIMEOUT) as response:
        return json.load(response)


def deferred(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=TIMEOUT) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("llamacpp:requests_deferred "):
                return float(line.split()[1])
    return -1.0


def test_a_real_busy_slot_named_again_waits_for_it(two_slots):
    parts = urllib.parse.urlsplit(two_slots)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=TIMEOUT)
    conn.request("POST", "/completion", json.dumps(
        {"prompt": "Once upon a time", "n_predict": 1500, "ignore_eos": True, "stream": True,
         "id_slot": 0}), {"Content-Type": "application/json"})
    holding = conn.getresponse()
    assert holding.readline().startswith(b"data: ")        # slot 0 generates
    answer: dict = {}
    pinned = threading.Thread(target=lambda: answer.update(
        completion(two_slots, {"prompt": "Hello", "n_predict": 4, "id_slot": 0})))
    pinned.start()
    try:
        wait_for(lambda: deferred(two_slots) == 1, what="the pinned request deferred", timeout=30)
        assert [slot["is_processing"] for slot in get(two_slots + "/slots")] == [True, False]
        assert completion(two_slots, {"prompt": "Hi", "n_predict": 4})["id_slot"] == 1
        assert pinned.is_alive() and not answer
    finally:
        conn.close()            # the client hangs up: llama-server stops, slot 0 is free
        pinned.join(TIMEOUT)
    assert answer["id_slot"] == 0


def chat(url: str, messages: list, id_slot: int) -> dict:
    body = {"messages": messages, "max_tokens": 8, "temperature": 0, "id_slot": id_slot}
    request = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=TIMEOUT) as response:
        return json.load(response)


def test_a_session_pinned_to_its_slot_finds_its_prompt_after_others_used_the_other():
    """What `proxy --pin-slots` relies on: with the RAM prompt cache off, two other sessions
    taking turns on slot 1 leave slot 0's KV alone, and a session that comes back to slot 0
    processes only its new message."""
    from support.real_backend import llama_server

    def session(name: str) -> list:
        facts = " ".join(f"Fact {index}: {name} keeps lantern {index * 7 % 13} by the river."
                         for index in range(25))
        return [{"role": "system", "content": f"You are {name}. {facts}"},
                {"role": "user", "content": "Fact 3?"}]

    with llama_server(2, cache_ram=0) as url:
        first = chat(url, session("Alda"), 0)["timings"]
        for name in ("Bruno", "Cosima"):
            chat(url, session(name), 1)
        again = session("Alda") + [{"role": "assistant", "content": "Lantern 8."},
                                   {"role": "user", "content": "Fact 4?"}]
        back = chat(url, again, 0)["timings"]
    assert first["prompt_n"] > 200                       # the long prompt, processed once
    assert back["cache_n"] >= first["prompt_n"] - 1      # ... and found again in slot 0
    assert back["prompt_n"] < 40                         # only the new turn processed
