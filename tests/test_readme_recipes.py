"""The README's setups run as written: its fenced commands in order, each asserting what the text
around it claims, with real clients (curl, the openai and anthropic SDKs, llm) against the stand-in
engine (lanelock.testing.standin) where the README has llama-server.

Ports are the one thing moved: the README's 8080 (the engine) and 8089 (the proxy) become free
ports, so the suite never meets a real engine or proxy of the machine. `lanelock` is the console
script next to this Python, as a user who installed it runs it.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import shlex
import subprocess
import sys
import tomllib
import urllib.request
from pathlib import Path

import pytest

from support.cli import TIMEOUT, environ
from support.processes import read_line, wait_for
from support.doc_blocks import README, block
from support.engine import Engine
from support.ports import free_port
from support.proxy import lane_status, open_stream, read_until

SCRIPT = Path(sys.executable).parent / "lanelock"     # the console script users run
LLM = Path(sys.executable).parent / "llm"


def commands(text: str) -> list[str]:
    """A block's commands: continuation lines joined, comments and blank lines dropped."""
    joined = text.replace("\\\n", " ")
    return [line.split("  #", 1)[0].strip() for line in joined.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def with_ports(text: str, engine: int, proxy: int | None = None) -> str:
    text = re.sub(r"(?<=[:\s])8080\b", str(engine), text)
    return text if proxy is None else re.sub(r"(?<=[:\s])8089\b", str(proxy), text)


def shell_env(**more) -> dict:
    """The shell a user types in: lanelock on PATH."""
    return environ({"PATH": f"{SCRIPT.parent}:/usr/bin:/bin", **more})


def start_engine(command: str, procs, tmp_path, events: int = 400) -> int:
    """`llama-server ... --port P --parallel N`: the stand-in on port P with N slots; a plain
    answer takes 0.2 s, a streamed one `events` events 0.05 s apart (or until its client hangs
    up)."""
    words = shlex.split(command)
    assert words[0] == "llama-server", command
    port, slots = words[words.index("--port") + 1], words[words.index("--parallel") + 1]
    port_file = tmp_path / "engine.port"
    engine = procs.start([sys.executable, "-m", "lanelock.testing", "serve", "--port", port,
                          "--parallel", slots, "--delay", "0.2", "--tokens", str(events),
                          "--token-interval", "0.05", "--port-file", port_file],
                         stderr=subprocess.PIPE)
    wait_for(lambda: port_file.exists() or engine.poll() is not None, what="the stand-in engine")
    assert engine.poll() is None, engine.stderr.read()
    return int(slots)


def start_proxy(command: str, procs) -> subprocess.Popen:
    words = shlex.split(command)
    assert words[:2] == ["lanelock", "proxy"], command
    proxy = procs.start([SCRIPT, *words[1:]], env=shell_env(), stderr=subprocess.PIPE)
    line = read_line(proxy.stderr)
    assert "proxy listening on" in line, line
    return proxy


def journal(lanelock, backend: str) -> list[dict]:
    return json.loads(lanelock("history", "--json", "-b", backend).stdout)["events"]


def ask(proxy: int) -> tuple[str, dict]:
    """One chat request at the proxy, as curl sends the README's: its answer and headers."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{proxy}/v1/chat/completions", headers={"Content-Type": "application/json"},
        data=json.dumps({"model": "local", "messages": [{"role": "user", "content": "hi"}]}).encode())
    with urllib.request.urlopen(request, timeout=TIMEOUT) as answer:
        return json.loads(answer.read())["choices"][0]["message"]["content"], dict(answer.headers)


# -- 1. scripts and cron: llm pointed at the engine -------------------------------------------------
def test_the_llm_entry_points_llm_at_the_engine(procs, run_cmd, tmp_path, lanelock):
    """The entry, written into the directory `dirname "$(llm logs path)"` prints, makes the real
    `llm -m local` ask the engine at its api_base; wrapped in `lanelock run`, as a held turn."""
    engine = free_port()
    start_engine(f"llama-server -m model.gguf --port {engine} --parallel 1", procs, tmp_path,
                 events=4)
    env = shell_env(LLM_USER_PATH=tmp_path / "llm", PATH=f"{LLM.parent}:/usr/bin:/bin")
    where = run_cmd(["bash", "-c", 'dirname "$(llm logs path)"'], env=env)
    assert where.returncode == 0, where.stderr
    (Path(where.stdout.strip()) / "extra-openai-models.yaml").write_text(
        with_ports(block("llm-entry").text, engine))
    done = run_cmd([SCRIPT, "run", "-b", f"127.0.0.1:{engine}", "--", "llm", "-m", "local", "hello"],
                   env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("tok0 "), done.stdout        # the stand-in's streamed answer
    assert [event["event"] for event in journal(lanelock, f"127.0.0.1:{engine}")] == \
        ["acquired", "released"]


# -- 2. several agents on one engine -------------------------------------------------------------
def test_the_several_agents_recipe_runs_as_written(procs, run_cmd, tmp_path, lanelock,
                                                   config_files):
    """The recipe's commands in order: the engine (the stand-in, with the slots its --parallel
    says), `seats ... auto` gives the lane that many seats, the proxy starts, curl's request is
    answered by the engine. Then what the text claims of it: two requests generate at once and a
    third waits for a seat instead of a 503 (it sends no header: the proxy's --wait); the openai
    SDK's and llm's settings reach the engine through the proxy."""
    engine, proxy_port = free_port(), free_port()
    # The proxy's command names no --listen: its default port (8089) moves in the config file.
    config_files[1].write_text(f'proxy_listen = "127.0.0.1:{proxy_port}"\n')
    recipe = commands(with_ports(block("agents-recipe").text, engine, proxy_port))
    assert [words.split()[:2] for words in recipe] == \
        [["llama-server", "-m"], ["lanelock", "seats"], ["lanelock", "proxy"], ["curl", "-sf"]]
    slots = start_engine(recipe[0], procs, tmp_path)
    seats = run_cmd(["bash", "-c", recipe[1]], env=shell_env())
    assert seats.returncode == 0, seats.stderr
    backend = f"127.0.0.1:{engine}"
    assert lanelock("seats", "-b", backend).stdout.strip() == str(slots) == "2"
    proxy = start_proxy(recipe[2], procs)
    curl = run_cmd(["bash", "-c", recipe[3]], env=shell_env())
    assert curl.returncode == 0, curl.stderr
    assert json.loads(curl.stdout)["choices"][0]["message"]["content"] == "answer from stand-in"

    # Two agents generating (streams the engine has begun) hold both seats; a third request,
    # sending no header, waits for a seat (the proxy's --wait) and is served when one frees.
    streams = [open_stream(proxy_port) for _ in range(2)]
    for stream in streams:
        read_until(stream, b"data: ")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        third = pool.submit(ask, proxy_port)
        # Waiting on the lane's seats, nothing reports: the lane's queue says it waits.
        wait_for(lambda: len(lane_status(lanelock, backend)["queue"]) == 1,
                 what="the third request to queue for a seat")
        assert not third.done()
        # Two seats: two at once at the engine, never three, while the third waits. (Across the
        # hand-off below the engine may count one more for a moment: the seat frees as the proxy
        # closes the ended stream's connection, and the engine notices that at its own pace --
        # the stand-in within its poll, llama-server at its next token.)
        stats = json.loads(urllib.request.urlopen(f"http://{backend}/stats",
                                                  timeout=TIMEOUT).read())
        assert (stats["max_in_flight"], stats["in_flight"]) == (2, 2), stats
        streams.pop().close()          # an agent's answer ends: its seat frees
        text, headers = third.result(timeout=TIMEOUT)
    assert (text, headers["X-Lanelock-State"], headers["X-Lanelock-Wait"]) == \
        ("answer from stand-in", "held", "300")
    streams.pop().close()

    client = with_ports(block("openai-client").text, engine, proxy_port)
    done = run_cmd([sys.executable, "-c", client], env=environ({"OPENAI_API_KEY": None}))
    assert (done.returncode, done.stdout) == (0, "answer from stand-in\n"), done.stderr

    # llm: the first setup's entry, its api_base at the proxy as the README says.
    said = " ".join(README.read_text().split())
    assert "`llm`: the `extra-openai-models.yaml` entry of the first setup, with `api_base: " \
           "http://127.0.0.1:8089/v1`" in said
    entry = block("llm-entry").text.replace("http://127.0.0.1:8080/v1",
                                            f"http://127.0.0.1:{proxy_port}/v1")
    (tmp_path / "llm").mkdir()
    (tmp_path / "llm" / "extra-openai-models.yaml").write_text(entry)
    before = len(journal(lanelock, backend))
    done = run_cmd([LLM, "-m", "local", "--no-stream", "hello"],
                   env=shell_env(LLM_USER_PATH=tmp_path / "llm"))
    assert (done.returncode, done.stdout) == (0, "answer from stand-in\n"), done.stderr
    through = journal(lanelock, backend)[before:]
    assert [(event["event"], event.get("via")) for event in through] == \
        [("acquired", "proxy"), ("released", "proxy")], through
    proxy.terminate()
    assert proxy.wait(timeout=TIMEOUT) == 0


def test_claude_code_and_codex_settings_reach_the_proxy(procs, run_cmd, lanelock):
    """Claude Code's variables, read by the anthropic SDK as Claude Code reads them, send its
    Messages request through the proxy; Codex's provider sends its Responses request there (its
    base_url plus /responses, wire_api "responses"). Each is a held turn on the engine's lane."""
    engine = Engine(procs, strict=True)          # answers every gated path, /v1/messages included
    port = free_port()
    proxy = start_proxy(f"lanelock proxy -b {engine.backend} --listen 127.0.0.1:{port}", procs)

    settings = {}
    for line in commands(with_ports(block("claude-code").text, engine.port, port)):
        words = shlex.split(line)
        assert words[0] == "export", line
        settings.update(word.split("=", 1) for word in words[1:])
    assert set(settings) == {"ANTHROPIC_BASE_URL", "ANTHROPIC_AUTH_TOKEN", "ANTHROPIC_MODEL"}
    claude = ("import anthropic, os\n"
              "client = anthropic.Anthropic(max_retries=0)\n"
              "reply = client.messages.with_raw_response.create(model=os.environ['ANTHROPIC_MODEL'],"
              " max_tokens=16, messages=[{'role': 'user', 'content': 'hello'}])\n"
              "print(reply.http_request.url, reply.headers['x-lanelock-state'])\n")
    done = run_cmd([sys.executable, "-c", claude],
                   env=environ({**settings, "ANTHROPIC_API_KEY": None}))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [f"http://127.0.0.1:{port}/v1/messages", "held"]

    config = tomllib.loads(with_ports(block("codex").text, engine.port, port))
    provider = config["model_providers"][config["model_provider"]]
    assert provider["wire_api"] == "responses"
    request = urllib.request.Request(
        provider["base_url"] + "/responses", headers={"Content-Type": "application/json"},
        data=json.dumps({"model": config["model"], "input": "hello"}).encode())
    with urllib.request.urlopen(request, timeout=TIMEOUT) as answer:
        assert answer.headers["X-Lanelock-State"] == "held"
    paths = [event.get("path") for event in journal(lanelock, engine.backend)
             if event["event"] == "acquired"]
    assert paths == ["/v1/messages", "/v1/responses"], paths
    proxy.terminate()
    assert proxy.wait(timeout=TIMEOUT) == 0


# -- 3. several hosts --------------------------------------------------------------------------------
def test_the_several_hosts_recipe_runs_as_written(postgres, lock_roots, run_cmd, tmp_path, lanelock):
    """Each command in order, on this host, against a real PostgreSQL server: the store goes into
    the system config (every user and cron reads it), `where` names it and the bound on a vanished
    host, and the turn holds the lane in the store -- no lock file under any root."""
    lock_roots.watch_store(postgres.dsn)
    text = block("hosts").text.replace("postgresql://lanes@db.lan/lanes", postgres.dsn)
    recipe = commands(text)
    assert [line.split()[:2] for line in recipe] == \
        [["lanelock", "config"], ["lanelock", "where"], ["lanelock", "run"]]
    ask_local = tmp_path / "ask-local.sh"
    ask_local.write_text('#!/bin/sh\necho "$LANELOCK_STATE $LANELOCK_LANE"\n')
    ask_local.chmod(0o755)
    outputs = []
    for line in recipe:
        done = run_cmd(["bash", "-c", line], env=shell_env(), cwd=tmp_path)
        assert done.returncode == 0, (line, done.stderr)
        outputs.append(done.stdout)
    assert "postgresql" in outputs[1] and "within about 11 s" in " ".join(outputs[1].split())
    assert outputs[2] == "held 10.0.0.5:8080\n"
    events = json.loads(lanelock("history", "--json", "-b", "10.0.0.5:8080").stdout)["events"]
    assert [event["event"] for event in events][-2:] == ["acquired", "released"]
