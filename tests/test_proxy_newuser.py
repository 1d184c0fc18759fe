"""What a new user met at the proxy: its wait is a default, not a cap (--wait for requests that do
not ask, --max-wait for those that do), a capped header is said in the answer's body, and the
proxy reads its own settings (proxy_wait, proxy_max_wait, proxy_priority), never `run`'s; a
request that names no session is named after its client process, so two agents are two
sessions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

from support.cli import TIMEOUT
from support.kernel_locks import is_waiting
from support.processes import wait_for
from support.engine import Engine
from support.proxy import CHAT, Proxy, chat_body, history, lock_path, request

pytest.importorskip("aiohttp")


def told(headers) -> tuple:
    return tuple(headers.get(name) for name in ("X-Lanelock-State", "X-Lanelock-Priority",
                                                "X-Lanelock-Wait", "X-Lanelock-Max-Wait"))


def test_a_client_may_ask_to_wait_under_the_default_max_wait(procs, holder, lock_dir):
    """A proxy started with no --wait: a request that asks nothing is answered busy at once (wait
    0), and a cron client's X-Lanelock-Wait: 30 waits -- the default --max-wait (60) allows it --
    and is answered by the engine once the holder lets go."""
    engine = Engine(procs, delay=0.01)
    proxy = Proxy(procs, engine.backend, "--no-witness")
    busy = holder("-b", engine.backend, "-s", "chat")
    status, headers, _ = request(proxy.port, "POST", CHAT, chat_body())
    assert (status, *told(headers)) == (503, "busy", "normal", "0", "60")
    answers = []
    cron = threading.Thread(target=lambda: answers.append(
        request(proxy.port, "POST", CHAT, chat_body(), {"X-Lanelock-Wait": "30"})))
    cron.start()
    try:
        lock = lock_path(lock_dir, engine)
        wait_for(lambda: is_waiting(lock, proxy.proc.pid), "the cron request waiting for the lane")
    finally:
        assert busy.release() == 0
        cron.join(60)
    ((status, headers, _),) = answers
    assert (status, *told(headers)) == (200, "held", "normal", "30", "60")


def test_a_capped_wait_is_said_in_the_busy_answers_body(procs, holder):
    """--max-wait 0.2: a request asking 30 s waits 0.2 s, and the 503's body (what an SDK shows
    its user) says the header was capped and by what, not only a response header."""
    engine = Engine(procs, delay=0.01)
    proxy = Proxy(procs, engine.backend, "--no-witness", "--max-wait", "0.2",
                  "--max-priority", "normal")
    busy = holder("-b", engine.backend)
    status, headers, body = request(proxy.port, "POST", CHAT, chat_body(),
                                    {"X-Lanelock-Wait": "30", "X-Lanelock-Priority": "interactive"})
    assert (status, *told(headers)) == (503, "busy", "normal", "0.2", "0.2")
    message = json.loads(body)["error"]["message"]
    assert "X-Lanelock-Wait: 30 was capped to 0.2 s (the proxy's --max-wait)" in message, message
    assert "X-Lanelock-Priority: interactive was capped to normal" in message, message
    assert busy.release() == 0


def test_the_default_wait_is_within_the_cap_it_raises(procs, holder):
    """--wait 0.3 with --max-wait 0.1: the proxy's own default is never refused by its own cap
    (the cap in force is 0.3), and a header may ask that much."""
    engine = Engine(procs, delay=0.01)
    proxy = Proxy(procs, engine.backend, "--no-witness", "--wait", "0.3", "--max-wait", "0.1")
    busy = holder("-b", engine.backend)
    status, headers, _ = request(proxy.port, "POST", CHAT, chat_body())
    assert (status, *told(headers)) == (503, "busy", "normal", "0.3", "0.3")
    assert busy.release() == 0


def test_the_proxy_reads_its_own_settings_not_runs(procs, holder, config_files):
    """The user config's `wait` and `priority` are `run`'s: the proxy does not take them as its
    defaults; proxy_wait, proxy_max_wait and proxy_priority are the proxy's."""
    _, user = config_files
    user.write_text('wait = 3\npriority = "batch"\n')
    engine = Engine(procs, delay=0.01)
    busy = holder("-b", engine.backend)
    plain = Proxy(procs, engine.backend, "--no-witness")
    status, headers, _ = request(plain.port, "POST", CHAT, chat_body())
    assert (status, *told(headers)) == (503, "busy", "normal", "0", "60")
    user.write_text('wait = 3\npriority = "batch"\nproxy_wait = 0.2\nproxy_max_wait = 0.5\n'
                    'proxy_priority = "interactive"\n')
    configured = Proxy(procs, engine.backend, "--no-witness")
    status, headers, _ = request(configured.port, "POST", CHAT, chat_body())
    assert (status, *told(headers)) == (503, "busy", "interactive", "0.2", "0.5")
    assert busy.release() == 0


# An agent: a process of its own that sends one chat request naming no session (no header, no
# `user` field), then prints its pid, the status and the state the proxy answered.
AGENT = """
import http.client, json, os, sys
conn = http.client.HTTPConnection("127.0.0.1", int(sys.argv[1]), timeout=60)
conn.request("POST", "/v1/chat/completions", sys.argv[2], {"Content-Type": "application/json"})
answer = conn.getresponse()
answer.read()
print(json.dumps([os.getpid(), answer.status, answer.headers.get("X-Lanelock-State")]))
"""


def agent(port, env=None) -> tuple:
    done = subprocess.run([sys.executable, "-c", AGENT, str(port), chat_body().decode()],
                          capture_output=True, text=True, timeout=TIMEOUT,
                          env={**os.environ, **(env or {})})
    assert done.returncode == 0, done.stderr
    return tuple(json.loads(done.stdout))


def test_two_agents_that_name_no_session_are_two_sessions(procs, lanelock):
    """Two agent processes on loopback that send no session: each is named user@NAME/PID after
    its process, so the first one's --linger keeps the lane from the second (busy, 503) -- they
    were both "127.0.0.1", one session, and the second took the lane inside the first's linger."""
    engine = Engine(procs, delay=0.01)
    proxy = Proxy(procs, engine.backend, "--no-witness", "--linger", "60")
    first, status, state = agent(proxy.port)
    assert (status, state) == (200, "held")
    second, status, state = agent(proxy.port)
    assert (status, state) == (503, "busy")
    sessions = [event.get("session") for event in history(lanelock, engine.backend)]
    assert any(session and session.endswith(f"/{first}") and "@" in session
               for session in sessions), sessions
    assert any(session and session.endswith(f"/{second}") for session in sessions), sessions


def test_a_client_inside_a_turn_is_named_by_its_session(procs, lanelock):
    """A client whose environment carries a lanelock session (a turn's command is handed
    LANELOCK_SESSION) is that session at the proxy too."""
    engine = Engine(procs, delay=0.01)
    proxy = Proxy(procs, engine.backend, "--no-witness")
    _, status, state = agent(proxy.port, env={"LANELOCK_SESSION": "nightly-digest"})
    assert (status, state) == (200, "held")
    sessions = [event.get("session") for event in history(lanelock, engine.backend)]
    assert "nightly-digest" in sessions, sessions


# An engine that sends a stream's last event, [DONE], then waits before its chunked terminator
# -- what a loaded machine does between two writes of llama-server. An SDK closes the stream at
# [DONE] (openai: response.close()), before the proxy has read the engine's end.
LATE_END_ENGINE = r"""
import json, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        events = [{"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
                   "choices": [{"index": 0, "delta": {"content": word}, "finish_reason": None}]}
                  for word in ("one ", "two ")]
        events.append({"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
                       "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
        for data in [f"data: {json.dumps(event)}\n\n".encode() for event in events] + [
                b"data: [DONE]\n\n"]:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()
        time.sleep(1.5)
        try:
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except OSError:
            pass

server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
print(server.server_address[1], flush=True)
server.serve_forever()
"""

SDK_STREAM = """
import json, sys
import openai
client = openai.OpenAI(base_url=sys.argv[1], api_key="unused", max_retries=0)
raw = client.chat.completions.with_raw_response.create(
    model="m", messages=[{"role": "user", "content": "hi"}], stream=True, max_tokens=3)
reasons = [choice.finish_reason for chunk in raw.parse() for choice in chunk.choices]
print(json.dumps(reasons), flush=True)
"""


def test_a_stream_the_client_read_to_its_end_is_not_journaled_as_cut(procs, lanelock):
    """The openai SDK reads a stream to [DONE] and closes it; an engine whose chunked terminator
    comes later (a loaded machine) left the proxy reading the engine's end when the client hung
    up: the answer, complete, was journaled "the client hung up mid-answer" and -v said "client
    gone". A stream relayed to its terminal event is whole."""
    pytest.importorskip("openai")
    from support.processes import read_line

    engine = procs.start([sys.executable, "-c", LATE_END_ENGINE], stdout=subprocess.PIPE)
    port = int(read_line(engine.stdout))
    proxy = Proxy(procs, f"127.0.0.1:{port}", "--no-witness", "-v")
    done = subprocess.run([sys.executable, "-c", SDK_STREAM, proxy.url + "/v1"],
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)[-1] == "length"
    (released,) = wait_for(lambda: [event for event in history(lanelock, f"127.0.0.1:{port}")
                                    if event.get("event") == "released"] or None,
                           "the turn's end journaled")
    assert "hung up" not in str(released.get("ended")), released
    proxy.stop()
    assert "client gone" not in proxy.log() and " 200 held " in proxy.log(), proxy.log()


def test_the_verbose_line_names_the_session_and_the_fallback_that_answered(procs, holder):
    """-v named neither who asked nor where a deflected request went: now the session leads the
    line and a deflected one says which fallback answered it."""
    engine = Engine(procs, delay=0.01)
    cloud = Engine(procs, delay=0.01, name="cloud")
    proxy = Proxy(procs, engine.backend, "--no-witness", "-v", "--fallback", cloud.url + "/v1")
    status, _, _ = request(proxy.port, "POST", CHAT, chat_body(), {"X-Lanelock-Session": "chat-1"})
    assert status == 200
    busy = holder("-b", engine.backend)
    status, headers, _ = request(proxy.port, "POST", CHAT, chat_body(),
                                 {"X-Lanelock-Session": "cron-2"})
    assert (status, headers["X-Lanelock-State"]) == (200, "deflected")
    assert busy.release() == 0
    proxy.until(lambda log: log.count("proxy: [") == 2, "two request lines")
    lines = [line for line in proxy.stderr().splitlines() if "proxy: [" in line]
    assert "proxy: [chat-1] POST /v1/chat/completions 200 held on seat 1 (" in lines[0], lines
    assert f"proxy: [cron-2] POST /v1/chat/completions 200 deflected by fallback 1 {cloud.url}/v1 (" \
        in lines[1], lines


def test_a_url_fallback_on_this_machine_is_said_ungated_with_the_gated_spelling(procs):
    """A URL fallback that is another local server was used ungated without a word: the proxy
    says so once, at start, naming the @HOST:PORT that would gate it; a remote one is not said."""
    engine = Engine(procs, delay=0.01)
    other = Engine(procs, delay=0.01, name="other")
    proxy = Proxy(procs, engine.backend, "--no-witness", "--fallback", other.url + "/v1",
                  "--fallback", "https://api.example.com/v1")
    proxy.stop()
    said = proxy.log()
    assert (f"fallback 1 {other.url}/v1 is a server of this machine, used ungated; "
            f"--fallback @{other.backend} would gate it on its own lane") in said, said
    assert said.count("is a server of this machine") == 1, said
