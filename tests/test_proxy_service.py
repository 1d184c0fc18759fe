"""`lanelock proxy` run as a service for weeks: every option in the config file, SIGHUP reloads
it, a health endpoint of its own, log lines with their time, a start line and -v lines that say
the seats and pinning, per-client waits and classes, and each session's last hour.

Real processes throughout: the stand-in engine, recorders standing in for cloud fallbacks, the
proxy, holders and the CLI; every wait is on a line the proxy writes or an answer it gives.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest

from support.cli import LANELOCK, environ
from support.processes import read_line, wait_for
from support.engine import Engine
from support.proxy import (CHAT, LISTENING, Proxy, Recorder, chat_body, open_stream, read_until,
                           request)
from support.standin_kind import Served

pytest.importorskip("aiohttp")

STAMP = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}[+-]\d\d:\d\d "


def status_of(proxy) -> dict:
    status, _, body = request(proxy.port, "GET", "/lanelock/status")
    assert status == 200, body
    return json.loads(body)


# -- every option in the config file -----------------------------------------------------------
def test_the_fallback_from_the_config_file_answers_a_busy_request(procs, holder, lanelock,
                                                                  config_files):
    engine = Engine(procs)
    cloud, flagged = Recorder(procs), Recorder(procs)
    _, user = config_files
    user.write_text(f'proxy_fallback = ["{cloud.url}/v1"]\n'
                    'proxy_fallback_model = ["cloud-model"]\nproxy_verbose = true\n')
    proxy = Proxy(procs, engine.backend)
    held = holder("-b", engine.backend)
    status, headers, _ = request(proxy.port, "POST", CHAT, chat_body())
    assert (status, headers["X-Lanelock-State"]) == (200, "deflected")
    assert json.loads(cloud.next_request()["body"])["model"] == "cloud-model"
    proxy.said(f"200 deflected by fallback 1 {cloud.url}/v1")   # proxy_verbose from the file
    # The flag over the file, as for every other setting: its list replaces the file's.
    over = Proxy(procs, engine.backend, "--fallback", f"{flagged.url}/v1")
    status, headers, _ = request(over.port, "POST", CHAT, chat_body())
    assert (status, headers["X-Lanelock-State"]) == (200, "deflected")
    assert json.loads(flagged.next_request()["body"])["model"] == "cloud-model"   # the file's
    assert held.release() == 0
    shown = json.loads(lanelock("config", "show", "--json").stdout)["settings"]
    assert shown["proxy_fallback"] == {"value": [f"{cloud.url}/v1"],
                                       "source": f"user file {user}"}
    assert shown["proxy_fallback_timeout"] == {"value": 60, "source": "default"}
    settings = status_of(over)["proxy"]["settings"]
    assert settings["proxy_fallback"] == {"value": [f"{flagged.url}/v1"], "source": "flag"}


def test_the_proxys_settings_in_status_never_say_a_secret(procs, config_files):
    engine = Engine(procs)
    _, user = config_files
    user.write_text('proxy_fallback = ["https://me:hunter2@api.example.com/v1?key=hunter2"]\n'
                    'proxy_fallback_key_env = ["CLOUD_KEY"]\nproxy_token_env = "PROXY_TOKEN"\n')
    proxy = Proxy(procs, engine.backend, env={"CLOUD_KEY": "sk-secret-1", "PROXY_TOKEN": "tok-2"})
    status, _, body = request(proxy.port, "GET", "/lanelock/status",
                              headers={"Authorization": "Bearer tok-2"})
    assert status == 200, body
    text = body.decode()
    for secret in ("hunter2", "sk-secret-1", "tok-2"):
        assert secret not in text
    settings = json.loads(body)["proxy"]["settings"]
    assert settings["proxy_fallback"]["value"] == ["https://api.example.com/v1"]
    assert settings["proxy_fallback_key_env"]["value"] == ["CLOUD_KEY"]


# -- SIGHUP ------------------------------------------------------------------------------------
def test_sighup_reloads_the_file_for_the_next_request_and_leaves_a_stream_alone(
        procs, holder, config_files):
    engine = Engine(procs, tokens=30, interval=0.05)
    old, new = Recorder(procs), Recorder(procs)
    _, user = config_files
    user.write_text(f'proxy_fallback = ["{old.url}/v1"]\n')
    proxy = Proxy(procs, engine.backend)
    sock = open_stream(proxy.port)            # holds the lane while the file changes
    seen = read_until(sock, b"data: ")
    user.write_text(f'proxy_fallback = ["{new.url}/v1"]\nproxy_verbose = true\n')
    proxy.proc.send_signal(signal.SIGHUP)
    proxy.said("reloaded ")
    status, headers, _ = request(proxy.port, "POST", CHAT, chat_body(),
                                 headers={"X-Lanelock-Session": "next"})
    assert (status, headers["X-Lanelock-State"]) == (200, "deflected"), proxy.log()
    assert new.next_request()["path"] == CHAT
    proxy.said(f"[next] POST {CHAT} 200 deflected by fallback 1 {new.url}/v1")   # -v: reloaded
    seen = read_until(sock, b"data: [DONE]", seen)   # the stream in flight, untouched
    sock.close()
    assert seen.count(b"data: ") == 31 and b" 200 " in seen.split(b"\r\n", 1)[0]
    # A file that does not parse: one line, and the running settings stay. (The holder first:
    # a turn started under a broken file runs ungated, as it should.)
    held = holder("-b", engine.backend)
    user.write_text("proxy_fallback = [\n")
    proxy.proc.send_signal(signal.SIGHUP)
    (line,) = [line for line in proxy.said("keeping the running settings").splitlines()
               if "keeping" in line]
    assert re.search(rf"{STAMP}lanelock: warning: reload: {re.escape(str(user))}: .*; keeping "
                     "the running settings$", line), line
    status, headers, _ = request(proxy.port, "POST", CHAT, chat_body())
    assert (status, headers["X-Lanelock-State"]) == (200, "deflected")
    assert new.next_request()["path"] == CHAT
    assert held.release() == 0
    assert proxy.proc.poll() is None
    assert proxy.stop() == 0


# -- health ------------------------------------------------------------------------------------
def test_health_is_200_while_the_engine_answers_and_503_while_it_does_not(procs, tmp_path):
    engine = Served(procs, tmp_path, "--kind", "llama.cpp", "--parallel", "2")
    proxy = Proxy(procs, engine.backend, "-v")
    status, headers, body = request(proxy.port, "GET", "/lanelock/health")
    assert (status, headers["Content-Type"].split(";")[0]) == (200, "application/json"), body
    health = json.loads(body)
    assert health["proxy"]["state"] == "serving" and health["proxy"]["pid"] == proxy.proc.pid
    assert health["engine"]["answers"] is True and health["engine"]["kind"] == "llama.cpp"
    (lane,) = health["lanes"]
    assert (lane["lane"], lane["seats"], lane["held"]) == (proxy.lane, 1, 0)
    engine.proc.kill()
    engine.proc.wait()
    status, _, body = request(proxy.port, "GET", "/lanelock/health")
    health = json.loads(body)
    assert status == 503 and health["engine"]["answers"] is False, body
    assert "refused" in health["engine"]["problem"].lower(), health
    # the proxy's own polls are not the log's business
    request(proxy.port, "GET", "/v1/models")
    proxy.said("GET /v1/models ")
    assert "/lanelock/health" not in proxy.log()


# -- log lines ---------------------------------------------------------------------------------
def test_log_lines_carry_their_time_unless_journald_stamps_them(procs):
    engine = Engine(procs)
    proxy = Proxy(procs, engine.backend)
    (line,) = [line for line in proxy.lines if "proxy listening" in line]
    assert re.match(rf"{STAMP}lanelock: proxy listening on ", line), line
    for journal, stamped in (("ours", False), ("1:2", True)):   # 1:2: a stream not its stderr
        read_end, write_end = os.pipe()
        found = os.fstat(write_end)
        stream = f"{found.st_dev}:{found.st_ino}" if journal == "ours" else journal
        proc = procs.start([*LANELOCK, "proxy", "--listen", "127.0.0.1:0", "-b", engine.backend],
                           stderr=write_end, stdout=subprocess.DEVNULL,
                           env=environ({"JOURNAL_STREAM": stream}))
        os.close(write_end)
        with os.fdopen(read_end, "rb") as pipe:
            line = read_line(pipe)
            assert LISTENING.search(line), line
            assert bool(re.match(rf"{STAMP}lanelock: ", line)) == stamped, (journal, line)
            assert stamped or line.startswith("lanelock: proxy listening"), line
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0


def test_an_engine_that_cuts_its_answer_is_logged_as_the_engines_cut(procs, lanelock):
    engine = Engine(procs, tokens=200, interval=0.02)
    proxy = Proxy(procs, engine.backend, "-v")
    sock = open_stream(proxy.port, headers={"X-Lanelock-Session": "cut"})
    read_until(sock, b"data: ")
    engine.proc.kill()
    engine.proc.wait()
    # the request's own line: the witness may say after it that the engine is gone
    line = [line for line in proxy.said("[cut] POST").splitlines() if "[cut] POST" in line][-1]
    assert "client gone" not in line and "the engine cut the answer" in line, line
    sock.close()


# -- seats and pinning, said ---------------------------------------------------------------------
def test_the_start_line_says_two_seats_and_pinning_and_v_names_seat_and_slot(procs, tmp_path,
                                                                            lanelock):
    engine = Served(procs, tmp_path, "--kind", "llama.cpp", "--parallel", "2")
    assert lanelock("seats", "-b", engine.backend, "2").returncode == 0
    proxy = Proxy(procs, engine.backend, "--pin-slots", "-v")
    (line,) = [line for line in proxy.lines if "proxy listening" in line]
    assert re.search(r"\(lane [^)]+\): 2 seats, each request pinned to its seat's engine slot "
                     r"\(--pin-slots\)$", line.rstrip()), line
    status_of(proxy)   # a status poll: not logged
    status, headers, _ = request(proxy.port, "POST", CHAT, chat_body(),
                                 headers={"X-Lanelock-Session": "one"})
    assert (status, headers["X-Lanelock-Seat"], headers["X-Lanelock-Slot"]) == (200, "1", "0")
    line = proxy.said("[one] POST").splitlines()[-1]
    assert f"[one] POST {CHAT} 200 held on seat 1, slot 0 (waited " in line, line
    assert "/lanelock/status" not in proxy.log()
    settings = status_of(proxy)["proxy"]["settings"]
    assert settings["proxy_pin_slots"] == {"value": True, "source": "flag"}
    plain = Proxy(procs, engine.backend)
    (line,) = [line for line in plain.lines if "proxy listening" in line]
    assert line.rstrip().endswith(": 2 seats, not pinned"), line


# -- sessions ----------------------------------------------------------------------------------
def test_status_sums_three_sessions_last_hour_as_history_does(procs, holder, lanelock):
    engine = Engine(procs, delay=0.05)
    proxy = Proxy(procs, engine.backend)
    for session in ("alpha", "alpha", "beta"):
        status, _, _ = request(proxy.port, "POST", CHAT, chat_body(),
                               headers={"X-Lanelock-Session": session})
        assert status == 200
    held = holder("-b", engine.backend, "-s", "holder")
    status, _, _ = request(proxy.port, "POST", CHAT, chat_body(),
                           headers={"X-Lanelock-Session": "gamma"})
    assert status == 503
    assert held.release() == 0
    # The proxy's -v line comes after the turn's release: wait for the journal to have all five.
    wait_for(lambda: status_of(proxy)["sessions"].get("holder", {}).get("local") == 1,
             what="the holder's release in the journal")
    sessions = status_of(proxy)["sessions"]
    assert set(sessions) == {"alpha", "beta", "gamma", "holder"}, sessions
    assert (sessions["alpha"]["turns"], sessions["alpha"]["local"]) == (2, 2)
    assert sessions["alpha"]["held"] >= 0.1 and sessions["beta"]["turns"] == 1
    assert (sessions["gamma"]["turns"], sessions["gamma"]["busy"],
            sessions["gamma"]["local"]) == (1, 1, 0)
    history = lanelock("history", "-b", engine.backend, "--since", "1h", "--json")
    assert history.returncode == 0, history.stderr
    assert json.loads(history.stdout)["sessions"] == sessions


# -- per-client rules --------------------------------------------------------------------------
def test_a_client_rule_lets_a_client_that_sends_no_header_wait(procs, holder, config_files,
                                                              lanelock):
    engine = Engine(procs)
    _, user = config_files
    user.write_text('[[proxy_clients]]\nsession = "cron-*"\nwait = "30s"\n'
                    'priority = "batch"\n')
    proxy = Proxy(procs, engine.backend)
    held = holder("-b", engine.backend)
    status, headers, _ = request(proxy.port, "POST", CHAT, chat_body(),
                                 headers={"X-Lanelock-Session": "chat-1"})
    assert (status, headers["X-Lanelock-Wait"]) == (503, "0")     # no rule: the proxy's --wait
    client = procs.start([sys.executable, "-c", CLIENT, str(proxy.port),
                          "cron-7"], stdout=subprocess.PIPE)
    from lanelock import Gate

    gate = Gate(engine.backend)
    wait_for(lambda: len(gate.store.survey(gate.lane)[0].queue) == 1, what="cron-7 to queue")
    assert held.release() == 0
    answer = json.loads(read_line(client.stdout))
    assert answer == {"status": 200, "state": "held", "wait": "30", "priority": "batch"}, answer
    settings = status_of(proxy)["proxy"]["settings"]
    assert settings["proxy_clients"]["value"] == [{"session": "cron-*", "wait": 30,
                                                   "priority": "batch"}]


CLIENT = """
import http.client, json, sys
conn = http.client.HTTPConnection("127.0.0.1", int(sys.argv[1]), timeout=60)
conn.request("POST", "/v1/chat/completions", json.dumps({"model": "m", "messages": []}),
             {"Content-Type": "application/json", "X-Lanelock-Session": sys.argv[2]})
answer = conn.getresponse()
answer.read()
print(json.dumps({"status": answer.status, "state": answer.headers["X-Lanelock-State"],
                  "wait": answer.headers["X-Lanelock-Wait"],
                  "priority": answer.headers["X-Lanelock-Priority"]}), flush=True)
"""


def test_a_program_rule_reaches_a_client_by_its_process_name(procs, holder, config_files,
                                                            run_cmd, tmp_path):
    """curl can send a header, but the rule needs none: matched on the client's program."""
    import shutil

    if shutil.which("curl") is None:
        pytest.skip("curl not found")
    engine = Engine(procs)
    _, user = config_files
    user.write_text('[[proxy_clients]]\nprogram = "curl"\nwait = "20s"\n'
                    'priority = "interactive"\n')
    proxy = Proxy(procs, engine.backend)
    held = holder("-b", engine.backend)
    out = tmp_path / "curl.headers"
    client = procs.start(["curl", "-s", "-o", "/dev/null", "-D", str(out), "-H",
                          "Content-Type: application/json", "--data-binary",
                          chat_body().decode(), proxy.url + CHAT])
    from lanelock import Gate

    gate = Gate(engine.backend)
    wait_for(lambda: len(gate.store.survey(gate.lane)[0].queue) == 1, what="curl to queue")
    assert held.release() == 0
    assert client.wait(timeout=30) == 0
    headers = out.read_text().lower()
    assert "x-lanelock-state: held" in headers and "x-lanelock-wait: 20" in headers, headers
    assert "x-lanelock-priority: interactive" in headers, headers


# -- Retry-After ---------------------------------------------------------------------------------
def test_retry_after_never_promises_less_than_the_holders_own_median(procs, holder, lanelock):
    engine = Engine(procs, delay=0.05)
    proxy = Proxy(procs, engine.backend)
    assert request(proxy.port, "POST", CHAT, chat_body())[0] == 200   # the proxy's own: short
    slow = lanelock("run", "-b", engine.backend, "-s", "slow", "--", "sleep", "2.5")
    assert slow.returncode == 0, slow.stderr
    held = holder("-b", engine.backend, "-s", "slow")
    status, headers, _ = request(proxy.port, "POST", CHAT, chat_body())
    assert status == 503 and int(headers["Retry-After"]) >= 2, headers
    assert held.release() == 0


def test_the_estimate_takes_each_holders_own_median():
    from lanelock.estimate import until_lane

    assert until_lane(0.2, 0.0, 0) == 1                    # the lane's typical hold alone
    assert until_lane(0.2, 0.5, 0, medians=(5.0,)) == 5    # the holder's own median, less held
    assert until_lane(0.2, 0.5, 1, medians=(5.0,)) == 5    # then one typical hold per waiter
    assert until_lane(3.0, 0.0, 0, medians=(1.0,)) == 3    # never less than the lane's
    assert until_lane(1.0, 0.0, 0, 2, (0.0,), medians=(9.0, None)) == 1   # a seat frees first


# -- the README's service --------------------------------------------------------------------------
def test_the_readme_config_file_and_unit_run_a_proxy(procs, config_files, run_cmd):
    """The README's config file as the system file (its backend a stand-in's) and its unit's
    ExecStart with nothing else (but a free port: --listen over the file's default): the
    settings come from the file; ExecReload's signal reloads it."""
    import shlex

    from support.doc_blocks import block

    engine = Engine(procs)
    system, _ = config_files
    system.write_text(block("proxy-config").text.replace("127.0.0.1:8080", engine.backend))
    unit = block("proxy-unit").text
    start = shlex.split(re.search(r"^ExecStart=(.*)$", unit, re.M).group(1))
    assert start[0].endswith("/bin/lanelock") and start[1:] == ["proxy"], start
    proxy = Proxy(procs, engine.backend, env={"OPENAI_API_KEY": "sk-test"})
    settings = status_of(proxy)["proxy"]["settings"]
    assert settings["proxy_fallback"] == {"value": ["https://api.openai.com/v1"],
                                          "source": f"system file {system}"}
    assert settings["proxy_verbose"]["value"] is True
    assert [rule.get("program") or rule.get("session")
            for rule in settings["proxy_clients"]["value"]] == ["llm", "cron-*"]
    assert "sk-test" not in json.dumps(settings)
    reload_ = re.search(r"^ExecReload=(.*)$", unit, re.M).group(1)
    argv = shlex.split(reload_.replace("$MAINPID", str(proxy.proc.pid)))
    assert run_cmd(argv).returncode == 0
    proxy.said("nothing changed")
    assert re.search(r"^RestartPreventExitStatus=69$", unit, re.M)
