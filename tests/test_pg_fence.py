"""A fence per turn on the PostgreSQL store, and the overlap of a lost turn said on both sides.

The fence is the lane row's generation (as etcd's revision): one more each time a turn takes the
lane, counted by the server in the statement that writes the turn's row. Every turn carries it --
its record, `status`, the journal, LANELOCK_FENCE in `run`'s command, X-Lanelock-Fence on the
proxy's answer and on the request it forwards -- so a check at the engine or a tool can refuse a
request carrying a smaller fence than one it has seen: a stale holder's late request.

A holder whose session the server ends (pg_terminate_backend here; a partition's keepalives do the
same) loses the lane and, by default, its command goes on. At its end it journals how long it ran
ungated ('lost'); the turn that takes the lane next journals whom it took it from ('took-over':
turn, fence); `history` puts the two together as the overlap. A restart's ungated seconds
('regained') and a loss's feed one counter, lanelock_ungated_seconds_total.

Real PostgreSQL 15 (support/pg_server.py), real `lanelock run` turns and a real proxy; each test
has a database of its own on the session's server, so its fences start at 1.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import secrets
import subprocess
import sys

import pytest

from support.cli import LANELOCK, TIMEOUT, environ
from support.processes import line_with, read_line
from support.server import Server
from support.netns import namespace, reachable_server  # noqa: F401 - fixtures

pg_server = pytest.importorskip("support.pg_server")
psycopg = pytest.importorskip("psycopg")

BACKEND = "localhost:7051"
PYTHON = sys.executable
# The holder's command: says "ready" once it runs, and ends when told (a line on its stdin).
HOLD = 'echo ready; read go'
# The tables as lanelock made them before fences (no generation column).
OLD_SCHEMA = """
CREATE TABLE lanelock_holders (
    key2 integer PRIMARY KEY, lane text NOT NULL, record jsonb NOT NULL,
    backend_pid integer NOT NULL, updated_at timestamptz NOT NULL DEFAULT now());
CREATE TABLE lanelock_events (
    id bigserial PRIMARY KEY, lane text NOT NULL, ts double precision NOT NULL, event jsonb NOT NULL);
CREATE INDEX lanelock_events_lane_ts ON lanelock_events (lane, ts);
CREATE TABLE lanelock_counts (lane text PRIMARY KEY, counts jsonb NOT NULL);
CREATE TABLE lanelock_queue (
    ticket bigserial PRIMARY KEY, lane text NOT NULL, rank integer NOT NULL,
    arrival timestamptz NOT NULL DEFAULT clock_timestamp(), facts jsonb NOT NULL);
CREATE INDEX lanelock_queue_lane ON lanelock_queue (lane);
"""
# An engine that writes down the headers of each request it is sent (one JSON line on stdout)
# and answers like an OpenAI server.
RECORDER = r"""
import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *args):
        pass
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        print(json.dumps({k.lower(): v for k, v in self.headers.items()}), flush=True)
        data = json.dumps({"id": "x", "object": "chat.completion", "choices": []}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
print(server.server_address[1], flush=True)
server.serve_forever()
"""
LISTENING = r"proxy listening on http://127\.0\.0\.1:(\d+) for (\S+) \(lane ([^)]+)\)"


def sql(dsn: str, query: str, *params):
    with psycopg.connect(dsn, autocommit=True,
                         options=f"-c statement_timeout={int(TIMEOUT * 1000)}") as conn:
        cursor = conn.execute(query, params)
        return cursor.fetchall() if cursor.description else None


def database_on(server_dsn: str, lock_roots, old_schema: bool = False) -> str:
    """A database of this test's own on the server (dropped after the teardown check); with the
    tables of a lanelock before fences, when old_schema."""
    name = f"fence_{secrets.token_hex(4)}"
    sql(server_dsn, f"CREATE DATABASE {name}")
    lock_roots.after(lambda: sql(server_dsn, f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
    dsn = lock_roots.watch_store(f"{server_dsn.rsplit('/', 1)[0]}/{name}")
    if old_schema:
        sql(dsn, OLD_SCHEMA)
    return dsn


@pytest.fixture
def database(postgres, lock_roots) -> str:
    return database_on(postgres.dsn, lock_roots)


def run(dsn: str, *args, **popen) -> subprocess.CompletedProcess:
    return subprocess.run([*LANELOCK, *args[:1], "--store", dsn, "-b", BACKEND, *args[1:]],
                          capture_output=True, text=True, env=environ(), timeout=TIMEOUT, **popen)


def held(procs, dsn: str, *args):
    """A `lanelock run` holding the lane until a line on its stdin; its stderr on a pipe."""
    proc = procs.start([*LANELOCK, "run", "--store", dsn, "-b", BACKEND, *args, "--", "sh", "-c",
                        HOLD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, env=environ())
    assert read_line(proc.stdout) == "ready\n"
    return proc


def end(proc) -> tuple[int, str]:
    proc.stdin.write(b"go\n")
    proc.stdin.close()
    status = proc.wait(timeout=TIMEOUT * 2)
    return status, proc.stderr.read().decode()


def lane_status(dsn: str) -> dict:
    done = run(dsn, "status", "--json")
    return json.loads(done.stdout)["lanes"][0]


def history(dsn: str) -> dict:
    done = run(dsn, "history", "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def fence_of_a_turn(dsn: str) -> int:
    done = run(dsn, "run", "--wait", "30", "--", "sh", "-c", 'echo "$LANELOCK_FENCE"')
    assert done.returncode == 0 and "lanelock:" not in done.stderr, done
    return int(done.stdout)


def backend_of(dsn: str, pid: int) -> int:
    """The server pid of the session holding the lane for `lanelock run` pid (its record says)."""
    return lane_status(dsn)["holder"]["backend_pid"]


# -- the fence ------------------------------------------------------------------------------
def test_turns_in_sequence_have_fences_n_and_n_plus_1_everywhere(database, procs):
    dsn = database
    assert [fence_of_a_turn(dsn), fence_of_a_turn(dsn)] == [1, 2]   # LANELOCK_FENCE
    holder = held(procs, dsn)
    lane = lane_status(dsn)
    assert lane["holder"]["fence"] == 3, lane                        # status --json
    assert "fence 3" in run(dsn, "status").stdout                    # status
    row = sql(dsn, "SELECT generation, record->'fence' FROM lanelock_holders")
    assert row == [(3, 3)]                                           # the record and the row
    assert end(holder)[0] == 0
    acquired = [event.get("fence") for event in history(dsn)["events"]
                if event["event"] == "acquired"]
    assert acquired == [1, 2, 3]                                     # the journal

    # The proxy: on the answer and on the request the engine gets, with its seat; a client's
    # own of either is not forwarded. Each request is a turn of its own on the engine's lane (its own row): 1, then 2.
    engine = procs.start([PYTHON, "-c", RECORDER], stdout=subprocess.PIPE)
    port = int(read_line(engine.stdout))
    proxy = Server(procs, [*LANELOCK, "proxy", "--listen", "127.0.0.1:0", "--store", dsn, "-b",
                           f"127.0.0.1:{port}"], LISTENING)
    for expected in (1, 2):
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=TIMEOUT)
        conn.request("POST", "/v1/chat/completions", json.dumps({"model": "m", "messages": []}),
                     {"Content-Type": "application/json", "X-Lanelock-Fence": "999",
                      "X-Lanelock-Seat": "7"})
        answer = conn.getresponse()
        answer.read()
        conn.close()
        assert answer.status == 200
        assert answer.headers["X-Lanelock-State"] == "held"
        assert answer.headers["X-Lanelock-Fence"] == str(expected)
        forwarded = json.loads(read_line(engine.stdout))
        assert forwarded["x-lanelock-fence"] == str(expected), forwarded
        assert forwarded["x-lanelock-seat"] == "1", forwarded   # the fence's seat, not the client's
    proxy.stop()


@pytest.mark.parametrize("old_schema", [False, True], ids=["fresh-database", "previous-schema"])
def test_turns_at_once_on_a_fresh_or_an_old_database_get_distinct_growing_fences(
        postgres, lock_roots, procs, old_schema):
    """The first turns on a database set up (or upgrade) its tables at once: none fails, none
    warns, and their fences are 1..N in the order they held the lane."""
    dsn = database_on(postgres.dsn, lock_roots, old_schema)
    if old_schema:   # a turn of the earlier lanelock's, released: its row has no fence
        sql(dsn, "INSERT INTO lanelock_holders (key2, lane, record, backend_pid) "
                 "VALUES (1, 'old', '{\"released_at\": \"x\"}', 0)")
    count = 6
    script = 'echo "$LANELOCK_FENCE $(date +%s%N)"'
    turns = [procs.start([*LANELOCK, "run", "--store", dsn, "-b", BACKEND, "--wait", "60", "--",
                          "sh", "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=environ()) for _ in range(count)]
    results = [(turn.wait(timeout=TIMEOUT * 2), turn.stdout.read().decode(),
                turn.stderr.read().decode()) for turn in turns]
    assert [status for status, _, _ in results] == [0] * count, results
    assert not [err for _, _, err in results if err], results
    stamped = sorted((int(out.split()[1]), int(out.split()[0])) for _, out, _ in results)
    assert [fence for _, fence in stamped] == list(range(1, count + 1)), stamped
    assert sql(dsn, "SELECT count(*) FROM pg_attribute WHERE attrelid = "
                    "'lanelock_holders'::regclass AND attname = 'generation'") == [(1,)]


def test_a_role_that_may_not_alter_old_tables_writes_its_record_without_a_fence(
        postgres, lock_roots):
    """Tables of an earlier lanelock, owned by another role: a turn of a role that may only
    read and write them runs, writes its record without a fence, warns of nothing, and leaves no
    ERROR line in the server's log (no ALTER tried, no upsert of a missing column)."""
    dsn = database_on(postgres.dsn, lock_roots, old_schema=True)
    role = f"fence_user_{secrets.token_hex(3)}"
    sql(dsn, f"CREATE ROLE {role} LOGIN")
    lock_roots.after(lambda: sql(postgres.dsn, f"DROP ROLE IF EXISTS {role}"))
    sql(dsn, f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {role}; "
             f"GRANT USAGE ON ALL SEQUENCES IN SCHEMA public TO {role}")
    lock_roots.after(lambda: sql(dsn, f"DROP OWNED BY {role}"))
    as_role = dsn.replace("postgresql://postgres@", f"postgresql://{role}@")
    log_before = os.path.getsize(postgres.log_path)
    for _ in range(2):
        done = run(as_role, "run", "--", "sh", "-c", 'echo "[$LANELOCK_FENCE]"')
        assert done.returncode == 0 and done.stdout == "[]\n" and done.stderr == "", done
    records = sql(dsn, "SELECT record FROM lanelock_holders WHERE lane <> 'old'")
    assert len(records) == 1 and "fence" not in records[0][0] and records[0][0]["released_at"]
    with open(postgres.log_path, errors="replace") as log:
        log.seek(log_before)
        assert pg_server.lanelock_errors(log.read()) == []


# -- the overlap of a lost turn -------------------------------------------------------------
def test_a_terminated_holder_and_its_taker_both_journal_the_overlap(database, procs):
    dsn = database
    first = held(procs, dsn)
    lost_fence = lane_status(dsn)["holder"]["fence"]
    sql(dsn, "SELECT pg_terminate_backend(%s)", backend_of(dsn, first.pid))
    said = read_line(first.stderr)
    assert " lost" in said and "goes on" in said, said

    # Another turn takes the lane while the first one's command goes on, once the lost turn's
    # lease has run out (the server cannot tell its loss from a cut link).
    second = held(procs, dsn, "--wait", "60")
    lane = lane_status(dsn)
    assert lane["holder"]["fence"] == lost_fence + 1, lane
    assert lane["holder"]["took_over"]["fence"] == lost_fence, lane
    assert f"(fence {lost_fence}), which never released" in run(dsn, "status").stdout
    taker = [e for e in history(dsn)["events"] if e["event"] == "took-over"]
    assert len(taker) == 1 and taker[0]["from"]["fence"] == lost_fence, taker
    assert taker[0]["overlap"] is None and taker[0]["overlap_open"] == "still running"
    assert "overlap still running" in run(dsn, "history").stdout

    status, stderr = end(first)   # the lost turn ends: it journals its ungated seconds
    assert status == 0 and "not journaled" not in stderr, stderr
    assert end(second)[0] == 0

    data = history(dsn)
    events = data["events"]
    lost = [e for e in events if e["event"] == "lost"]
    taker = [e for e in events if e["event"] == "took-over"]
    assert len(lost) == 1 and len(taker) == 1, events
    lost, taker = lost[0], taker[0]
    assert lost["how"] == "ended" and lost["fence"] == lost_fence
    assert taker["from"]["turn"] == lost["turn"]
    assert 0 < lost["ungated"] < TIMEOUT * 2
    assert lost["ts"] - lost["lost_ts"] == pytest.approx(lost["ungated"], abs=0.01)
    assert taker["overlap"] == pytest.approx(lost["ts"] - taker["ts"], abs=0.01)
    assert 0 < taker["overlap"] <= lost["ungated"]
    summary = data["summary"]
    assert summary["overlaps"] == 1 and summary["overlaps_open"] == 0
    assert summary["overlap_seconds"] == pytest.approx(taker["overlap"], abs=0.01)
    plain = run(dsn, "history").stdout
    assert f"overlap {taker['overlap']:.1f}s" in plain, plain
    assert "the lane store ended this turn's session" in plain, plain
    assert re.search(r"1 overlap \(\d+\.\ds\)", plain), plain


@pytest.mark.slow
def test_a_partitioned_holder_and_the_turn_that_takes_its_lane_journal_the_overlap(
        namespace, reachable_server, procs):
    """The holder's host is cut off (its link down: no FIN, no RST); its lease is not renewed, the
    server ends its session, and a turn of another host takes the lane once the lease has run
    out, while the holder's command goes on.
    The link back, the command ends: both journals say it, and history gives the overlap."""
    dsn = reachable_server.dsn
    here = ["ip", "netns", "exec", namespace.name]
    cut_off = f"postgresql://postgres@{namespace.host_ip}:{reachable_server.port}/postgres"
    holder = procs.start([*here, *LANELOCK, "run", "--store", cut_off, "-b", BACKEND, "--",
                          "sh", "-c", HOLD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=environ())
    assert read_line(holder.stdout) == "ready\n"
    fence = lane_status(dsn)["holder"]["fence"]

    namespace.cut()
    said = line_with(holder.stderr, " lost:")   # its lease given up on, after trying
    assert "goes on" in said, said
    taker = held(procs, dsn, "--wait", "30")   # another host's turn, beside the cut-off command
    lane = lane_status(dsn)
    assert lane["holder"]["fence"] == fence + 1 and lane["holder"]["took_over"]["fence"] == fence

    subprocess.run(["ip", "link", "set", namespace.outer, "up"], check=True, timeout=TIMEOUT)
    status, stderr = end(holder)
    assert status == 0 and "not journaled" not in stderr, stderr
    assert end(taker)[0] == 0
    events = history(dsn)["events"]
    lost = [e for e in events if e["event"] == "lost"]
    taker = [e for e in events if e["event"] == "took-over"]
    assert len(lost) == 1 and len(taker) == 1, events
    assert lost[0]["fence"] == fence and taker[0]["from"]["fence"] == fence
    assert taker[0]["from"]["turn"] == lost[0]["turn"]
    assert 0 < taker[0]["overlap"] < lost[0]["ungated"], (taker, lost)
    assert f"overlap {taker[0]['overlap']:.1f}s" in run(dsn, "history").stdout
    print(f"lost after the cut; ran {lost[0]['ungated']:.1f} s ungated, "
          f"{taker[0]['overlap']:.1f} s of it beside the next turn")


# -- the ungated metric ----------------------------------------------------------------------
def ungated_metric(dsn: str) -> float:
    done = run(dsn, "metrics")
    assert done.returncode == 0, done.stderr
    found = re.findall(r"^lanelock_ungated_seconds_total\{lane=\"[^\"]+\"\} (\S+)$", done.stdout,
                       re.MULTILINE)
    assert len(found) == 1, done.stdout
    return float(found[0])


def test_the_ungated_metric_counts_a_loss(database, procs):
    pytest.importorskip("prometheus_client")
    dsn = database
    assert fence_of_a_turn(dsn) == 1
    assert ungated_metric(dsn) == 0.0
    first = held(procs, dsn)
    sql(dsn, "SELECT pg_terminate_backend(%s)", backend_of(dsn, first.pid))
    assert " lost" in read_line(first.stderr)
    assert fence_of_a_turn(dsn) == 3   # a turn beside the lost one's command
    assert end(first)[0] == 0
    lost = [e for e in history(dsn)["events"] if e["event"] == "lost"][0]
    assert ungated_metric(dsn) == pytest.approx(lost["ungated"], abs=0.002)


@pytest.mark.slow
def test_the_ungated_metric_counts_a_restart_and_then_a_loss(procs, private_postgres):
    """A restart of the server mid-turn: the holder takes its lane back and its ungated seconds
    ('regained') count; a later loss adds its own."""
    pytest.importorskip("prometheus_client")
    server = private_postgres
    dsn = server.dsn
    first = held(procs, dsn)
    server.restart()
    lines = []
    while not lines or "taken back after" not in lines[-1]:
        lines.append(read_line(first.stderr))
    assert end(first)[0] == 0
    regained = [e for e in history(dsn)["events"] if e["event"] == "regained"]
    assert len(regained) == 1, regained
    after_restart = ungated_metric(dsn)
    assert after_restart == pytest.approx(regained[0]["ungated"], abs=0.002) and after_restart > 0

    second = held(procs, dsn)
    sql(dsn, "SELECT pg_terminate_backend(%s)", backend_of(dsn, second.pid))
    assert " lost" in read_line(second.stderr)
    assert end(second)[0] == 0
    lost = [e for e in history(dsn)["events"] if e["event"] == "lost"][0]
    assert ungated_metric(dsn) == pytest.approx(after_restart + lost["ungated"], abs=0.002)
    assert "UNGATED" in run(dsn, "history").stdout


# -- a lost turn that ends while the server does not answer ---------------------------------
def stopped_server(procs, private_postgres):
    """A server of this test's own, a turn holding a lane on it, and the server then stopped
    under the turn (a fast shutdown): (server, dsn, the holder, told its session ended)."""
    import os
    import signal

    server = private_postgres
    dsn = server.dsn
    holder = held(procs, dsn)
    os.kill(server.postmaster_pid(), signal.SIGINT)
    server.proc.wait(timeout=TIMEOUT)
    said = read_line(holder.stderr)
    assert " lost" in said and "taking the lane back" in said, said
    return server, dsn, holder


@pytest.mark.slow
def test_a_lost_turn_ending_while_the_server_is_down_journals_once_it_answers(procs,
                                                                              private_postgres):
    """The turn ends while the server is down: its release asks again, and the server started
    meanwhile gets the 'lost' event and the ungated seconds."""
    server, dsn, holder = stopped_server(procs, private_postgres)
    holder.stdin.write(b"go\n")
    holder.stdin.close()
    server._launch()   # the same data and port, while the release asks
    assert holder.wait(timeout=TIMEOUT) == 0
    stderr = holder.stderr.read().decode()
    assert "not journaled" not in stderr, stderr
    lost = [e for e in history(dsn)["events"] if e["event"] == "lost"]
    assert len(lost) == 1 and lost[0]["how"] == "not-taken-back" and lost[0]["ungated"] > 0, lost
    pytest.importorskip("prometheus_client")
    assert ungated_metric(dsn) == pytest.approx(lost[0]["ungated"], abs=0.002)


@pytest.mark.slow
def test_a_lost_turn_ending_while_the_server_stays_down_exits_within_the_bound(
        procs, private_postgres):
    """The server never comes back: the exit waits at most LOST_JOURNAL_WITHIN (plus a connect
    timeout), then says in one line what was not journaled."""
    import time

    from lanelock.gate import LOST_JOURNAL_WITHIN
    from lanelock.store.pg.session import CONNECT_TIMEOUT

    server, _, holder = stopped_server(procs, private_postgres)
    began = time.monotonic()
    holder.stdin.write(b"go\n")
    holder.stdin.close()
    assert holder.wait(timeout=TIMEOUT) == 0
    took = time.monotonic() - began
    assert took < LOST_JOURNAL_WITHIN + CONNECT_TIMEOUT + 1.0, took
    stderr = holder.stderr.read().decode()
    assert "were not journaled: the lane store does not answer" in stderr, stderr
    server._launch()   # for the teardown's look: nobody holds a lane there


@pytest.mark.slow
def test_a_turn_taken_back_after_a_restart_and_then_lost_counts_both(procs, private_postgres):
    """One turn: the server restarts under it (taken back), then ends its session (lost for
    good). The counter has both intervals; the 'lost' event the second one only."""
    pytest.importorskip("prometheus_client")
    server = private_postgres
    dsn = server.dsn
    holder = held(procs, dsn)
    server.restart()
    while "taken back after" not in read_line(holder.stderr):
        pass
    sql(dsn, "SELECT pg_terminate_backend(%s)", backend_of(dsn, holder.pid))
    while " lost: the lane store ended this turn's session" not in read_line(holder.stderr):
        pass
    assert end(holder)[0] == 0
    events = history(dsn)["events"]
    regained = [e for e in events if e["event"] == "regained"]
    lost = [e for e in events if e["event"] == "lost"]
    assert len(regained) == 1 and len(lost) == 1, events
    assert ungated_metric(dsn) == pytest.approx(regained[0]["ungated"] + lost[0]["ungated"],
                                                abs=0.005)
