"""A request that names no session is named after its client process: the name found once per
connection (a keep-alive client's later requests reuse it), right among many processes, never
another connection's, and a `lanelock run` job's requests still part of its turn. Real processes:
agents are Python processes of their own, the idle crowd is real sleep processes."""

from __future__ import annotations

import json
import os
import pwd
import socket
import subprocess
import sys

import pytest

from support.cli import TIMEOUT
from support.engine import Engine
from support.other_users import two_users  # noqa: F401 - a fixture
from support.processes import read_line
from support.proxy import Proxy, chat_body, history, lock_path

pytest.importorskip("aiohttp")

# An agent: `requests` requests on each of `connections` keep-alive connections (http.client
# reuses one connection while the answers are read whole); prints its pid and each answer's
# status and X-Lanelock-State.
AGENT = r"""
import http.client, json, os, sys
port, body, connections, requests = int(sys.argv[1]), sys.argv[2].encode(), int(sys.argv[3]), int(sys.argv[4])
answers = []
for _ in range(connections):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    for _ in range(requests):
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        answer = conn.getresponse()
        answer.read()
        answers.append([answer.status, answer.getheader("X-Lanelock-State")])
    conn.close()
print(json.dumps([os.getpid(), answers]))
"""


def agent(port, connections=1, requests=3, prefix=(), env=None) -> tuple[int, list]:
    done = subprocess.run([*prefix, sys.executable, "-c", AGENT, str(port),
                           chat_body().decode(), str(connections), str(requests)],
                          capture_output=True, text=True, timeout=TIMEOUT,
                          env={**os.environ, **(env or {})})
    assert done.returncode == 0, done.stderr
    pid, answers = json.loads(done.stdout.strip().splitlines()[-1])
    return pid, answers


def sessions_of(lanelock, backend) -> list:
    return [event.get("session") for event in history(lanelock, backend)
            if event.get("event") == "acquired" and event.get("via") == "proxy"]


def test_keep_alive_clients_are_each_named_after_their_own_process(procs, lanelock):
    """Two agents, each with two keep-alive connections of three requests: every request is
    its own process's user@NAME/PID -- the second request on a connection (its name kept) and
    the first on a new one alike, and never the other agent's."""
    engine = Engine(procs, delay=0.001)
    proxy = Proxy(procs, engine.backend, "--no-witness")
    first, answers = agent(proxy.port, connections=2)
    assert answers == [[200, "held"]] * 6
    second, answers = agent(proxy.port, connections=2)
    assert answers == [[200, "held"]] * 6
    sessions = sessions_of(lanelock, engine.backend)
    assert len(sessions) == 12, sessions
    for pid, named in ((first, sessions[:6]), (second, sessions[6:])):
        assert all(session and "@" in session and session.endswith(f"/{pid}")
                   for session in named), (pid, named)
    assert proxy.stop() == 0


def test_a_client_is_found_among_many_processes(procs, lanelock):
    """With 300 more idle processes of the client's user, an agent the proxy never saw is still
    named after its own process (the pass over /proc), and so is the one after it."""
    crowd = [procs.start(["sleep", "3600"], stdin=subprocess.DEVNULL) for _ in range(300)]
    engine = Engine(procs, delay=0.001)
    proxy = Proxy(procs, engine.backend, "--no-witness")
    pids = [agent(proxy.port, requests=2)[0] for _ in range(2)]
    sessions = sessions_of(lanelock, engine.backend)
    assert len(sessions) == 4, sessions
    for pid, named in zip(pids, (sessions[:2], sessions[2:])):
        assert all(session and session.endswith(f"/{pid}") for session in named), (pid, named)
    for sleeper in crowd:
        sleeper.kill()
    assert proxy.stop() == 0


def test_a_run_jobs_keep_alive_requests_are_part_of_its_turn(procs, lanelock):
    """A `lanelock run` job whose client keeps one connection for three requests: each is part
    of the job's turn (held, never refused by its own lane), the engine sees one at a time, and
    the journal has the job's turn alone."""
    engine = Engine(procs, delay=0.001)
    proxy = Proxy(procs, engine.backend, "--no-witness")
    done = lanelock("run", "-b", engine.backend, "-s", "nightly", "--", sys.executable, "-c",
                    AGENT, str(proxy.port), chat_body().decode(), "1", "3")
    assert done.returncode == 0, done.stderr
    _, answers = json.loads(done.stdout.strip().splitlines()[-1])
    assert answers == [[200, "held"]] * 3
    assert engine.stats()["max_in_flight"] == 1 and engine.stats()["total"] == 3
    turns = [event for event in history(lanelock, engine.backend) if event["event"] == "acquired"]
    assert [(event.get("via"), event.get("session")) for event in turns] == [(None, "nightly")]
    assert proxy.stop() == 0


def test_the_names_kept_per_connection_are_bounded_and_never_outlive_their_connection():
    """The per-connection names hold at most their size (the least recently used go first),
    and a connection that is gone is never answered for, even if another takes its place."""
    from lanelock.proc import start_ticks
    from lanelock.proxy.client_process import Names

    class Transport:   # what the names key on: a connection's transport, held weakly
        pass

    me = (os.getpid(), start_ticks(os.getpid()), "me")
    names = Names(size=2)
    first, second, third = Transport(), Transport(), Transport()
    for transport in (first, second, third):
        names.put(transport, me)
    assert len(names) == 2
    assert names.get(first) is None and names.get(third) == me
    del second   # the connection closed: its transport goes
    assert names.get(Transport()) is None
    names.put(first, (os.getpid(), -1, "me"))   # a process with this pid but another start
    assert names.get(first) is None


def test_a_turn_forwarded_before_its_client_was_named_is_recorded_under_that_name(
        procs, lanelock, lock_dir):
    """On a free lane of one seat the request goes to the engine before its client is looked
    up; the turn's holder record and its journal (acquired, then released) still carry the
    client process's name, never the address it was taken under."""
    engine = Engine(procs, delay=0.001)
    proxy = Proxy(procs, engine.backend, "--no-witness")
    pid, answers = agent(proxy.port, requests=1)
    assert answers == [[200, "held"]]
    record = json.loads(lock_path(lock_dir, engine).with_suffix(".json").read_text())
    assert record["session"].endswith(f"/{pid}") and "@" in record["session"], record
    assert "released_at" in record
    events = [event for event in history(lanelock, engine.backend)
              if event.get("event") in ("acquired", "released")]
    assert [event["event"] for event in events] == ["acquired", "released"], events
    assert {event["session"] for event in events} == {record["session"]}
    assert events[0]["turn"] == events[1]["turn"] == record["turn"]
    assert proxy.stop() == 0


def test_a_clients_socket_is_looked_for_among_its_own_users_processes_only(procs, two_users,
                                                                           monkeypatch):
    """Who holds a client's socket (the turn's askers on a lane with a seat held, a client's
    name) is looked for among the processes of the socket's user: another user's processes
    are skipped without their descriptors being read, however many there are."""
    from lanelock.proxy import socket_owner

    mallory, _ = two_users
    crowd = [procs.start(["setpriv", f"--reuid={mallory}", "--regid=nogroup", "--clear-groups",
                          "sh", "-c", "echo ready; exec sleep 3600"], stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE) for _ in range(8)]
    for sleeper in crowd:   # each runs as mallory once it says so
        assert read_line(sleeper.stdout).strip() == "ready"
    uid = pwd.getpwnam(mallory).pw_uid
    assert all(os.stat(f"/proc/{sleeper.pid}").st_uid == uid for sleeper in crowd)
    read = []
    holds = socket_owner._holds
    monkeypatch.setattr(socket_owner, "_holds",
                        lambda pid, *args: read.append(pid) or holds(pid, *args))
    with socket.create_server(("127.0.0.1", 0)) as server, \
            socket.create_connection(server.getsockname(), timeout=TIMEOUT) as client:
        accepted, peer = server.accept()
        with accepted:
            found = socket_owner.owners(peer, accepted.getsockname())
    assert found == [os.getpid()]
    assert read and not {sleeper.pid for sleeper in crowd} & set(read)
    for sleeper in crowd:
        sleeper.kill()
