"""`lanelock proxy` end to end, what it gates and how: ungated paths pass through, a request from
inside a turn is part of it, every spelling and dialect is gated by default, fallbacks in order,
and requests queue by class. Real processes and clients as in test_proxy.py (support/proxy.py,
support/engine.py); lane state is asked of lanelock, never guessed from time.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import subprocess

import pytest

from support.cli import TIMEOUT
from support.http import read_all
from support.processes import wait_for
from lanelock import Gate
from support.engine import Engine
from support.ports import free_port
from support.proxy import (CHAT, Proxy, Recorder, chat_body, history, lane_status, open_stream,
                           raw_request, read_until, request)

pytest.importorskip("aiohttp")

needs_curl = pytest.mark.skipif(shutil.which("curl") is None, reason="curl not found")


# -- 9. ungated passthrough ------------------------------------------------------------------------
def test_ungated_paths_pass_through_without_touching_the_lane(procs, lanelock, holder):
    engine = Engine(procs, delay=0.01)
    proxy = Proxy(procs, engine.backend)
    busy = holder("-b", engine.backend, "-s", "holder")    # the lane is taken all along
    models = request(proxy.port, "GET", "/v1/models")
    stats = request(proxy.port, "GET", "/stats")
    missing = request(proxy.port, "POST", "/tokenize", b"{}")      # a cheap endpoint
    assert models[0] == 200 and json.loads(models[2])["data"][0]["id"] == "stand-in"
    assert stats[0] == 200 and json.loads(stats[2])["total"] == 0
    assert missing[0] == 404           # the engine's own answer, passed back
    for answer in (models, stats, missing):
        assert "X-Lanelock-State" not in answer[1]
    # A POST the proxy does not know is gated (an endpoint an engine adds next year)
    unknown = request(proxy.port, "POST", "/stats/reset", b"{}")
    assert (unknown[0], unknown[1]["X-Lanelock-State"]) == (503, "busy")
    by_proxy = json.loads(request(proxy.port, "GET", "/lanelock/status")[2])["lanes"]
    by_cli = lane_status(lanelock, engine.backend)
    # the same JSON, one lane, and the last hour of its journal (state.py)
    assert [set(by_cli) | {"last_hour"}] == [set(lane) for lane in by_proxy]
    for field in ("lane", "state", "lock_path", "verdict"):
        assert by_proxy[0][field] == by_cli[field]
    assert by_cli["holder"]["session"] == by_proxy[0]["holder"]["session"] == "holder"
    assert by_cli["holder"]["pid"] == busy.pid
    assert busy.release() == 0
    assert [event["path"] for event in history(lanelock, engine.backend)
            if event.get("via") == "proxy"] == ["/stats/reset"]    # the gated one alone
    assert proxy.stop() == 0


# -- a request from inside a turn ----------------------------------------------
def curl_chat(proxy) -> list[str]:
    """curl posting one chat request to the proxy, printing the status and X-Lanelock-State."""
    return ["curl", "-s", "-o", "/dev/null", "-D", "-", "-H", "Content-Type: application/json",
            "--data-binary", chat_body().decode(), proxy.url + CHAT]


def answer_of(done) -> tuple[int, str]:
    assert done.returncode == 0, done.stderr
    status = int(re.search(r"^HTTP/\S+ (\d+)", done.stdout, re.M).group(1))
    state = re.search(r"^X-Lanelock-State: (\S+)", done.stdout, re.M | re.I)
    return status, state.group(1) if state else ""


def test_a_request_from_inside_a_turn_passes_the_proxy_as_part_of_it(procs, lanelock, run_cmd):
    """The cron recipe beside the proxy recipe: a wrapped job whose client points at the proxy
    is part of its own turn (it was refused by its own lane); the engine never sees two."""
    engine = Engine(procs, delay=0.01)
    proxy = Proxy(procs, engine.backend)
    done = lanelock("run", "-b", engine.backend, "--", *curl_chat(proxy))
    assert answer_of(done) == (200, "held")
    # through a shell, and with another spelling of the backend
    done = lanelock("run", "-b", f"localhost:{engine.port}", "--", "sh", "-c",
                    " ".join(shlex.quote(word) for word in curl_chat(proxy)))
    assert answer_of(done) == (200, "held")
    assert engine.stats()["max_in_flight"] == 1 and engine.stats()["total"] == 2
    turns = [event for event in history(lanelock, engine.backend) if event["event"] == "acquired"]
    assert [event.get("via") for event in turns] == [None, None], "one turn each: the wrapper's"


def test_a_request_outside_the_holding_turn_is_busy_whatever_it_carries(procs, lanelock, holder,
                                                                          run_cmd):
    engine = Engine(procs, delay=0.01)
    proxy = Proxy(procs, engine.backend)
    held = holder("-b", engine.backend, command=[
        "sh", "-c", 'echo "ready $$"; echo "$LANELOCK_TURNS"; read code; exit "${code:-0}"'])
    token = held.read_line().strip()
    assert answer_of(run_cmd(curl_chat(proxy))) == (503, "busy")
    copied = run_cmd(curl_chat(proxy), env={"LANELOCK_TURNS": token})   # not the holder's child
    assert answer_of(copied) == (503, "busy")
    assert held.release() == 0
    assert engine.stats()["total"] == 0


def test_a_client_handed_an_api_turn_passes_the_proxy_as_part_of_it(procs, lanelock):
    engine = Engine(procs, delay=0.01)
    proxy = Proxy(procs, engine.backend)
    with Gate(engine.backend).turn() as turn:
        assert turn.held
        handed = subprocess.run(curl_chat(proxy), env={**os.environ, **turn.env},
                                capture_output=True, text=True, timeout=TIMEOUT)
        alone = subprocess.run(curl_chat(proxy), capture_output=True, text=True, timeout=TIMEOUT)
    assert answer_of(handed) == (200, "held")
    assert answer_of(alone) == (503, "busy")
    assert engine.stats()["total"] == 1


# -- gate by default, every spelling, every dialect ------------------------------------
SPELLINGS = ["/./v1/chat/completions", "/v1/../v1/chat/completions", "//v1/chat/completions",
             "/v1/chat/completions/", "/v1/chat%2Fcompletions", "/V1/chat/completions",
             "/v1/chat/completions?stream=false", "/v1/messages", "/messages", "/responses",
             "/v1/responses", "/v1/audio/transcriptions", "/v1/reranking", "/reranking",
             "/upstream/qwen/v1/chat/completions", "/api/chat", "/api/generate",
             "/tokenize/", "/tok%65nize", "/v1/some-endpoint-of-next-year"]


def test_the_strictest_engine_never_sees_two_generations_through_the_proxy(procs, lanelock):
    """A stand-in that generates on every request but GETs and the cheap endpoints. While one
    streamed generation holds the lane through the proxy, no spelling, dialect or method gets a
    second one in; cheap endpoints and GETs keep answering."""
    engine = Engine(procs, delay=0.05, tokens=400, interval=0.05, strict=True)
    proxy = Proxy(procs, engine.backend)
    stream = open_stream(proxy.port, chat_body(stream=True))
    try:
        read_until(stream, b"data: ")          # the engine is generating for the holder
        for target in SPELLINGS:
            status, headers, _ = raw_request(proxy.port, "POST", target)
            assert (headers.get("x-lanelock-state"), headers.get("x-lanelock-reason")) == \
                ("busy", "local_backend_busy"), (target, status, headers)
            assert int(headers["retry-after"]) >= 1
        for method in ("PUT", "PATCH", "DELETE"):
            status, headers, _ = raw_request(proxy.port, method, "/v1/chat/completions")
            assert headers.get("x-lanelock-state") == "busy", (method, status)
        for target in ("/tokenize", "/detokenize", "/v1/messages/count_tokens", "/api/show"):
            status, headers, _ = raw_request(proxy.port, "POST", target)
            assert status == 200 and "x-lanelock-state" not in headers, target
        assert raw_request(proxy.port, "GET", "/v1/models")[0] == 200
        assert engine.stats()["max_in_flight"] == 1
    finally:
        stream.close()


def test_busy_answers_speak_the_clients_dialect(procs, holder):
    engine = Engine(procs, delay=0.01)
    proxy = Proxy(procs, engine.backend)
    busy = holder("-b", engine.backend, "-s", "holder")
    status, headers, body = raw_request(proxy.port, "POST", "/v1/messages")
    answer = json.loads(body)
    assert status == 529 and answer["type"] == "error"
    assert answer["error"]["type"] == "overloaded_error"
    assert answer["error"]["message"].startswith("local model in use by another session (")
    status, headers, body = raw_request(proxy.port, "POST", "/api/chat")
    assert status == 503 and list(json.loads(body)) == ["error"]
    assert json.loads(body)["error"].startswith("local model in use by another session (")
    for target in ("/v1/chat/completions", "/v1/responses", "/whatever"):
        status, headers, body = raw_request(proxy.port, "POST", target)
        assert status == 503 and json.loads(body)["error"]["type"] == "local_backend_busy"
    assert busy.release() == 0 and engine.stats()["total"] == 0


def test_the_engine_is_asked_exactly_the_target_the_gate_judged(procs, holder):
    """Forwarded byte for byte: the engine sees /./v1/chat/completions, not a normalised path
    (the stand-in answers 404 for what is not its own path, as llama-server would)."""
    engine = Engine(procs, delay=0.01)
    proxy = Proxy(procs, engine.backend)
    # (not //v1/...: Python's http.server, the stand-in's, collapses leading slashes itself)
    for target in ("/./v1/chat/completions", "/v1/../v1/chat/completions"):
        status, headers, _ = raw_request(proxy.port, "POST", target, chat_body())
        assert (status, headers.get("x-lanelock-state")) == (404, "held"), target
    assert engine.stats()["total"] == 0
    status, headers, _ = raw_request(proxy.port, "POST", "/v1/chat/completions", chat_body())
    assert (status, headers.get("x-lanelock-state")) == (200, "held")


@pytest.mark.parametrize("spelling", ["127.1:{port}", "0177.0.0.1:{port}", "2130706433:{port}",
                                      "http://127.1:{port}/v1", "localhost:{port}",
                                      "[::ffff:127.0.0.1]:{port}"])
def test_every_documented_backend_spelling_reaches_the_engine(spelling, procs):
    engine = Engine(procs, delay=0.01)
    proxy = Proxy(procs, spelling.format(port=engine.port))
    assert proxy.lane == f"localhost:{engine.port}"
    status, headers, body = request(proxy.port, "POST", CHAT, chat_body())
    assert (status, headers["X-Lanelock-State"]) == (200, "held"), body
    assert engine.stats()["total"] == 1


def test_an_unreachable_fallback_is_skipped_and_the_next_one_answers(procs, holder):
    engine = Engine(procs, delay=0.01)
    cloud = Engine(procs, delay=0.01, name="cloud")
    dead = free_port()
    # a listener that never answers: accepted by the kernel's backlog, never read
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        proxy = Proxy(procs, engine.backend, "--fallback", f"http://127.0.0.1:{dead}/v1",
                      "--fallback", f"http://127.0.0.1:{silent.getsockname()[1]}/v1",
                      "--fallback-timeout", "0.5", "--fallback", f"{cloud.url}/v1")
        busy = holder("-b", engine.backend)
        status, headers, body = request(proxy.port, "POST", CHAT, chat_body())
        assert (status, headers["X-Lanelock-State"]) == (200, "deflected")
        assert json.loads(body)["model"] == "cloud"
        log = proxy.said("no answer within 0.5s")
        assert f"fallback 1 http://127.0.0.1:{dead}/v1 unreachable: cannot connect to " in log
        assert "fallback 2" in log and "no answer within 0.5s" in log
        assert busy.release() == 0
    finally:
        silent.close()


def test_when_every_fallback_fails_the_answer_names_them_and_says_the_lane_was_busy(procs,
                                                                                       holder):
    engine = Engine(procs, delay=0.01)
    dead = free_port()
    proxy = Proxy(procs, engine.backend, "--fallback", f"http://127.0.0.1:{dead}/v1")
    busy = holder("-b", engine.backend)
    status, headers, body = request(proxy.port, "POST", CHAT, chat_body())
    message = json.loads(body)["error"]["message"]
    assert (status, headers["X-Lanelock-State"]) == (503, "busy")
    assert message.startswith("local model in use by another session (")
    assert f"fallback 1 http://127.0.0.1:{dead}/v1 failed" in message
    assert "local engine" not in message
    assert busy.release() == 0


def test_an_anthropic_fallback_gets_its_key_as_x_api_key_and_only_messages(procs, holder):
    engine = Engine(procs, delay=0.01)
    recorder = Recorder(procs)
    proxy = Proxy(procs, engine.backend, "--fallback", f"anthropic={recorder.url}",
                  "--fallback-key-env", "anthropic=ANTHROPIC_KEY", "--fallback-model",
                  "anthropic=claude-small", env={"ANTHROPIC_KEY": "sk-ant-secret"})
    busy = holder("-b", engine.backend)
    body = json.dumps({"model": "local", "max_tokens": 8, "messages": [
        {"role": "user", "content": "hi"}], "metadata": {"user_id": "agent-7"}}).encode()
    status, headers, _ = raw_request(proxy.port, "POST", "/v1/messages", body,
                                     {"anthropic-version": "2023-06-01"})
    assert (status, headers["x-lanelock-state"]) == (200, "deflected")
    seen = recorder.next_request()
    assert seen["path"] == "/v1/messages" and seen["headers"]["x-api-key"] == "sk-ant-secret"
    assert "authorization" not in seen["headers"]
    assert json.loads(seen["body"])["model"] == "claude-small"
    # an OpenAI request has no fallback here: busy, in its own dialect
    status, headers, _ = raw_request(proxy.port, "POST", CHAT, chat_body())
    assert (status, headers["x-lanelock-state"]) == (503, "busy")
    assert busy.release() == 0


@needs_curl
def test_verbose_says_200_for_a_stream_read_to_its_end(procs):
    """-v logged "client gone" for streams curl read to [DONE] (curl hangs up right after)."""
    engine = Engine(procs, tokens=5, interval=0.01)
    proxy = Proxy(procs, engine.backend, "-v")
    for _ in range(5):
        done = subprocess.run(["curl", "-sN", "-H", "Content-Type: application/json",
                               "--data-binary", chat_body(stream=True).decode(), proxy.url + CHAT],
                              capture_output=True, timeout=TIMEOUT)
        assert done.returncode == 0 and b"data: [DONE]" in done.stdout
    proxy.until(lambda log: log.count("] POST ") == 5, "five request lines")
    lines = [line for line in proxy.stderr().splitlines() if "] POST " in line]   # [session]
    assert all(" 200 held " in line for line in lines), lines


@pytest.mark.slow   # a stress: 200 waiting requests
def test_two_hundred_waiting_requests_cost_a_bounded_number_of_threads(procs, holder):
    """Every waiting request cost a thread (202 threads for 200). Now the wait costs
    none: the proxy stays at <= 24 threads however many wait, and all are served one at a time
    once the lane frees."""
    engine = Engine(procs, delay=0.001)
    proxy = Proxy(procs, engine.backend, "--wait", "120")
    busy = holder("-b", engine.backend)
    socks = [open_stream(proxy.port, chat_body()) for _ in range(200)]

    def threads() -> int:
        return len(os.listdir(f"/proc/{proxy.proc.pid}/task"))

    def taking() -> int:
        return json.loads(request(proxy.port, "GET", "/lanelock/status")[2])["proxy"][
            "taking_the_lane"]

    # The proxy reports how many requests are taking the lane; the wait itself reports nothing.
    wait_for(lambda: taking() == 200, what="the 200 requests to wait for the lane")
    # ... and every one of them waits in the lane's queue (not on its way there)
    from lanelock import Gate

    gate = Gate(engine.backend)
    wait_for(lambda: len(gate.store.survey(gate.lane)[0].queue) == 200,
             what="the 200 requests to queue", timeout=TIMEOUT * 2)   # 200 joins on a loaded box
    most = max(threads() for _ in range(20))
    assert most <= 24, f"{most} threads for 200 waiting requests"
    assert busy.release() == 0
    answers = [read_all(sock) for sock in socks]
    for sock in socks:
        sock.close()
    assert all(answer.startswith(b"HTTP/1.1 200") and b"X-Lanelock-State: held" in answer
               for answer in answers)
    assert engine.stats()["max_in_flight"] == 1 and engine.stats()["total"] == 200
    assert threads() <= 24


def test_the_anthropic_and_openai_sdks_understand_the_busy_answers(procs, holder):
    """The official SDKs, unmodified: Anthropic's reads 529 overloaded_error as its OverloadedError,
    OpenAI's Responses API reads the 503 local_backend_busy error; no retries asked of either."""
    anthropic = pytest.importorskip("anthropic")
    openai = pytest.importorskip("openai")
    engine = Engine(procs, delay=0.01, strict=True)
    proxy = Proxy(procs, engine.backend)
    busy = holder("-b", engine.backend, "-s", "holder")
    claude = anthropic.Anthropic(base_url=proxy.url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.OverloadedError) as overloaded:
        claude.messages.create(model="local", max_tokens=8,
                               messages=[{"role": "user", "content": "hi"}])
    assert overloaded.value.body["error"]["type"] == "overloaded_error"
    assert "local model in use by another session" in overloaded.value.message
    assert int(overloaded.value.response.headers["retry-after"]) >= 1
    gpt = openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.InternalServerError) as unavailable:
        gpt.responses.create(model="local", input="hi")
    assert unavailable.value.status_code == 503
    assert unavailable.value.body["code"] == "local_backend_busy"
    assert busy.release() == 0 and engine.stats()["total"] == 0


# -- the proxy's requests queue by class ---------------------------------------------------
def test_requests_queue_by_their_class_capped_by_max_priority(procs, lanelock, holder):
    """X-Lanelock-Priority sets a waiting request's class, capped by --max-priority (and the
    answer says so); the lane goes to the higher class first; a busy answer's Retry-After counts
    the waiters before it. A class that is none is refused, never queued."""
    import threading

    from lanelock import Gate

    engine = Engine(procs, delay=0.01)
    proxy = Proxy(procs, engine.backend, "--wait", "60", "--max-priority", "normal",
                  env={"LANELOCK_PRIORITY_AGING": "3600"})
    first = holder("-b", engine.backend, "-s", "first")
    gate = Gate(engine.backend)
    answers = {}

    def ask(session, klass):
        answers[session] = request(proxy.port, "POST", CHAT, chat_body(), headers={
            "X-Lanelock-Session": session, "X-Lanelock-Priority": klass})

    threads = []
    status, headers, _ = request(proxy.port, "POST", CHAT, chat_body(), headers={
        "X-Lanelock-Session": "bogus", "X-Lanelock-Priority": "urgent"})
    assert status == 400 and headers["X-Lanelock-Max-Priority"] == "normal"
    for session, klass in (("cron", "batch"), ("greedy", "interactive")):
        before = len(gate.store.survey(gate.lane)[0].queue)
        threads.append(threading.Thread(target=ask, args=(session, klass)))
        threads[-1].start()
        wait_for(lambda: len(gate.store.survey(gate.lane)[0].queue) > before,
                 f"{session} to queue")
    queued = [(entry["session"], entry["class"]) for entry in gate.store.survey(gate.lane)[0].queue]
    # interactive capped to normal
    assert queued == [("greedy", "normal"), ("cron", "batch")], queued
    status, headers, _ = request(proxy.port, "POST", CHAT, chat_body(),
                                 headers={"X-Lanelock-Wait": "0", "X-Lanelock-Priority": "batch"})
    assert status == 503 and int(headers["Retry-After"]) >= 1
    assert first.release() == 0
    for thread in threads:
        thread.join(TIMEOUT)
    assert all(answer[0] == 200 for answer in answers.values()), answers
    assert answers["greedy"][1]["X-Lanelock-Priority"] == "normal"
    served = [event["session"] for event in history(lanelock, engine.backend)
              if event["event"] == "acquired" and event["session"] in (*answers, "bogus")]
    assert served == ["greedy", "cron"]
