"""A holder that loses its PostgreSQL lane: `run` and the proxy, on a real server.

Lost for good (the server ended the session itself: pg_terminate_backend, a partition's
keepalives): `run --on-lost stop` stops the command's process group and exits 75; the default
`run` goes on with one warning; the proxy cuts the request (its relay stops, the engine's
connection is closed, the client's answer ends). A restart is an outage, not a loss: the holder --
the proxy too -- takes the lane back, and nobody runs beside it once the server is back.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from support.cli import LANELOCK, TIMEOUT, environ, json_of
from support.processes import line_with, read_line, wait_for
from support.server import Server
from support.netns import namespace, reachable_server  # noqa: F401 - fixtures

pg_server = pytest.importorskip("support.pg_server")
psycopg = pytest.importorskip("psycopg")

# The command of a turn: says "ready", then runs until told; a SIGTERM to its group is noted in
# the file named by $1 (the group was stopped, not the shell alone).
STOPPABLE = ('trap \'echo stopped >> "$1"; exit 0\' TERM; echo ready; '
             'while :; do sleep 0.05; done')


def sql(dsn: str, query: str, *params) -> list:
    with psycopg.connect(dsn, autocommit=True,
                         options=f"-c statement_timeout={int(TIMEOUT * 1000)}") as conn:
        return conn.execute(query, params).fetchall()


def lane_holders(dsn: str) -> list[int]:
    """The server pids holding a lane's advisory lock (lanelock's namespace, two-int key)."""
    from lanelock.store.pg.session import NAMESPACE

    return [row[0] for row in sql(dsn, "SELECT pid FROM pg_locks WHERE locktype = 'advisory' "
                                       "AND granted AND objsubid = 2 AND classid = %s",
                                  NAMESPACE & 0xFFFFFFFF)]


def terminate_holder(dsn: str) -> int:
    pids = lane_holders(dsn)
    assert len(pids) == 1, pids
    sql(dsn, "SELECT pg_terminate_backend(%s)", pids[0])
    return pids[0]


def history(dsn: str, backend: str) -> list[dict]:
    result = subprocess.run([*LANELOCK, "history", "--store", dsn, "-b", backend, "--json"],
                            capture_output=True, text=True, env=environ(), timeout=TIMEOUT)
    data = json.loads(result.stdout)
    if isinstance(data, dict):
        data = next((value for value in data.values() if isinstance(value, list)), [])
    return [event for event in data if isinstance(event, dict)]


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def store(postgres, lock_roots) -> str:
    lock_roots.watch_store(postgres.dsn)
    return postgres.dsn


def test_on_lost_stop_stops_the_commands_group_when_its_session_is_terminated(store, procs,
                                                                             tmp_path):
    backend = "localhost:7041"
    noted = tmp_path / "noted"
    turn = procs.start([*LANELOCK, "run", "--store", store, "-b", backend, "--on-lost", "stop",
                        "--", "sh", "-c", STOPPABLE, "sh", str(noted)],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=environ())
    assert read_line(turn.stdout) == "ready\n"
    group = os.getpgid(int(subprocess.run(["pgrep", "-P", str(turn.pid)], capture_output=True,
                                          text=True).stdout.split()[0]))

    terminate_holder(store)

    assert turn.wait(timeout=TIMEOUT) == 75   # exitcodes.LOST: stopped, not done
    assert noted.read_text() == "stopped\n"   # the command's group had SIGTERM
    assert not group_alive(group)
    err = turn.stderr.read().decode()
    warnings = [line for line in err.splitlines() if line.startswith("lanelock: warning:")]
    assert len(warnings) == 1, err
    assert "lost: the lane store ended this turn's session; stopping the command" in warnings[0]
    lost = [event for event in history(store, backend) if event.get("event") == "lost"]
    assert len(lost) == 1 and lost[0]["ungated"] >= 0, lost


def test_on_lost_stop_kills_a_group_that_ignores_sigterm_after_kill_after(store, procs):
    backend = "localhost:7042"
    turn = procs.start([*LANELOCK, "run", "--store", store, "-b", backend, "--on-lost", "stop",
                        "--kill-after", "0.5", "--", "sh", "-c",
                        "trap '' TERM; echo ready; while :; do sleep 0.05; done"],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=environ())
    assert read_line(turn.stdout) == "ready\n"
    terminate_holder(store)
    assert turn.wait(timeout=TIMEOUT) == 75


def test_the_default_goes_on_after_a_loss_and_status_does_not_name_it_the_holder(store, procs):
    backend = "localhost:7043"
    turn = procs.start([*LANELOCK, "run", "--store", store, "-b", backend, "--", "sh", "-c",
                        "echo ready; read go; exit 4"],
                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       env=environ())
    assert read_line(turn.stdout) == "ready\n"
    terminate_holder(store)
    warning = read_line(turn.stderr)
    assert "the command goes on, no longer gated" in warning, warning
    status = json.loads(subprocess.run(
        [*LANELOCK, "status", "--store", store, "-b", backend, "--json"], capture_output=True,
        text=True, env=environ(), timeout=TIMEOUT).stdout)["lanes"][0]
    assert status["state"] == "free" and status["holder"] is None, status
    turn.stdin.write(b"go\n")
    turn.stdin.close()
    assert turn.wait(timeout=TIMEOUT) == 4   # the command's own status: it was not stopped


# -- the proxy ---------------------------------------------------------------------------------------
# An engine that says on stdout when a request comes ("request") and when its client's connection
# is gone ("gone"). A streamed request gets an event every 0.05 s until the file named by argv[1]
# exists (then [DONE]); any other waits, answering nothing, until its client goes.
ENGINE = r"""
import json, os, select, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

finish = sys.argv[1]

class Engine(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        print("request", flush=True)
        try:
            if body.get("stream"):
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Connection", "close")
                self.end_headers()
                while not os.path.exists(finish):
                    self.wfile.write(b'data: {"object": "chat.completion.chunk"}\n\n')
                    self.wfile.flush()
                    time.sleep(0.05)
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
                print("finished", flush=True)
                return
            while self.connection.recv(1, 0x40 if False else 0) if select.select(
                    [self.connection], [], [], 0.05)[0] else True:
                pass
        except OSError:
            pass
        print("gone", flush=True)

server = ThreadingHTTPServer(("127.0.0.1", 0), Engine)
print(server.server_address[1], flush=True)
server.serve_forever()
"""
LISTENING = r"proxy listening on http://127\.0\.0\.1:(\d+)"


@pytest.fixture
def engine(procs, tmp_path):
    import sys

    finish = tmp_path / "finish"
    proc = procs.start([sys.executable, "-c", ENGINE, str(finish)], stdout=subprocess.PIPE)
    port = int(read_line(proc.stdout))
    return proc, port, finish


def start_proxy(procs, store: str, engine_port: int, *args):
    return Server(procs, [*LANELOCK, "proxy", "--listen", "127.0.0.1:0", "--store", store,
                          "-b", f"127.0.0.1:{engine_port}", *args], LISTENING)


def ask(port: int, stream: bool, headers: dict | None = None):
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
    conn.request("POST", "/v1/chat/completions",
                 json.dumps({"model": "m", "stream": stream,
                             "messages": [{"role": "user", "content": "hi"}]}),
                 {"Content-Type": "application/json", **(headers or {})})
    return conn


def proxy_lines(proxy, words: str) -> list[str]:
    return [line for line in proxy.log().splitlines() if words in line]


def test_the_proxy_cuts_a_streamed_request_whose_lane_is_lost(store, procs, engine):
    import http.client

    proc, port, _ = engine
    proxy = start_proxy(procs, store, port)
    conn = ask(proxy.port, stream=True)
    response = conn.getresponse()
    assert response.status == 200 and response.getheader("X-Lanelock-State") == "held"
    assert response.readline().startswith(b"data: ")
    assert read_line(proc.stdout) == "request\n"

    terminate_holder(store)

    # The answer stops where it was: no [DONE], no last chunk (the client sees it cut).
    deadline = time.monotonic() + TIMEOUT
    with pytest.raises((http.client.IncompleteRead, http.client.HTTPException, OSError)):
        while response.read1(65536):
            if time.monotonic() > deadline:
                pytest.fail("the answer went on: the request was not cut")
    assert read_line(proc.stdout) == "gone\n"   # the engine's connection was closed
    proxy.said("lost mid-request")
    wait_for(lambda: [event for event in history(store, f"127.0.0.1:{port}")
                      if event.get("event") == "lost"], "the lost event")
    assert len(proxy_lines(proxy, "lost mid-request")) == 1, proxy.log()
    assert lane_holders(store) == []


def test_the_proxy_answers_a_request_cut_before_its_answer_with_the_dialects_error(store, procs,
                                                                                  engine):
    proc, port, _ = engine
    proxy = start_proxy(procs, store, port)
    conn = ask(proxy.port, stream=False)
    assert read_line(proc.stdout) == "request\n"   # held, forwarded, the engine thinking

    terminate_holder(store)

    response = conn.getresponse()
    body = json.loads(response.read())
    assert response.status == 503, body
    assert response.getheader("X-Lanelock-Reason") == "lane_lost"
    assert body["error"]["type"] == "lane_lost", body   # OpenAI's error shape
    assert read_line(proc.stdout) == "gone\n"
    assert len(proxy_lines(proxy, "lost mid-request")) == 1, proxy.log()


def silent_past_lease(dsn: str, pid: int) -> None:
    """Once the server's session pid has been silent longer than a lease (or has ended: the
    caller's assertions say so) -- the server's own clock, asked on one connection."""
    from lanelock.store.pg.lease import LEASE

    with psycopg.connect(dsn, autocommit=True) as conn:
        def silent() -> bool:
            row = conn.execute("SELECT state = 'idle' AND clock_timestamp() - state_change > "
                               "%s * interval '1 s' FROM pg_stat_activity WHERE pid = %s",
                               (LEASE + 1, pid)).fetchone()
            return row is None or row[0]

        wait_for(silent, "the session silent past its lease", timeout=LEASE * 3)


@pytest.mark.slow   # it waits out a lease's silence
def test_a_run_stopped_with_its_command_past_its_lease_keeps_its_lane(store, procs):
    """^Z stops `run` with its command, and its watch with it: no renewals, yet the server does
    not end its session for that silence -- a stopped holder keeps its lane, as on flock."""
    turn = procs.start([*LANELOCK, "run", "--store", store, "-b", "localhost:7046", "--",
                        "sh", "-c", "echo ready; read go; exit 6"], stdin=subprocess.PIPE,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=environ())
    assert read_line(turn.stdout) == "ready\n"
    (pid,) = lane_holders(store)
    os.kill(turn.pid, signal.SIGTSTP)
    silent_past_lease(store, pid)
    assert lane_holders(store) == [pid], "the stopped holder's session was ended"
    os.kill(turn.pid, signal.SIGCONT)
    turn.stdin.write(b"go\n")
    turn.stdin.close()
    assert turn.wait(timeout=TIMEOUT) == 6
    assert "lost" not in turn.stderr.read().decode()


def stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as handle:
        return handle.read().rsplit(")", 1)[1].split()[0] == "T"


@pytest.mark.slow   # each stop outlasts a renewal's answer time
def test_a_run_stopped_again_and_again_mid_renewal_keeps_its_lane(store, procs):
    """^Z at any moment of the lease's renewals (every RENEW s, from the watch's thread): a
    renewal under way as the wrapper stops is finished first, and none is sent after the stop's
    rest -- one caught by the stop found its answer's time long past once continued, and took
    the link for lost (seen: 4 of 13 stops, at a random moment each)."""
    from lanelock.store.pg.lease import ANSWER, RENEW

    turn = procs.start([*LANELOCK, "run", "--store", store, "-b", "localhost:7046", "--",
                        "sh", "-c", "echo ready; read go; exit 6"], stdin=subprocess.PIPE,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=environ())
    assert read_line(turn.stdout) == "ready\n"
    (pid,) = lane_holders(store)
    for phase in range(6):   # spread over the renewal's period
        time.sleep(RENEW * phase / 6)
        os.kill(turn.pid, signal.SIGTSTP)
        wait_for(lambda: stopped(turn.pid), "the wrapper stopped")
        time.sleep(ANSWER + 0.5)   # the stop itself: longer than a renewal may take
        os.kill(turn.pid, signal.SIGCONT)
        wait_for(lambda: not stopped(turn.pid), "the wrapper continued")
    assert lane_holders(store) == [pid]
    turn.stdin.write(b"go\n")
    turn.stdin.close()
    assert turn.wait(timeout=TIMEOUT) == 6
    assert "lost" not in turn.stderr.read().decode()


@pytest.mark.slow   # it waits out a lease's silence
def test_a_turn_lingering_past_its_lease_keeps_its_lane(store, procs, engine):
    """Between a session's requests its turn lingers with no watch to renew its lease: the
    server does not end its session for that silence, and the session's next request, past the
    lease, is served on the lane it kept."""
    _, port, finish = engine
    finish.write_text("")   # each streamed answer ends at once
    proxy = start_proxy(procs, store, port, "--linger", "60")
    session = {"X-Lanelock-Session": "agent-1"}
    first = ask(proxy.port, stream=True, headers=session).getresponse()
    assert first.getheader("X-Lanelock-State") == "held" and b"[DONE]" in first.read()
    (pid,) = lane_holders(store)
    silent_past_lease(store, pid)
    assert lane_holders(store) == [pid], "the lingering turn's session was ended"
    second = ask(proxy.port, stream=True, headers=session).getresponse()
    assert second.getheader("X-Lanelock-State") == "held" and b"[DONE]" in second.read()
    assert lane_holders(store) == [pid], "the lingering turn's session was ended"
    assert not proxy_lines(proxy, "lost"), proxy.log()


STAMP = 's=$(date +%s%N); echo "$s" > "$1"'


@pytest.mark.slow   # the default tier's time: the slow tier (CI) runs it
def test_a_restart_mid_request_the_proxy_takes_its_lane_back(private_postgres, procs, engine,
                                                            tmp_path):
    proc, port, finish = engine
    dsn = private_postgres.dsn
    proxy = start_proxy(procs, dsn, port)
    conn = ask(proxy.port, stream=True)
    response = conn.getresponse()
    assert response.readline().startswith(b"data: ")
    started = tmp_path / "started"
    waiter = procs.start([*LANELOCK, "run", "--store", dsn, "-b", f"127.0.0.1:{port}", "--wait",
                          "60", "--", "sh", "-c", STAMP, "sh", str(started)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=environ())
    wait_for(lambda: lane_waiters(dsn) == 1, "the waiter queued")

    private_postgres.restart()

    proxy.said("taken back after")
    wait_for(lambda: lane_waiters(dsn) == 1, "the waiter waiting again", TIMEOUT * 2)
    assert not started.exists(), "a turn ran beside the proxy's request after the restart"
    finish.touch()
    text = b""
    while True:
        chunk = response.read(65536)
        if not chunk:
            break
        text += chunk
    ended = time.time_ns()
    assert text.rstrip().endswith(b"data: [DONE]")   # the request went on to its end
    assert waiter.wait(timeout=TIMEOUT * 2) == 0, waiter.stderr.read()
    assert int(started.read_text()) >= ended - 50_000_000   # after the request (clock slack)
    assert proxy_lines(proxy, "lost mid-request") == [] and \
        len(proxy_lines(proxy, "taken back after")) == 1, proxy.log()
    regained = [event for event in history(dsn, f"127.0.0.1:{port}")
                if event.get("event") == "regained"]
    assert len(regained) == 1, regained


@pytest.mark.slow   # the default tier's time: the slow tier (CI) runs it
def test_a_restart_never_stops_an_on_lost_stop_turn(private_postgres, procs):
    dsn = private_postgres.dsn
    turn = procs.start([*LANELOCK, "run", "--store", dsn, "-b", "localhost:7046", "--on-lost",
                        "stop", "--", "sh", "-c", "echo ready; read go; exit 5"],
                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       env=environ())
    assert read_line(turn.stdout) == "ready\n"

    private_postgres.restart()

    lines = [read_line(turn.stderr)]
    while "taken back after" not in lines[-1]:
        lines.append(read_line(turn.stderr))
    assert not [line for line in lines if "stopping the command" in line], lines
    assert len(lane_holders(dsn)) == 1   # held again
    turn.stdin.write(b"go\n")
    turn.stdin.close()
    assert turn.wait(timeout=TIMEOUT) == 5   # the command's own end, not 75


def lane_waiters(dsn: str) -> int:
    from lanelock.store.pg.queue import QUEUE_NAMESPACE

    return sql(dsn, "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted AND "
                    "mode = 'ExclusiveLock' AND classid = %s", QUEUE_NAMESPACE)[0][0]


# -- a partition ---------------------------------------------------------------------------------
# The holding client of the partition test: one streamed request; "first" once its first event is
# in, then "whole" or "cut ERROR" when the answer ends.
CLIENT = r"""
import http.client, json, sys

conn = http.client.HTTPConnection("127.0.0.1", int(sys.argv[1]), timeout=120)
conn.request("POST", "/v1/chat/completions",
             json.dumps({"model": "m", "stream": True, "messages": []}),
             {"Content-Type": "application/json"})
response = conn.getresponse()
print("first", response.status, response.getheader("X-Lanelock-State"), flush=True)
response.readline()
try:
    while response.read(65536):
        pass
    print("whole", flush=True)
except Exception as error:
    print("cut", type(error).__name__, flush=True)
"""


@pytest.mark.slow
def test_a_partition_cuts_the_proxys_request_stops_an_on_lost_stop_turn_and_the_default_goes_on(
        namespace, reachable_server, procs, tmp_path):
    """The holders' host is cut off from the server (its link down: no FIN, no RST): each one's
    lease renewal goes unanswered, and a lane not taken back within its lease is lost for good
    (5 s after its last renewal), not an outage to wait out; the server frees it for the other
    hosts."""
    import sys

    store = f"postgresql://postgres@{namespace.host_ip}:{reachable_server.port}/postgres"
    here = ["ip", "netns", "exec", namespace.name]
    finish = tmp_path / "finish"
    engine = procs.start([*here, sys.executable, "-c", ENGINE, str(finish)],
                         stdout=subprocess.PIPE)
    engine_port = int(read_line(engine.stdout))
    proxy = Server(procs, [*here, *LANELOCK, "proxy", "--listen", "127.0.0.1:0", "--store",
                           store, "-b", f"127.0.0.1:{engine_port}"], LISTENING)
    client = procs.start([*here, sys.executable, "-c", CLIENT, str(proxy.port)],
                         stdout=subprocess.PIPE)
    assert read_line(client.stdout).split() == ["first", "200", "held"]
    noted = tmp_path / "noted"
    stopping = procs.start([*here, *LANELOCK, "run", "--store", store, "-b", "localhost:7044",
                            "--on-lost", "stop", "--", "sh", "-c", STOPPABLE, "sh", str(noted)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=environ())
    going_on = procs.start([*here, *LANELOCK, "run", "--store", store, "-b", "localhost:7045",
                            "--", "sh", "-c", "echo ready; read go; exit 4"],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           env=environ())
    assert read_line(stopping.stdout) == "ready\n" and read_line(going_on.stdout) == "ready\n"
    assert len(lane_holders(reachable_server.dsn)) == 3

    namespace.cut()
    cut_at = time.monotonic()

    assert read_line(client.stdout, TIMEOUT).split()[0] == "cut"   # no [DONE]: the answer cut
    assert stopping.wait(timeout=TIMEOUT) == 75
    assert noted.read_text() == "stopped\n"
    warning = line_with(going_on.stderr, " lost:")   # after trying to take it back
    took = time.monotonic() - cut_at
    assert "lost: the lane store cannot be reached from here" in warning and \
        "the command goes on, no longer gated" in warning, warning
    said = stopping.stderr.read().decode()
    assert said.count("lost: the lane store cannot be reached from here") == 1 and \
        "stopping the command (--on-lost stop)" in said, said
    proxy.said("lost mid-request")
    assert len(proxy_lines(proxy, "lost mid-request")) == 1, proxy.log()
    wait_for(lambda: lane_holders(reachable_server.dsn) == [], "the server to let the lanes go")
    print(f"lost {took:.1f} s after the cut")

    # The link back: the default turn's command ends with its own status, its loss journaled.
    subprocess.run(["ip", "link", "set", namespace.outer, "up"], check=True, timeout=TIMEOUT)
    going_on.stdin.write(b"go\n")
    going_on.stdin.close()
    assert going_on.wait(timeout=TIMEOUT) == 4
    lost = [event for event in history(reachable_server.dsn, "localhost:7045")
            if event.get("event") == "lost"]
    assert len(lost) == 1 and lost[0]["ungated"] > 0, lost


def test_the_shells_complete_on_lost_and_its_values():
    """The completion scripts (completions/*) ask the CLI at TAB time: the option and its two
    values come from it, for each shell."""
    from lanelock import completion
    from lanelock.cli import cli

    for shell in ("bash", "zsh", "fish"):
        rows = [row.split("\t") for row in
                completion.answer(shell, "lanelock run --on-l", None, group=cli).splitlines()]
        assert [row[1] for row in rows] == ["--on-lost"], (shell, rows)
        rows = [row.split("\t") for row in
                completion.answer(shell, "lanelock run --on-lost ", None, group=cli).splitlines()]
        assert [row[1] for row in rows] == ["continue", "stop"], (shell, rows)


def test_a_turn_that_waited_on_every_seat_hears_no_other_seat_once_it_holds(postgres, lock_roots,
                                                                           lanelock, holder):
    """The head of a lane of two seats listens on both seats' channels while it waits; holding
    one, it listens on none (said with its record, not in a round trip of its own): another
    seat's release does not wake its watch, which watches the session's socket for its end (a
    wake is a statement: `SELECT 1`). Its statements in the server's log (log_statement=all for
    its session alone) show it: its renewal after the other seat's release, and no look."""
    lock_roots.watch_store(postgres.dsn)
    lane = "localhost:7047"
    done = lanelock("seats", "--store", postgres.dsn, "-b", lane, "2")
    assert done.returncode == 0, done.stderr
    first = holder("--store", postgres.dsn, "-b", lane)
    second = holder("--store", postgres.dsn, "-b", lane)
    logged = postgres.dsn + "?options=-c%20log_statement%3Dall"
    waiter = holder("--store", logged, "-b", lane, "--wait", "1d", ready=False)

    def queued() -> int:
        (found,) = json_of(["status", "--json", "--store", postgres.dsn, "-b", lane])["lanes"]
        return len(found["queue"])

    wait_for(lambda: queued() == 1, "the waiter queued")
    assert second.release() == 0
    waiter.wait_ready()
    (backend,) = [row[0] for row in sql(postgres.dsn, "SELECT backend_pid FROM lanelock_holders "
                                        "WHERE (record->>'pid')::int = %s", waiter.proc.pid)]
    mark = len(open(postgres.log_path).read())
    assert first.release() == 0   # the other seat's release notifies its channel

    def since_mark() -> list[str]:
        return [line for line in open(postgres.log_path).read()[mark:].splitlines()
                if f"[{backend}]" in line]

    wait_for(lambda: any("jsonb_build_object('lease'" in line for line in since_mark()),
             "the waiter's next renewal after the other seat's release")
    assert not [line for line in since_mark() if "SELECT 1" in line]
    assert waiter.release() == 0
