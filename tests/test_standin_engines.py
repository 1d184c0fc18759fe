"""The stand-in engine's own account of its work (lanelock/testing/standin.py, --kind): llama.cpp's
/slots and /metrics, llama-swap's /running and /upstream/NAME/..., vLLM's and SGLang's /metrics,
Ollama's /api/ps, and the broken ones (garbage, odd, redirect, plain). Each stand-in is a real
`python -m lanelock.testing serve` process, asked over HTTP with urllib, as a witness would ask a
real engine. llama-swap, vLLM, SGLang and Ollama do not run here: what is checked is that the
stand-in speaks their documented shapes, and that its account follows the generations in flight."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from support.processes import wait_for

NAME = "tiny/model-1"          # a slash in it, as llama-swap model ids may have
ACCOUNTED = ("llama.cpp", "llama.cpp-legacy", "llama-swap", "vllm", "sglang")


class NoRedirect(urllib.request.HTTPRedirectHandler):
    """A 3xx is an answer to look at, not a place to go (redirect: 127.0.0.1:1)."""

    def redirect_request(self, *args, **kwargs):
        return None


OPENER = urllib.request.build_opener(NoRedirect)


def get(url: str) -> tuple[int, dict, bytes]:
    try:
        with OPENER.open(url, timeout=10) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        with error:
            return error.code, dict(error.headers), error.read()


def get_json(url: str):
    status, _, body = get(url)
    assert status == 200, (url, status, body)
    return json.loads(body)


def post(url: str, payload: dict) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        with error:
            return error.code, error.read()


def samples(text: str) -> dict[str, float]:
    """Prometheus text: each metric's value, summed over its label sets."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        series, value = line.rsplit(" ", 1)
        name = series.split("{", 1)[0]
        values[name] = values.get(name, 0.0) + float(value)
    return values


class StandIn:
    """`python -m lanelock.testing serve --port 0 --port-file F ARGS`, listening."""

    def __init__(self, procs, tmp_path, *args: str):
        number = len(list(tmp_path.glob("standin-*.stderr")))
        port_file = tmp_path / f"standin-{number}.port"
        self.stderr = tmp_path / f"standin-{number}.stderr"
        with open(self.stderr, "wb") as stderr:
            self.proc = procs.start([sys.executable, "-m", "lanelock.testing", "serve",
                                     "--port", "0", "--port-file", port_file, "--name", NAME,
                                     *args], stdout=subprocess.DEVNULL, stderr=stderr)
        # The serve command says it listens only in its port file (written whole, by rename):
        # no pipe to read, so the file is looked for, with a deadline, or the process's end.
        wait_for(lambda: port_file.exists() or self.proc.poll() is not None,
                 what="the stand-in's port file", timeout=30)
        assert self.proc.poll() is None, self.stderr.read_text()
        self.url = f"http://127.0.0.1:{port_file.read_text()}"

    def stats(self) -> dict:
        return get_json(self.url + "/stats")

    def stream(self, max_tokens: int = 1000):
        """A streamed chat completion, in flight once its first event is read: it runs until
        the test hangs up (hang_up) or reads it to its end."""
        request = urllib.request.Request(
            self.url + "/v1/chat/completions",
            data=json.dumps({"messages": [{"role": "user", "content": "hi"}], "stream": True,
                             "max_tokens": max_tokens}).encode(),
            headers={"Content-Type": "application/json"})
        response = urllib.request.urlopen(request, timeout=10)
        assert response.readline().startswith(b"data: ")
        return response

    def hang_up(self, response, in_flight: int = 0) -> None:
        response.close()
        # The stand-in notices a hang-up on its own, as llama-server does; nothing tells us when.
        wait_for(lambda: self.stats()["in_flight"] == in_flight,
                 what=f"{in_flight} generations in flight", timeout=30)

    def account(self, kind: str) -> dict:
        """{"processing", "deferred", "slots" (llama.cpp's list, or None)} in the kind's words,
        the words checked on the way."""
        if kind in ("llama.cpp", "llama.cpp-legacy", "llama-swap"):
            base = self.url
            if kind == "llama-swap":
                running = get_json(self.url + "/running")["running"]
                assert [(entry["model"], entry["state"]) for entry in running] == [(NAME, "ready")]
                assert {"cmd", "proxy", "ttl", "name", "description"} <= running[0].keys()
                base = f"{self.url}/upstream/{NAME}"
            slots = get_json(base + "/slots")
            status, headers, body = get(base + "/metrics")
            assert status == 200 and headers["Content-Type"].startswith("text/plain"), body
            values = samples(body.decode())
            for metric in ("prompt_tokens_total", "tokens_predicted_total", "n_decode_total"):
                assert f"# TYPE llamacpp:{metric} counter" in body.decode()
            for metric in ("requests_processing", "requests_deferred"):
                assert f"# TYPE llamacpp:{metric} gauge" in body.decode()
            processing = sum(slot["is_processing"] for slot in slots)
            assert values["llamacpp:requests_processing"] == processing
            return {"processing": processing, "slots": slots,
                    "deferred": values["llamacpp:requests_deferred"]}
        status, headers, body = get(self.url + "/metrics")
        assert status == 200 and headers["Content-Type"].startswith("text/plain"), body
        text, values = body.decode(), samples(body.decode())
        if kind == "vllm":
            labels = f'{{model_name="{NAME}",engine="0"}}'
            assert f"vllm:num_requests_running{labels} " in text
            assert f"vllm:num_requests_waiting{labels} " in text
            assert "# TYPE vllm:num_requests_running gauge" in text
            return {"processing": values["vllm:num_requests_running"],
                    "deferred": values["vllm:num_requests_waiting"], "slots": None}
        assert kind == "sglang"
        assert f'sglang:num_running_reqs{{model_name="{NAME}",' in text
        assert "# TYPE sglang:num_queue_reqs gauge" in text
        return {"processing": values["sglang:num_running_reqs"],
                "deferred": values["sglang:num_queue_reqs"], "slots": None}


@pytest.fixture
def standin(procs, tmp_path):
    """standin(*serve_args) -> StandIn, listening; killed with the test's processes."""
    return lambda *args: StandIn(procs, tmp_path, "--delay", "0.05", "--token-interval", "0.01",
                                 *args)


def in_flight(stats: dict) -> list[dict]:
    return [generation for generation in stats["generations"] if generation["ended"] is None]


# -- one generation, for every kind with an account of its work ----------------------------------
@pytest.mark.parametrize("kind", ACCOUNTED)
def test_the_account_shows_the_one_generation_in_flight(standin, kind):
    engine = standin("--kind", kind, "--metrics")
    idle = engine.account(kind)
    assert (idle["processing"], idle["deferred"]) == (0, 0)
    if kind == "llama.cpp-legacy":       # every slot has an id_task: -1 before its first task
        assert [slot["id_task"] for slot in idle["slots"]] == [-1]
        assert "stopping_word" in idle["slots"][0]["next_token"]
    elif idle["slots"] is not None:      # today's llama-server: no task yet, no id_task
        assert idle["slots"] == [{"id": 0, "n_ctx": 4096, "speculative": False,
                                  "is_processing": False}]

    response = engine.stream()
    busy = engine.account(kind)
    assert (busy["processing"], busy["deferred"]) == (1, 0)
    [generation] = in_flight(engine.stats())
    if busy["slots"] is not None:
        [slot] = busy["slots"]
        assert slot["is_processing"] and slot["id_task"] == generation["id"]
        assert {"params", "next_token", "n_ctx", "speculative"} <= slot.keys()
        token = slot["next_token"] if kind == "llama.cpp-legacy" else slot["next_token"][0]
        assert token["has_next_token"] and token["n_decoded"] >= 1
        assert token["n_remain"] == 1000 - token["n_decoded"]

    engine.hang_up(response)
    after = engine.account(kind)
    assert (after["processing"], after["deferred"]) == (0, 0)
    if after["slots"] is not None:       # an idle slot keeps its last task's id (task_prev)
        [slot] = after["slots"]
        assert (slot["is_processing"], slot["id_task"]) == (False, generation["id"])
        if kind != "llama.cpp-legacy":   # its stats reset on release, as llama-server's
            assert slot["next_token"] == [{"has_next_token": False, "has_new_line": False,
                                           "n_remain": -1, "n_decoded": 0}]
    stats = engine.stats()
    assert in_flight(stats) == [] and stats["hangups"] == 1
    assert stats["account_gets"] >= 3


# -- several generations, and the slots they have -------------------------------------------------
def test_two_slots_two_streams_both_processing(standin):
    engine = standin("--kind", "llama.cpp", "--parallel", "2", "--metrics")
    first, second = engine.stream(), engine.stream()
    account = engine.account("llama.cpp")
    assert (account["processing"], account["deferred"]) == (2, 0)
    tasks = sorted(generation["id"] for generation in in_flight(engine.stats()))
    assert sorted(slot["id_task"] for slot in account["slots"]) == tasks
    assert [slot["id"] for slot in account["slots"]] == [0, 1]
    engine.hang_up(first, in_flight=1)
    engine.hang_up(second)
    assert engine.account("llama.cpp")["processing"] == 0


@pytest.mark.parametrize("kind", ["llama.cpp", "vllm", "sglang"])
def test_one_slot_two_streams_one_processing_one_deferred(standin, kind):
    engine = standin("--kind", kind, "--parallel", "1", "--metrics")
    first = engine.stream()
    second = engine.stream()
    account = engine.account(kind)
    assert (account["processing"], account["deferred"]) == (1, 1)
    assert engine.stats()["in_flight"] == 2        # both served, as the contention record needs
    first_id, second_id = (generation["id"] for generation in in_flight(engine.stats()))
    if account["slots"] is not None:
        assert [slot["id_task"] for slot in account["slots"]] == [first_id]
    engine.hang_up(first, in_flight=1)             # the queued one takes the slot
    account = engine.account(kind)
    assert (account["processing"], account["deferred"]) == (1, 0)
    if account["slots"] is not None:
        assert [slot["id_task"] for slot in account["slots"]] == [second_id]
    engine.hang_up(second)
    assert engine.account(kind)["processing"] == 0


# -- what llama-server answers when it was not started with the endpoint --------------------------
def test_no_slots_and_no_metrics_answer_501_as_llama_server(standin):
    engine = standin("--no-slots")             # --kind llama.cpp is the default, --metrics off
    for path, what, flag in (("/slots", "slots", "--slots"), ("/metrics", "metrics", "--metrics")):
        status, headers, body = get(engine.url + path)
        assert status == 501 and headers["Content-Type"].startswith("application/json")
        assert json.loads(body) == {"error": {
            "code": 501, "type": "not_supported_error",
            "message": f"This server does not support {what} endpoint. Start it with `{flag}`"}}
    assert get_json(engine.url + "/health") == {"status": "ok"}
    assert engine.stats()["account_gets"] == 2


# -- llama-swap: a look at a model that is not running loads it -----------------------------------
def test_llama_swap_upstream_and_the_load_it_must_never_cause(standin):
    engine = standin("--kind", "llama-swap")
    for path in ("/slots", "/metrics"):                 # the proxy itself has neither
        assert get(engine.url + path)[0::2] == (404, b"404 page not found")
    upstream = f"{engine.url}/upstream/{NAME}"
    assert len(get_json(upstream + "/slots")) == 1
    assert get(upstream + "/metrics")[0] == 501        # llama-server without --metrics
    status, headers, _ = get(upstream)                 # llama-swap's canonical trailing slash
    assert (status, headers["Location"]) == (301, f"/upstream/{NAME}/")
    assert engine.stats()["loads"] == []
    status, _, body = get(engine.url + "/upstream/other-model/slots")
    assert status == 502 and b"other-model" in body
    assert engine.stats()["loads"] == ["other-model"]
    # Generations go through the proxy as before, and through /upstream/NAME/ too.
    assert post(engine.url + "/v1/chat/completions", {"messages": []})[0] == 200
    assert post(upstream + "/v1/chat/completions", {"messages": []})[0] == 200
    assert post(engine.url + "/upstream/third/v1/chat/completions", {"messages": []})[0] == 502
    stats = engine.stats()
    assert stats["loads"] == ["other-model", "third"] and stats["total"] == 2


# -- Ollama: the loaded model, nothing of the work ------------------------------------------------
def test_ollama_lists_the_loaded_model_and_nothing_of_the_work(standin):
    engine = standin("--kind", "ollama")
    assert get(engine.url + "/")[0::2] == (200, b"Ollama is running")
    for path in ("/slots", "/metrics"):
        assert get(engine.url + path)[0::2] == (404, b"404 page not found")
    idle = get_json(engine.url + "/api/ps")
    [model] = idle["models"]
    assert (model["name"], model["model"], model["context_length"]) == (NAME, NAME, 4096)
    assert {"size", "size_vram", "expires_at", "digest", "details"} <= model.keys()
    response = engine.stream()
    busy = get_json(engine.url + "/api/ps")
    assert [m["name"] for m in busy["models"]] == [NAME]   # the same, a generation or none
    engine.hang_up(response)


# -- engines whose account cannot be read ---------------------------------------------------------
def test_garbage_answers_bytes_that_are_no_json(standin):
    engine = standin("--kind", "garbage")
    status, _, body = get(engine.url + "/slots")
    assert status == 200
    with pytest.raises(ValueError):
        json.loads(body)
    status, _, body = get(engine.url + "/metrics")
    assert status == 200 and body


def test_odd_answers_json_of_the_wrong_shape(standin):
    engine = standin("--kind", "odd")
    assert get_json(engine.url + "/slots") == {"slots": "many"}
    status, _, body = get(engine.url + "/metrics")
    assert status == 200
    assert not any(name.startswith(("llamacpp:", "vllm:", "sglang:"))
                   for name in samples(body.decode()))


def test_redirect_sends_every_look_elsewhere(standin):
    engine = standin("--kind", "redirect")
    for path in ("/slots", "/metrics", "/running", "/api/ps"):
        status, headers, _ = get(engine.url + path)
        assert (status, headers["Location"]) == (302, "http://127.0.0.1:1/elsewhere"), path
    assert engine.stats()["account_gets"] == 4


def test_plain_has_no_account_as_before(standin):
    engine = standin("--kind", "plain")
    for path in ("/slots", "/metrics", "/running", "/api/ps"):
        assert get(engine.url + path)[0] == 404, path


def test_slow_account_answers_late(standin):
    engine = standin("--kind", "llama.cpp", "--slow", "0.3")
    started = time.monotonic()
    assert len(get_json(engine.url + "/slots")) == 1
    assert time.monotonic() - started >= 0.3
    assert engine.stats()["account_gets"] == 1


# -- /stats: the generations, and the reset -------------------------------------------------------
def test_stats_generations_have_their_start_and_end(standin):
    engine = standin()
    before = time.time()
    assert post(engine.url + "/v1/chat/completions", {"messages": []})[0] == 200
    response = engine.stream()
    stats = engine.stats()
    done, running = stats["generations"]
    assert (done["path"], running["path"]) == ("/v1/chat/completions",) * 2
    assert running["id"] > done["id"]
    assert before <= done["started"] <= done["ended"] <= running["started"]
    assert running["ended"] is None
    get(engine.url + "/slots")
    reset = json.loads(post(engine.url + "/stats/reset", {})[1])
    # What is in flight stays; its count of tokens decoded goes on meanwhile.
    [kept] = reset["generations"]
    assert {**kept, "decoded": None} == {**running, "decoded": None}
    assert kept["decoded"] >= running["decoded"]
    assert (reset["account_gets"], reset["loads"], reset["total"]) == (0, [], 0)
    engine.hang_up(response)
    [ended] = engine.stats()["generations"]
    assert ended["id"] == running["id"] and ended["ended"] >= ended["started"]


# -- the witness's reader (lanelock/engine.py) against every kind ---------------------------------
# (serve arguments, what a look says idle, and with one generation in flight)
LOOKS = [
    (("--kind", "llama.cpp"), ("llama.cpp", 0), ("llama.cpp", 1)),
    (("--kind", "llama.cpp", "--no-slots", "--metrics"), ("llama.cpp", 0), ("llama.cpp", 1)),
    (("--kind", "llama.cpp-legacy"), ("llama.cpp", 0), ("llama.cpp", 1)),
    (("--kind", "llama-swap"), ("llama-swap", 0), ("llama-swap", 1)),
    (("--kind", "vllm", "--parallel", "4"), ("vLLM", 0), ("vLLM", 1)),
    (("--kind", "sglang"), ("SGLang", 0), ("SGLang", 1)),
    (("--kind", "llama.cpp", "--no-slots"), "cannot witness", "cannot witness"),
    (("--kind", "ollama"), "cannot witness", "cannot witness"),
    (("--kind", "plain"), "cannot witness", "cannot witness"),
    (("--kind", "garbage"), "not answering", "not answering"),
    (("--kind", "redirect"), "not answering", "not answering"),
]


@pytest.mark.parametrize("args, idle, busy", LOOKS,
                         ids=[" ".join(args[1:]) for args, _, _ in LOOKS])
def test_the_witness_reads_each_kind(standin, args, idle, busy):
    from lanelock import engine as witness_engine

    engine = standin(*args)

    def look():
        found = witness_engine.look(engine.url)
        if found["problem"] is not None:
            return found["problem"].split(":")[0]
        return found["kind"], found["generating"]

    assert look() == idle
    response = engine.stream()
    assert look() == busy
    engine.hang_up(response)
    assert look() == idle
    assert engine.stats()["loads"] == []       # never a model loaded by a look
