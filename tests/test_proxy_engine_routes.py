"""The proxy routes as the engine routes: with lanes keyed by model, a request holds the lane of
the model the engine will run -- read as llama-swap's and Ollama's sources read it (the routing
stand-in, lanelock.testing.routed, runs each request on that model and records it) -- so the
engine never runs a model beside a holder of that model's lane, and every request that can load
a model is gated. Real processes: `lanelock proxy`, `lanelock run` holders, the stand-in."""

from __future__ import annotations

import http.client
import json
import socket
import time

import pytest

from support.routed import RoutedEngine

KEYED = ("--key-by", "model", "--no-witness")
CHAT = "/v1/chat/completions"


def ask(port: int, method: str, target: str, body: bytes = b"", headers=None):
    """(status, headers with lower-case names, body) of one request, its target as written."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.putrequest(method, target, skip_accept_encoding=True)
        sent = {"Content-Type": "application/json", **(headers or {})}
        if body or method in ("POST", "PUT"):
            sent["Content-Length"] = str(len(body))
        for name, value in sent.items():
            connection.putheader(name, value)
        connection.endheaders(body or None)
        answer = connection.getresponse()
        data = answer.read()
        return answer.status, {k.lower(): v for k, v in answer.getheaders()}, data
    finally:
        connection.close()


def form(model: str) -> tuple[bytes, dict]:
    """A multipart form as the OpenAI SDK sends a transcription: a file, then its model."""
    boundary = "lanelock-form-boundary"
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; "
            f"filename=\"a.wav\"\r\nContent-Type: audio/wav\r\n\r\nRIFF{{\"model\":\"B\"}}\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\n{model}\r\n"
            f"--{boundary}--\r\n").encode()
    return body, {"Content-Type": f"multipart/form-data; boundary={boundary}"}


def chat(model_json: str) -> bytes:
    return ('{"model":%s,"messages":[{"role":"user","content":"hi"}]}' % model_json).encode()


# Each row: (the lane held, the model the engine runs for the request, method, target, body,
# headers, the answer while the lane is held). The rows of what used to run beside a holder.
SWAP_ROWS = {
    "repeated-key": ("A", "A", "POST", CHAT,
                     b'{"model":"A","messages":[],"model":"B"}', {}, 400),
    "upstream-slashed-model": ("author/model", "author/model", "POST",
                               "/upstream/author/model/v1/chat/completions", b"{}", {}, 503),
    "upstream-empty-segment": ("author/model", "author/model", "POST",
                               "/upstream//author/model/v1/chat/completions", b"{}", {}, 503),
    "multipart-form": ("author/model", "author/model", "POST", "/v1/audio/transcriptions",
                       *form("author/model"), 503),
    "voices-get": ("A", "A", "GET", "/v1/audio/voices?model=A", b"", {}, 503),
    "loras-get": ("A", "A", "GET", "/sdapi/v1/loras?model=A", b"", {}, 503),
    "map-alias": ("A", "A", "POST", CHAT, chat('"mapped"'), {}, 503),
}


@pytest.fixture
def swap(procs, tmp_path, lanelock):
    """A llama-swap stand-in of models A, B and author/model (`mapped`, an alias of A in its
    config and in lanelock's map: llama-swap's /v1/models does not say whose alias a name is),
    and a proxy keyed by model in front of it."""
    from support.proxy import Proxy

    engine = RoutedEngine(procs, tmp_path, "llama-swap", "A,B,author/model",
                          "--alias", "mapped=A", delay=0.05)
    aliased = lanelock("models", "-b", engine.backend, "alias", "mapped", "A")
    assert aliased.returncode == 0, aliased.stderr
    return engine, Proxy(procs, engine.backend, *KEYED)


@pytest.mark.parametrize("row", sorted(SWAP_ROWS))
def test_llama_swap_never_runs_a_model_beside_its_lane_holder(row, swap, holder):
    engine, proxy = swap
    lane, runs, method, target, body, headers, while_held = SWAP_ROWS[row]
    held = holder("-b", engine.backend, "--key-by", "model", "-m", lane)
    status, answer, data = ask(proxy.port, method, target, body, headers)
    assert status == while_held, (status, answer, data)
    assert engine.ran(runs) == 0, engine.stats()   # nothing ran beside the holder
    if status == 503:
        assert answer["x-lanelock-state"] == "busy", answer
    assert held.release() == 0
    # The lane free, the same request runs the very model whose lane it waited for (a refused
    # one is refused still: which model it names cannot be told).
    status, answer, data = ask(proxy.port, method, target, body, headers)
    if while_held == 400:
        assert status == 400 and engine.ran(runs) == 0, (status, data)
        error = json.loads(data)["error"]
        assert (error["type"], error["code"], error["param"]) == \
            ("invalid_request_error", "ambiguous_request_body", "model"), error
        return
    assert (status, answer["x-lanelock-state"]) == (200, "held"), (status, answer, data)
    assert engine.ran(runs) == 1, engine.stats()
    assert max(engine.stats()["max_in_flight"].values()) == 1


def test_the_first_model_a_path_names_is_the_one_llama_swap_runs(procs, tmp_path, holder):
    """Models 'author' and 'author/model' both known: /upstream/author/model/... runs 'author'
    (findModelInPath stops at the first name it knows), so it waits for author's lane."""
    from support.proxy import Proxy

    engine = RoutedEngine(procs, tmp_path, "llama-swap", "author,author/model", delay=0.05)
    proxy = Proxy(procs, engine.backend, *KEYED)
    held = holder("-b", engine.backend, "--key-by", "model", "-m", "author")
    status, answer, _ = ask(proxy.port, "POST", "/upstream/author/model/v1/chat/completions",
                            b"{}")
    assert (status, answer["x-lanelock-state"]) == (503, "busy")
    assert engine.ran("author") == 0
    assert held.release() == 0


def test_a_model_added_to_llama_swap_later_is_read_again_on_a_miss(procs, tmp_path, holder,
                                                                   lanelock):
    """The proxy's list of llama-swap's models is read again when a path names none it knows:
    a map alias learnt after the first read counts at once (the map is read again too)."""
    from support.proxy import Proxy

    engine = RoutedEngine(procs, tmp_path, "llama-swap", "A,org/x", delay=0.05)
    proxy = Proxy(procs, engine.backend, *KEYED)
    assert ask(proxy.port, "POST", "/upstream/A/v1/chat/completions", b"{}")[0] == 200
    held = holder("-b", engine.backend, "--key-by", "model", "-m", "org/x")
    status, answer, _ = ask(proxy.port, "POST", "/upstream/org/x/v1/chat/completions", b"{}")
    assert (status, answer["x-lanelock-state"]) == (503, "busy")
    assert held.release() == 0


def test_requests_that_come_while_llama_swap_is_first_asked_wait_for_its_answer(procs, tmp_path,
                                                                             holder):
    """The proxy's first requests all come before it knows llama-swap's models: each waits for
    the one look at its list, so none takes the lane of 'author' beside author/model's holder."""
    from concurrent.futures import ThreadPoolExecutor

    from support.proxy import Proxy

    engine = RoutedEngine(procs, tmp_path, "llama-swap", "A,author/model", delay=0.05)
    proxy = Proxy(procs, engine.backend, *KEYED)
    held = holder("-b", engine.backend, "--key-by", "model", "-m", "author/model")
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: ask(proxy.port, "POST",
                                              "/upstream/author/model/v1/chat/completions",
                                              b"{}")[0], range(8)))
    assert answers == [503] * 8, answers
    assert engine.ran("author/model") == 0
    assert held.release() == 0


def test_models_alias_puts_a_name_on_its_models_lane(lanelock):
    assert lanelock("models", "share", "gpu0", "qwen").returncode == 0
    assert lanelock("models", "alias", "q", "qwen").stdout == "localhost:8080#gpu0: q, qwen\n"
    shown = lanelock("models", "alias", "l", "llama")   # a model of a lane of its own
    assert shown.stdout == "localhost:8080#gpu0: q, qwen\nlocalhost:8080#llama: l, llama\n"
    for words in (["alias", "x"], ["alias", "x", "y", "z"], ["alias", "", "y"]):
        result = lanelock("models", *words)
        assert result.returncode == 2 and result.stderr.startswith("lanelock: "), result


OLLAMA_SPELLINGS = ['"llama3"', '"llama3:latest"', '"Llama3"', '"library/llama3:latest"',
                    '"registry.ollama.ai/library/llama3"']


@pytest.mark.parametrize("path", ["/api/chat", "/v1/chat/completions"])
def test_every_spelling_ollama_runs_as_one_model_is_one_lane(procs, tmp_path, holder, path):
    from support.proxy import Proxy

    engine = RoutedEngine(procs, tmp_path, "ollama", "llama3:latest,qwen:7b", delay=0.05)
    proxy = Proxy(procs, engine.backend, *KEYED)
    held = holder("-b", engine.backend, "--key-by", "model", "-m", "llama3")
    for spelling in OLLAMA_SPELLINGS:
        status, answer, data = ask(proxy.port, "POST", path, chat(spelling))
        assert (status, answer.get("x-lanelock-state")) == (503, "busy"), (spelling, data)
    # Go's JSON reads "Model" as "model": the lane is llama3's too.
    status, answer, _ = ask(proxy.port, "POST", path,
                            b'{"Model":"llama3","messages":[]}')
    assert (status, answer.get("x-lanelock-state")) == (503, "busy")
    # Two spellings in one body: Go reads the last, Python the exact one -- refused.
    status, _, data = ask(proxy.port, "POST", path, b'{"model":"qwen:7b","MODEL":"llama3"}')
    assert status == 400, data
    assert engine.ran("llama3:latest") == 0, engine.stats()
    # another model is served beside it
    assert ask(proxy.port, "POST", path, chat('"qwen:7b"'))[0] == 200
    assert held.release() == 0
    for spelling in OLLAMA_SPELLINGS:
        status, answer, _ = ask(proxy.port, "POST", path, chat(spelling))
        assert (status, answer["x-lanelock-state"]) == (200, "held"), spelling
    assert engine.ran("llama3:latest") == len(OLLAMA_SPELLINGS)


def test_an_ollama_model_the_map_spells_otherwise_is_on_its_shared_lane(procs, tmp_path, holder,
                                                                        lanelock):
    from support.proxy import Proxy

    engine = RoutedEngine(procs, tmp_path, "ollama", "llama3:latest,qwen:7b", delay=0.05)
    shared = lanelock("models", "-b", engine.backend, "share", "gpu0", "library/llama3:latest",
                      "qwen:7b")
    assert shared.returncode == 0, shared.stderr
    proxy = Proxy(procs, engine.backend, *KEYED)
    held = holder("-b", engine.backend, "--key-by", "model", "-m", "qwen:7b")
    status, answer, _ = ask(proxy.port, "POST", "/api/chat", chat('"Llama3"'))
    assert (status, answer.get("x-lanelock-state")) == (503, "busy")
    assert engine.ran("llama3:latest") == 0
    assert held.release() == 0


def test_head_is_answered_as_its_get_while_the_lane_is_held(swap, holder):
    engine, proxy = swap
    held = holder("-b", engine.backend, "--key-by", "model", "-m", "A")
    for target in ("/v1/completions", "/v1/models", "/health"):
        get = ask(proxy.port, "GET", target)
        head = ask(proxy.port, "HEAD", target)
        assert head[0] == get[0] != 502, (target, get, head)
        assert head[1].get("x-lanelock-state") == get[1].get("x-lanelock-state")
    assert held.release() == 0


def test_an_engine_refusing_the_connection_is_down_whatever_the_lane(procs):
    from support.ports import free_port
    from support.proxy import Proxy

    proxy = Proxy(procs, f"127.0.0.1:{free_port()}", *KEYED)
    for method, target, body in (("POST", CHAT, chat('"A"')), ("GET", "/v1/models", b""),
                                 ("POST", "/upstream/A/v1/chat/completions", b"{}")):
        status, answer, _ = ask(proxy.port, method, target, body)
        assert (status, answer.get("x-lanelock-state"), answer.get("x-lanelock-reason")) == \
            (502, "down", "local_backend_down"), (method, target, answer)


# -- bodies held back ------------------------------------------------------------------------------
def slow_body(port: int, target: str = CHAT) -> socket.socket:
    """A connection that sent a whole header and a Content-Length, and holds its body back."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(f"POST {target} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: 100\r\n\r\n{{\"mo".encode())
    return sock


def test_a_body_held_back_is_answered_408_and_closed(procs):
    from support.engine import Engine
    from support.proxy import Proxy

    engine = Engine(procs, delay=0.01)
    proxy = Proxy(procs, engine.backend, "--header-timeout", "1", "--no-witness")
    with slow_body(proxy.port) as sock:
        started = time.monotonic()
        answer = sock.recv(65536)
        assert answer.startswith(b"HTTP/1.1 408 "), answer
        assert b'"request_timeout"' in answer
        assert 0.5 < time.monotonic() - started < 10
        while sock.recv(65536):
            pass   # then closed: at once, not after aiohttp's 10 s of reading a body not coming
        assert time.monotonic() - started < 5
    assert engine.stats()["total"] == 0


def test_bodies_held_back_count_toward_the_cap_and_make_room_for_the_proxys_own(procs):
    from support.engine import Engine
    from support.proxy import Proxy, request

    engine = Engine(procs, delay=0.01)
    proxy = Proxy(procs, engine.backend, "--max-connections", "4", "--header-timeout", "30",
                  "--no-witness")
    held = [slow_body(proxy.port) for _ in range(6)]
    try:
        for _ in range(3):
            started = time.monotonic()
            status, _, body = request(proxy.port, "GET", "/lanelock/status")
            assert status == 200, body
            assert time.monotonic() - started < 5
    finally:
        for sock in held:
            sock.close()


@pytest.mark.slow   # a stress: 1,100 connections holding their bodies back
def test_a_proxy_without_a_token_answers_its_status_through_1100_held_back_bodies(procs):
    from support.engine import Engine
    from support.proxy import Proxy, request

    engine = Engine(procs, delay=0.01)
    proxy = Proxy(procs, engine.backend, "--header-timeout", "30", "--no-witness")
    held, slowest = [], 0.0
    try:
        for index in range(1100):
            held.append(slow_body(proxy.port))
            if index % 100 == 99:
                started = time.monotonic()
                status, _, body = request(proxy.port, "GET", "/lanelock/status")
                slowest = max(slowest, time.monotonic() - started)
                assert status == 200, body
        for _ in range(5):
            started = time.monotonic()
            assert request(proxy.port, "GET", "/lanelock/status")[0] == 200
            slowest = max(slowest, time.monotonic() - started)
    finally:
        for sock in held:
            sock.close()
    assert slowest < 1.0, slowest
    assert "Traceback" not in proxy.log(), proxy.log()
