"""An engine's own slot count (lanelock/engine_slots.py), read from stand-in engines of every kind
in processes of their own, and the stand-in's llama-server behaviours it relies on: GET /props,
and a request's id_slot pinning its generation to that slot (a busy one waits for it)."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import urllib.request

import pytest

from support.cli import TIMEOUT
from support.processes import wait_for
from lanelock.engine_slots import CannotTell, slot_count
from support.standin_kind import Served

NAME = "tiny/model-1"


@pytest.mark.parametrize("kind", ["llama.cpp", "llama.cpp-legacy", "llama-swap", "sglang"])
def test_the_slot_count_is_the_engines_own(procs, tmp_path, kind):
    engine = Served(procs, tmp_path, "--kind", kind, "--parallel", "3", name=NAME)
    assert slot_count(engine.url) == 3
    assert engine.stats()["loads"] == []        # llama-swap: only the running model was asked


def test_vllm_in_dev_mode_says_its_max_num_seqs(procs, tmp_path):
    engine = Served(procs, tmp_path, "--kind", "vllm", "--parallel", "5", "--vllm-dev-mode")
    assert slot_count(engine.url) == 5


def test_llama_swap_names_the_running_model_and_never_loads_another(procs, tmp_path):
    engine = Served(procs, tmp_path, "--kind", "llama-swap", "--parallel", "2", name=NAME)
    assert slot_count(engine.url, model=NAME) == 2
    with pytest.raises(CannotTell, match="does not run other/model now") as caught:
        slot_count(engine.url, model="other/model")
    assert caught.value.kind == "llama-swap"
    assert engine.stats()["loads"] == []


@pytest.mark.parametrize("kind, why", [
    ("vllm", "vLLM says its max_num_seqs only at /server_info, which it serves with "
             "VLLM_SERVER_DEV_MODE=1"),
    ("ollama", "Ollama does not say how many requests it serves at once"),
    ("plain", "answers none of /running, /props, /slots"),
    ("garbage", "answered something that is not JSON"),
    ("odd", "/running lists something that is not a model"),
    ("redirect", "redirects (302) to http://127.0.0.1:1/elsewhere: not followed"),
    ("llama.cpp --loading", "is not ready (503 to /running, Loading model): try again once it "
                            "is up"),
    ("llama.cpp --api-key secret", "refuses lanelock's questions (401 to /running): it wants an API key"),
])
def test_an_engine_that_does_not_say_is_named_with_the_reason(procs, tmp_path, kind, why):
    kind, *more = kind.split()
    engine = Served(procs, tmp_path, "--kind", kind, "--parallel", "3", *more)
    with pytest.raises(CannotTell) as caught:
        slot_count(engine.url)
    assert why in str(caught.value)
    assert "\n" not in str(caught.value)


def test_an_engine_down_or_slow_cannot_tell(procs, tmp_path):
    with socket.socket() as closed:     # a port nobody listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    with pytest.raises(CannotTell, match=f"^http://127.0.0.1:{port}: Connection refused$"):
        slot_count(f"http://127.0.0.1:{port}")
    slow = Served(procs, tmp_path, "--kind", "llama.cpp", "--parallel", "3", "--slow", "5")
    with pytest.raises(CannotTell, match="did not answer within 0.3 s"):
        slot_count(slow.url, timeout=0.3)


def test_props_speaks_like_llama_server(procs, tmp_path):
    engine = Served(procs, tmp_path, "--kind", "llama.cpp", "--parallel", "4", "--no-slots")
    props = engine.get("/props")
    assert props["total_slots"] == 4
    assert props["default_generation_settings"]["n_ctx"] > 0
    assert "temperature" in props["default_generation_settings"]["params"]
    assert props["endpoint_slots"] is False and props["endpoint_metrics"] is False
    assert props["model_alias"] == "stand-in"
    assert slot_count(engine.url) == 4          # /props is enough: /slots is disabled here


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url + "/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=TIMEOUT) as response:
        return json.load(response)


def open_stream(engine: Served, id_slot: int) -> http.client.HTTPResponse:
    """A streamed generation pinned to id_slot, in flight once its first event is read."""
    conn = http.client.HTTPConnection("127.0.0.1", engine.port, timeout=TIMEOUT)
    conn.request("POST", "/v1/chat/completions", json.dumps(
        {"messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 1000,
         "id_slot": id_slot}), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.readline().startswith(b"data: ")
    return response


def test_id_slot_pins_a_generation_to_that_slot(procs, tmp_path):
    engine = Served(procs, tmp_path, "--kind", "llama.cpp", "--parallel", "3", "--delay", "0")
    answers = [post(engine.url, {"prompt": "hi", "id_slot": slot}) for slot in (2, 1, 2)]
    assert [answer["id_slot"] for answer in answers] == [2, 1, 2]
    # Anything but a slot of this engine lets it choose, as llama-server does (the first free).
    assert [post(engine.url, {"prompt": "hi", "id_slot": value})["id_slot"]
            for value in (-1, 3, "1", True, None)] == [0] * 5
    generations = engine.stats()["generations"]
    assert [(g["slot"], g["id_slot"]) for g in generations] == \
        [(2, 2), (1, 1), (2, 2)] + [(0, None)] * 5


def test_a_busy_slot_named_again_waits_for_it_while_others_are_served(procs, tmp_path):
    engine = Served(procs, tmp_path, "--kind", "llama.cpp", "--parallel", "2",
                    "--delay", "0", "--token-interval", "0.05", "--metrics")
    holding = open_stream(engine, 0)
    answer: dict = {}
    pinned = threading.Thread(target=lambda: answer.update(post(engine.url, {"prompt": "again",
                                                                          "id_slot": 0})))
    pinned.start()
    try:
        # Deferred by the engine's own account, as llama-server defers it; slot 1 stays free.
        wait_for(lambda: "llamacpp:requests_deferred 1" in metrics(engine), what="deferred")
        assert [slot["is_processing"] for slot in engine.get("/slots")] == [True, False]
        assert post(engine.url, {"prompt": "other"})["id_slot"] == 1   # unpinned: served now
        assert pinned.is_alive() and not answer
    finally:
        holding.close()                  # the stream's client hangs up: slot 0 is free
        pinned.join(TIMEOUT)
    assert answer["id_slot"] == 0
    generations = engine.stats()["generations"]
    first, waited = generations[0], generations[1]
    assert waited["slot"] == 0 and waited["started"] >= first["started"]


def metrics(engine: Served) -> str:
    with urllib.request.urlopen(engine.url + "/metrics", timeout=10) as response:
        return response.read().decode()
