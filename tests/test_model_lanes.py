"""Lanes as the GPUs are: with lanes keyed by model, each model's turns hold a lane of
their own -- through `run`, the API and one proxy alike, which reads each request's model from
its body (or llama-swap's /upstream/MODEL/ path); models that share a GPU share a lane through the
model map (`lanelock models`), one value every process reads; lanes keyed by model with no model
never stop a command. Real processes: `lanelock run`, `lanelock proxy`, the stand-in engine."""

from __future__ import annotations

import json
import socket

import pytest

from support.cli import LANELOCK
from support.engine import Engine
from support.kinds import KindEngine
from support.proxy import CHAT, Proxy, chat_body, open_stream, raw_request, read_until, request

MINIMAL_PATH = "/usr/bin:/bin"
NO_MODEL = "lanes keyed by model, but no model is named"


def warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("lanelock: warning:")]


def lock_path_of(result) -> str:
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


# -- key_by = "model" with no model: the backend's lane, one warning ------------------------------
@pytest.mark.parametrize("where", ["config", "env", "flag"])
def test_lanes_keyed_by_model_with_no_model_run_the_command_with_one_warning(
        where, lanelock, config_files, lock_dir):
    system, _ = config_files
    args, env = [], {}
    if where == "config":
        system.write_text('key_by = "model"\n')
    elif where == "env":
        env["LANELOCK_KEY_BY"] = "model"
    else:
        args = ["--key-by", "model"]
    result = lanelock("run", *args, "--", "sh", "-c", 'echo "$LANELOCK_LOCK_PATH"; exit 3',
                      env=env)
    assert result.returncode == 3, result.stderr
    assert result.stdout.strip() == str(lock_dir / "localhost-8080.lock")
    (line,) = warnings(result.stderr)
    assert NO_MODEL in line and "the backend's lane localhost:8080 is used" in line, line


def test_a_system_config_keying_by_model_runs_a_cron_turn_with_one_warning(run_cmd, lock_dir,
                                                                           tmp_path):
    config = tmp_path / "system.toml"
    config.write_text('key_by = "model"\n')
    (tmp_path / "home").mkdir()
    cron = run_cmd(["env", "-i", f"PATH={MINIMAL_PATH}", f"HOME={tmp_path / 'home'}",
                    f"LANELOCK_DIR={lock_dir}", f"LANELOCK_SYSTEM_CONFIG={config}", *LANELOCK,
                    "run", "--", "sh", "-c", 'echo "$LANELOCK_LOCK_PATH"; exit 4'], env={})
    assert cron.returncode == 4, cron.stderr
    assert cron.stdout.strip() == str(lock_dir / "localhost-8080.lock")
    (line,) = warnings(cron.stderr)
    assert f"system file {config}" in line and NO_MODEL in line, line


def test_a_gate_keyed_by_model_with_no_model_takes_the_backend_lane_and_warns_once(lock_dir):
    from lanelock.gate import HELD, Gate

    said = []
    gates = [Gate("127.0.0.1:8080", key_by="model", warn=said.append) for _ in range(3)]
    with gates[0].turn(session="api") as turn:
        assert turn.state == HELD and gates[0].lane.name == "localhost:8080"
    assert {gate.lock_path for gate in gates} == {str(lock_dir / "localhost-8080.lock")}
    assert len([line for line in said if NO_MODEL in line]) <= 1   # said once a process


# -- the model map --------------------------------------------------------------------------------
def test_the_map_set_from_one_home_is_read_under_env_i_from_another(lanelock, run_cmd, holder,
                                                                    lock_dir, tmp_path):
    for name in ("home-a", "home-b"):
        (tmp_path / name).mkdir()
    shared = lanelock("models", "share", "gpu0", "qwen", "llama", env={"HOME": tmp_path / "home-a"})
    assert shared.returncode == 0, shared.stderr
    assert shared.stdout == "localhost:8080#gpu0: llama, qwen\n"

    def cron(*args):
        return run_cmd(["env", "-i", f"PATH={MINIMAL_PATH}", f"HOME={tmp_path / 'home-b'}",
                        f"LANELOCK_DIR={lock_dir}",
                        f"LANELOCK_SYSTEM_CONFIG={tmp_path / 'no-such.toml'}", *LANELOCK, *args],
                       env={})

    shown = cron("models", "--json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["map"] == {"llama": "gpu0", "qwen": "gpu0"}
    path = lock_path_of(cron("run", "--key-by", "model", "-m", "llama", "--", "printenv",
                             "LANELOCK_LOCK_PATH"))
    assert path == str(lock_dir / "localhost-8080~gpu0.lock")
    # Two models on one GPU share its lane; a third keeps its own.
    held = holder("--key-by", "model", "-m", "qwen")
    assert cron("run", "--key-by", "model", "-m", "llama", "--", "true").returncode == 75
    assert lanelock("run", "--key-by", "model", "-m", "mistral", "--", "true").returncode == 0
    status = json.loads(lanelock("status", "--key-by", "model", "-m", "qwen", "--json").stdout)
    (lane,) = status["lanes"]
    assert lane["lane"] == "localhost:8080#gpu0" and lane["state"] == "held"
    assert lane["models"] == {"localhost:8080#gpu0": ["llama", "qwen"]}
    plain = lanelock("status")
    assert "models sharing localhost:8080#gpu0: llama, qwen\n" in plain.stdout, plain
    assert held.release() == 0
    # unshare: the model is on its own lane again
    assert lanelock("models", "unshare", "llama").stdout == "localhost:8080#gpu0: qwen\n"
    assert lock_path_of(lanelock("run", "--key-by", "model", "-m", "llama", "--", "printenv",
                                 "LANELOCK_LOCK_PATH")) == str(lock_dir / "localhost-8080~llama.lock")


@pytest.mark.parametrize("words", [["bogus"], ["share", "gpu0"], ["unshare"], ["unshare", "nope"],
                                   ["share", "", "a"], ["share", "gpu0", "a\nb"]])
def test_bad_words_to_models_are_a_usage_error(lanelock, words, lock_dir):
    result = lanelock("models", *words)
    assert result.returncode == 2, result
    assert result.stderr.startswith("lanelock: ") and "Traceback" not in result.stderr
    assert not (lock_dir / "kept.json").exists()


def test_a_map_that_cannot_be_kept_is_one_line_and_exit_69(lanelock, tmp_path):
    (tmp_path / "file").write_text("")
    result = lanelock("models", "--lock-dir", str(tmp_path / "file" / "root"),
                      "share", "gpu0", "a", "b")
    assert result.returncode == 69, result
    assert len(result.stderr.splitlines()) == 1 and result.stderr.startswith("lanelock: ")


# -- through the proxy ------------------------------------------------------------------------------
def chat(model: str | None, stream: bool = False) -> bytes:
    body = json.loads(chat_body(stream=stream))
    if model is None:
        body.pop("model")
    else:
        body["model"] = model
    return json.dumps(body).encode()


BODIES = {   # a request for MODEL in each family that names one in its body
    "openai": (CHAT, lambda model: chat(model)),
    "completions": ("/v1/completions", lambda model: json.dumps(
        {"model": model, "prompt": "hi"}).encode()),
    "embeddings": ("/v1/embeddings", lambda model: json.dumps(
        {"model": model, "input": "hi"}).encode()),
    "responses": ("/v1/responses", lambda model: json.dumps(
        {"model": model, "input": "hi"}).encode()),
    "anthropic": ("/v1/messages", lambda model: json.dumps(
        {"model": model, "max_tokens": 8,
         "messages": [{"role": "user", "content": "hi"}]}).encode()),
    "ollama-chat": ("/api/chat", lambda model: json.dumps(
        {"model": model, "messages": [{"role": "user", "content": "hi"}]}).encode()),
    "ollama-generate": ("/api/generate", lambda model: json.dumps(
        {"model": model, "prompt": "hi"}).encode()),
}


@pytest.mark.parametrize("family", sorted(BODIES))
def test_through_one_proxy_model_b_is_served_while_model_a_is_held(family, procs, holder):
    engine = Engine(procs, delay=0.05, strict=True)
    proxy = Proxy(procs, engine.backend, "--key-by", "model", "--no-witness")
    path, body = BODIES[family]
    held = holder("-b", engine.backend, "--key-by", "model", "-m", "model-a")
    status, headers, _ = request(proxy.port, "POST", path, body("model-b"))
    assert (status, headers["X-Lanelock-State"]) == (200, "held"), (status, dict(headers))
    status, headers, _ = request(proxy.port, "POST", path, body("model-a"))
    assert status in (503, 529) and headers["X-Lanelock-State"] == "busy", status
    assert f"pid {held.pid}" in headers.get("X-Lanelock-Reason", "") or status in (503, 529)
    assert held.release() == 0
    assert NO_MODEL not in proxy.log()


def test_a_streaming_request_holds_its_model_lane_only(procs):
    engine = Engine(procs, delay=0.05, tokens=300, interval=0.1)   # a stream of 30 s
    proxy = Proxy(procs, engine.backend, "--key-by", "model", "--no-witness")
    stream = open_stream(proxy.port, chat("model-a", stream=True))
    try:
        assert b"data:" in read_until(stream, b"data:")   # streaming: model-a's lane is held
        status, headers, _ = request(proxy.port, "POST", CHAT, chat("model-b"))
        assert (status, headers["X-Lanelock-State"]) == (200, "held")
        status, headers, _ = request(proxy.port, "POST", CHAT, chat("model-a"))
        assert (status, headers["X-Lanelock-State"]) == (503, "busy")
        assert "Retry-After" in headers
    finally:
        stream.close()


def test_models_sharing_a_lane_share_it_through_the_proxy(procs, holder, lanelock):
    engine = Engine(procs, delay=0.05)
    assert lanelock("models", "-b", engine.backend, "share", "gpu0", "model-a",
                    "model-b").returncode == 0
    proxy = Proxy(procs, engine.backend, "--key-by", "model", "--no-witness")
    held = holder("-b", engine.backend, "--key-by", "model", "-m", "model-a")
    status, headers, _ = request(proxy.port, "POST", CHAT, chat("model-b"))
    assert (status, headers["X-Lanelock-State"]) == (503, "busy")
    status, headers, _ = request(proxy.port, "POST", CHAT, chat("model-c"))
    assert (status, headers["X-Lanelock-State"]) == (200, "held")
    assert held.release() == 0


def test_a_request_naming_no_model_takes_the_backend_lane_said_once(procs, holder):
    engine = Engine(procs, delay=0.05)
    proxy = Proxy(procs, engine.backend, "--key-by", "model", "--no-witness")
    for _ in range(2):
        status, headers, _ = request(proxy.port, "POST", CHAT, chat(None))
        assert (status, headers["X-Lanelock-State"]) == (200, "held")
    held = holder("-b", engine.backend)   # the backend's own lane
    status, headers, _ = request(proxy.port, "POST", CHAT, chat(None))
    assert (status, headers["X-Lanelock-State"]) == (503, "busy")
    status, headers, _ = request(proxy.port, "POST", CHAT, chat("model-a"))
    assert (status, headers["X-Lanelock-State"]) == (200, "held")
    assert held.release() == 0
    assert proxy.log().count("a request naming no model takes the lane") == 1, proxy.log()


def test_a_llama_swap_upstream_path_is_gated_on_its_model_lane(procs, holder, tmp_path):
    engine = KindEngine(procs, tmp_path, "--kind", "llama-swap", "--name", "model-a", delay=0.05)
    proxy = Proxy(procs, engine.backend, "--key-by", "model", "--no-witness")
    held = holder("-b", engine.backend, "--key-by", "model", "-m", "model-a")
    for body in (chat(None), chat("model-b")):   # the path routes it, whatever the body says
        status, headers, _ = raw_request(proxy.port, "POST",
                                         "/upstream/model-a/v1/chat/completions", body)
        assert (status, headers["x-lanelock-state"]) == (503, "busy")
    # model-b's lane is free: forwarded (the stand-in answers what llama-swap would load)
    status, headers, _ = raw_request(proxy.port, "POST", "/upstream/model-b/v1/chat/completions",
                                     chat(None))
    assert headers["x-lanelock-state"] == "held", (status, headers)
    assert held.release() == 0


def test_the_proxy_status_lists_each_model_lane(procs, holder):
    engine = Engine(procs, delay=0.05)
    proxy = Proxy(procs, engine.backend, "--key-by", "model", "--no-witness")
    held = holder("-b", engine.backend, "--key-by", "model", "-m", "model-a")
    request(proxy.port, "POST", CHAT, chat("model-a"))
    request(proxy.port, "POST", CHAT, chat("model-b"))
    status, _, body = request(proxy.port, "GET", "/lanelock/status")
    assert status == 200
    lanes = {lane["lane"]: lane["state"] for lane in json.loads(body)["lanes"]}
    assert lanes[f"localhost:{engine.port}#model-a"] == "held"
    assert lanes[f"localhost:{engine.port}#model-b"] == "free"
    status, _, body = request(proxy.port, "GET", "/metrics")
    assert status == 200
    for lane in (f"localhost:{engine.port}", f"localhost:{engine.port}#model-a",
                 f"localhost:{engine.port}#model-b"):
        assert f'lane="{lane}"' in body.decode(), lane
    assert held.release() == 0


# -- the README's block -------------------------------------------------------------------------------
def test_the_readme_model_map_block(procs, holder, lanelock):
    """Each line as written, on a stand-in engine's port: the two models share gpu0, the map says
    so, and the proxy keyed by model answers a request for one busy while the other holds gpu0."""
    import shlex

    from support.doc_blocks import block

    engine = Engine(procs, delay=0.05)
    lines = [line.replace("127.0.0.1:8080", engine.backend)
             for line in block("models-map").text.strip().splitlines()]
    share, show, serve = (shlex.split(line) for line in lines)
    shared = lanelock(*share[1:])
    assert shared.returncode == 0, shared.stderr
    assert lanelock(*show[1:]).stdout == \
        f"localhost:{engine.port}#gpu0: llama3.1-8b, qwen2.5-7b\n"
    proxy = Proxy(procs, engine.backend, *serve[2:], "--no-witness")
    held = holder("-b", engine.backend, "--key-by", "model", "-m", "qwen2.5-7b")
    status, headers, _ = request(proxy.port, "POST", CHAT, chat("llama3.1-8b"))
    assert (status, headers["X-Lanelock-State"]) == (503, "busy")
    assert held.release() == 0


# -- the witness: a running model generating counts against its own lane ----------------------------
def test_the_witness_holds_each_llama_swap_model_against_its_own_lane(procs, holder, tmp_path,
                                                                      lanelock):
    import subprocess

    from support.cli import environ
    from support.processes import read_line

    engine = KindEngine(procs, tmp_path, "--kind", "llama-swap", "--name", "model-a", delay=1.0)
    watch = procs.start([*LANELOCK, "watch", "-b", engine.backend, "--key-by", "model",
                         "--interval", "0.1"], env=environ(None), stdout=subprocess.DEVNULL,
                        stderr=subprocess.PIPE)
    lines = [read_line(watch.stderr)]
    assert "watching the engine" in lines[0] and "warning" not in lines[0], lines
    body = {"messages": [{"role": "user", "content": "straight to the engine"}]}
    # model-a's lane held: its generation is covered, though the backend's lane is free
    held = holder("-b", engine.backend, "--key-by", "model", "-m", "model-a")
    engine.ask("/upstream/model-a/v1/chat/completions", body)
    assert held.release() == 0
    # another model's lane held: model-a's generation is unseen, on model-a's lane
    other = holder("-b", engine.backend, "--key-by", "model", "-m", "model-b")
    engine.ask("/upstream/model-a/v1/chat/completions", body)
    while "unseen generation" not in lines[-1]:
        lines.append(read_line(watch.stderr))
        assert lines[-1], lines
    assert f"unseen generation on localhost:{engine.port}#model-a:" in lines[-1], lines
    assert sum("unseen generation" in line for line in lines) == 1, lines
    assert other.release() == 0
    watch.terminate()
    assert watch.wait(timeout=30) == 0
    events = json.loads(lanelock("history", "-b", engine.backend, "--key-by", "model", "-m",
                                 "model-a", "--json").stdout)["events"]
    assert [event["event"] for event in events if event["event"] == "unseen"] == ["unseen"]
    assert engine.stats().get("loads", []) == []   # no model was loaded by the looks


def test_a_fallback_engine_is_taken_on_the_same_models_lane(procs, holder, lanelock):
    engine, other = Engine(procs, delay=0.05), Engine(procs, delay=0.05)
    proxy = Proxy(procs, engine.backend, "--key-by", "model", "--no-witness",
                  "--fallback", f"@{other.backend}")
    held = holder("-b", engine.backend, "--key-by", "model", "-m", "model-a")
    status, headers, _ = request(proxy.port, "POST", CHAT, chat("model-a"))
    assert (status, headers["X-Lanelock-State"]) == (200, "deflected"), dict(headers)
    assert held.release() == 0
    result = lanelock("history", "-b", other.backend, "--key-by", "model", "-m", "model-a",
                      "--json")
    assert "acquired" in [event["event"] for event in json.loads(result.stdout)["events"]]
    assert NO_MODEL not in proxy.log()


def test_a_public_backend_has_no_model_map(lanelock, lock_dir):
    result = lanelock("models", "-b", "api.openai.com:443", "share", "gpu0", "a")
    assert result.returncode == 2 and "is not a local lane" in result.stderr, result
    assert not (lock_dir / "kept.json").exists()


def test_a_lingering_session_keeps_its_model_lane_only(procs):
    engine = Engine(procs, delay=0.05)
    proxy = Proxy(procs, engine.backend, "--key-by", "model", "--no-witness", "--linger", "30")
    first = {"X-Lanelock-Session": "first"}
    status, headers, _ = request(proxy.port, "POST", CHAT, chat("model-a"), first)
    assert (status, headers["X-Lanelock-State"]) == (200, "held")   # model-a's lane lingers
    second = {"X-Lanelock-Session": "second"}
    status, headers, _ = request(proxy.port, "POST", CHAT, chat("model-b"), second)
    assert (status, headers["X-Lanelock-State"]) == (200, "held")
    status, headers, _ = request(proxy.port, "POST", CHAT, chat("model-a"), second)
    assert (status, headers["X-Lanelock-State"]) == (503, "busy")
    status, headers, _ = request(proxy.port, "POST", CHAT, chat("model-a"), first)
    assert (status, headers["X-Lanelock-State"]) == (200, "held")   # its own lingering turn


def test_the_map_is_kept_in_a_postgresql_store_for_every_process(postgres, lanelock, run_cmd,
                                                                 lock_roots, tmp_path):
    """The same command on the PostgreSQL store: the map every host's turns read (a backend of
    this test's own: the server is the session's)."""
    lock_roots.watch_store(postgres.dsn)
    backend = "127.0.0.1:18938"
    base = ["-b", backend, "--store", postgres.dsn]
    shared = lanelock("models", *base, "share", "gpu0", "qwen", "llama", "--json")
    assert shared.returncode == 0, shared.stderr
    # A host's own engine: its map is this host's (another host's localhost is another engine)
    assert json.loads(shared.stdout)["key"] == f"models/localhost:18938@{socket.gethostname()}"
    (tmp_path / "home").mkdir()
    cron = run_cmd(["env", "-i", f"PATH={MINIMAL_PATH}", f"HOME={tmp_path / 'home'}",
                    f"LANELOCK_SYSTEM_CONFIG={tmp_path / 'no-such.toml'}", *LANELOCK, "where",
                    *base, "--key-by", "model", "-m", "llama", "--json"], env={})
    assert cron.returncode == 0, cron.stderr
    assert json.loads(cron.stdout)["lane"].endswith("#gpu0"), cron.stdout
    unshared = lanelock("models", *base, "unshare", "qwen", "llama")
    assert unshared.returncode == 0 and "no models share a lane" in unshared.stdout, unshared
