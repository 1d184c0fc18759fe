"""The load of the priority chaos run (test_priority_chaos.py tells what it proves and how): the
contention-counting stand-in, the turn loops of every kind of client, the killer, and the
observers and records of the flock and PostgreSQL stores. Its scripts run as processes of their
own; the test reads what they wrote down."""

from __future__ import annotations

import json
import os
import random
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path


from support.cli import LANELOCK, TIMEOUT, json_of
from support.kernel_locks import flock_entries
from support.processes import read_line
from lanelock import Gate
from lanelock.store.flock import journal
from lanelock.store.pg.session import CLIENT_CHECK_MS
from support.pg_server import lanelock_errors
from support.proxy import CHAT, Proxy, chat_body, request

CLASSES = ("batch", "normal", "interactive")        # rank = index, as in lanelock/store/flock/queue.py
AGING = 1.0                  # seconds per aging step (LANELOCK_PRIORITY_AGING)
GENERATION = 0.03            # seconds the stand-in takes per answer
THINK = 1.2                  # a loop thinks uniform(0, THINK) seconds between its turns
TARGET = 1000                # completed turns, then the load stops
LOAD_LIMIT = 130.0           # ... or after this long, whichever comes first
KILL_EVERY = (0.2, 0.8)      # seconds between kills
SLACK = 1.5                  # seconds of slack on the batch bound (a loaded 2-core VM)
STALL = 5.0                  # no gap between two grants may be this long (holds are ~0.05 s)
GONE_WITHIN = 1.0            # a killed waiter's entry no longer counts this long after its death
HANGUP_SEEN_WITHIN = 1.0     # the engine notices a killed client's hang-up within this long
SENTINEL = "zz-sentinel"     # not an entry name (store/flock/queue.py's Entry.parse skips it)
# A killed waiter's server session, blocked in a lock wait, sees its client gone only at the
# server's client_connection_check_interval (store/pg/session.py): on PostgreSQL its ticket lock
# -- and so its queue entry -- outlives it by up to that long.
PG_GONE_WITHIN = CLIENT_CHECK_MS / 1000 + GONE_WITHIN / 2
FAILED_OPEN = ("gate unavailable", "deadlock detected")   # never on a PostgreSQL turn's stderr
NOT_OWNED = "you don't own a lock"   # the server's word for an unlock of a lock not held

# The stand-in, writing down on stdout every change of its in-flight count as it makes it (under
# one lock, so the lines are in the order of the changes), with the request's session; a line
# "mark" on GET /chaos-mark, after every earlier line. It runs ahead of the load (nice -10): a
# hang-up is noticed as soon as the kernel closes the dead client's connection.
ENGINE = r"""
import fcntl, os, sys, threading, time
from lanelock.testing.standin import make_server
try:
    os.nice(-10)
except OSError:
    pass
server = make_server(0, float(sys.argv[1]), "stand-in")
counter, lock, local = server.counter, threading.Lock(), threading.local()

def written(name, call):
    def change():
        with lock:
            call()
            sys.stdout.write(f"{name} {time.monotonic():.6f} {threading.get_ident()} "
                             f"{counter.in_flight} {getattr(local, 'session', '-')}\n")
            sys.stdout.flush()
    return change

counter.enter, counter.leave = written("enter", counter.enter), written("leave", counter.leave)
counter.hung_up = written("hangup", counter.hung_up)

# A proxy's generation looks at the token as its request comes in (the proxy itself cannot).
token = os.open(sys.argv[2], os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)

class Handler(server.RequestHandlerClass):
    def do_POST(self):
        local.session = self.headers.get("X-Lanelock-Session", "-")
        if local.session.startswith("proxy"):
            try:   # shared: a look that never gets in the way of another look
                fcntl.flock(token, fcntl.LOCK_SH | fcntl.LOCK_NB)
                fcntl.flock(token, fcntl.LOCK_UN)
            except BlockingIOError:
                with lock:
                    sys.stdout.write(f"overlap {local.session}\n")
                    sys.stdout.flush()
        return super().do_POST()

    def do_GET(self):
        if self.path == "/chaos-mark":
            with lock:
                sys.stdout.write("mark\n")
                sys.stdout.flush()
        return super().do_GET()

server.RequestHandlerClass = Handler
print(server.server_address[1], flush=True)
server.serve_forever()
"""

# How a worker or client reports: each line in ONE write. print() writes its words one by one
# where stdout is unbuffered (PYTHONUNBUFFERED, set on the CI machine), and the killer's kill -9
# between two of them left a line "done" with no session -- a turn counted as one that ended wrong.
SAY = """
import os

def say(*words):
    os.write(1, (" ".join(map(str, words)) + "\\n").encode())
"""

# What the Python workers share: one generation at the engine, once the token is found free -- no
# `lanelock run` turn's command (which holds it for as long as it lives) still running.
GENERATE = SAY + """
import fcntl, os, urllib.request
BODY = b'{"messages": [{"role": "user", "content": "hi"}]}'

def holders(token):
    # The processes that have the token open, but this one: pid:state:command.
    found, target = [], os.readlink(f"/proc/self/fd/{token}")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == os.getpid():
            continue
        try:
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") == target
                   for fd in os.listdir(f"/proc/{pid}/fd")):
                state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
                command = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\\0")[0].decode()
                if "python" not in os.path.basename(command):   # not a worker, not the engine
                    found.append(f"{pid}:{state}:{os.path.basename(command)}")
        except OSError:
            pass
    return found


def generate(url, session, token):
    try:   # shared: the engine's look at a proxy request's start must not collide with this one
        fcntl.flock(token, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(token, fcntl.LOCK_UN)
    except BlockingIOError:
        say("overlap", session, *holders(token))
        return
    request = urllib.request.Request(url + "/v1/chat/completions", data=BODY, headers={
        "Content-Type": "application/json", "X-Lanelock-Session": session})
    with urllib.request.urlopen(request, timeout=60) as answer:
        answer.read()
"""

# Takes turns with the Python API until its stdin closes: one stream of one class.
API_WORKER = GENERATE + """
import random, select, sys
from lanelock import Gate
backend, url, klass, prefix, think, seed, token_path = sys.argv[1:8]
token = os.open(token_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
gate, rng = Gate(backend), random.Random(int(seed))
n = 0
while not select.select([0], [], [], rng.uniform(0, float(think)))[0]:
    session = f"{prefix}-{n}"
    n += 1
    with gate.turn(session=session, wait=None, priority=klass) as turn:
        if not turn.held:
            say("bad", session, turn.state)
            continue
        generate(url, session, token)
    say("done", session)
"""

# One asyncio task per class, each a stream of turns, until stdin closes.
ASYNC_WORKER = GENERATE + """
import asyncio, random, sys
from lanelock import Gate
backend, url, prefix, think, seed, token_path = sys.argv[1:7]

async def stream(gate, klass, stop, rng, token):
    n = 0
    while True:
        try:
            await asyncio.wait_for(stop.wait(), rng.uniform(0, float(think)))
            return
        except asyncio.TimeoutError:
            pass
        session = f"{prefix}-{klass}-{n}"
        n += 1
        async with gate.turn(session=session, wait=None, priority=klass) as turn:
            if not turn.held:
                say("bad", session, turn.state)
                continue
            await asyncio.to_thread(generate, url, session, token)
        say("done", session)

async def main():
    loop, stop = asyncio.get_running_loop(), asyncio.Event()
    loop.add_reader(0, lambda: (loop.remove_reader(0), stop.set()))
    gate = Gate(backend)
    tokens = {klass: os.open(token_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
              for klass in ("batch", "normal", "interactive")}   # one description per task
    await asyncio.gather(*(stream(gate, klass, stop, random.Random(f"{seed}{klass}"),
                                  tokens[klass]) for klass in tokens))

asyncio.run(main())
"""

# A client of `lanelock proxy`: one request at a time with X-Lanelock-Priority, until stdin
# closes. A proxy being restarted refuses connections for a moment: retried. A request whose
# proxy died under it is "lost" (its turn was killed).
PROXY_CLIENT = SAY + """
import http.client, random, select, sys, time
port, klass, prefix, think, seed, path, body = sys.argv[1:8]
rng = random.Random(int(seed))
n = 0
while not select.select([0], [], [], rng.uniform(0, float(think)))[0]:
    session = f"{prefix}-{n}"
    n += 1
    conn = http.client.HTTPConnection("127.0.0.1", int(port), timeout=300)
    try:
        conn.request("POST", path, body.encode(), {
            "Content-Type": "application/json", "X-Lanelock-Session": session,
            "X-Lanelock-Priority": klass})
        response = conn.getresponse()
        data = response.read()
    except ConnectionRefusedError:
        time.sleep(0.05)
        continue
    except (ConnectionError, http.client.HTTPException) as error:
        say("lost", session, type(error).__name__)
        continue
    finally:
        conn.close()
    state = response.getheader("X-Lanelock-State")
    if response.status == 200 and state == "held":
        say("done", session)
    else:
        say("bad", session, response.status, state, data[:200])
"""

# The held command of a `lanelock run` turn: take the token on descriptor 9 (exit 99, naming who
# has it open, if another turn's command still holds it), then become curl, which keeps
# descriptor 9 -- and the token -- for as long as it lives.
RUN_GENERATE = r"""
exec 9>>"$0"
if ! flock -n 9; then
    holders=""
    for fd in /proc/[0-9]*/fd/*; do    # who has it open, but the Python workers and engine
        [ "$fd" -ef "$0" ] || continue
        pid=$(echo "$fd" | cut -d/ -f3)
        command=$(cat "/proc/$pid/comm" 2>/dev/null)
        case "$pid:$command" in "$$:"*|*:python*) ;; *) holders="$holders $pid:$command" ;; esac
    done
    # Only a Python worker or the engine in the way: a look (a shared lock for a moment), waited
    # out. Another command holding it is an overlap.
    if [ -n "$holders" ] || ! flock -w 1 9; then
        echo "overlap $1 $holders" >&2
        exit 99
    fi
fi
shift
exec "$@"
"""

# Writes down every entry that appears in the queue directory (inotify IN_MOVED_TO: an entry
# appears by rename, already locked), when it saw it, and the session its file names, read at once
# (a waiter that leaves within microseconds may be gone first: then null). Ends at the sentinel.
OBSERVER = r"""
import ctypes, json, os, struct, sys, time
try:
    os.nice(-10)     # see each entry before its waiter can leave (root only; else as is)
except OSError:
    pass
queue_dir = sys.argv[1]
libc = ctypes.CDLL(None, use_errno=True)
IN_MOVED_TO, IN_Q_OVERFLOW = 0x80, 0x4000
fd = libc.inotify_init1(os.O_CLOEXEC)
if fd < 0 or libc.inotify_add_watch(fd, queue_dir.encode(), IN_MOVED_TO) < 0:
    sys.exit(f"inotify: {os.strerror(ctypes.get_errno())}")
dir_fd = os.open(queue_dir, os.O_RDONLY | os.O_DIRECTORY)
print("watching", flush=True)
while True:
    data, offset = os.read(fd, 1 << 16), 0
    seen = time.monotonic()
    while offset < len(data):
        _, mask, _, length = struct.unpack_from("iIII", data, offset)
        name = data[offset + 16:offset + 16 + length].rstrip(b"\0").decode()
        offset += 16 + length
        if mask & IN_Q_OVERFLOW:
            print(json.dumps({"overflow": True}), flush=True)
            continue
        if name == "zz-sentinel":
            sys.exit(0)
        session = None
        try:
            entry = os.open(name, os.O_RDONLY | os.O_NONBLOCK, dir_fd=dir_fd)
            try:
                session = json.loads(os.read(entry, 4096)).get("session")
            finally:
                os.close(entry)
        except (OSError, ValueError):
            pass
        print(json.dumps({"name": name, "session": session, "seen": seen}), flush=True)
"""

# PostgreSQL's observer: LISTENs on the channel the arrivals trigger notifies (a ticket a row) and
# writes down when each notification came -- after the joining transaction committed, so the
# entry was visible by then. Ends at the sentinel.
PG_OBSERVER = r"""
import json, os, sys, time
import psycopg
try:
    os.nice(-10)
except OSError:
    pass
dsn, channel = sys.argv[1:3]
conn = psycopg.connect(dsn, autocommit=True)
conn.execute(f'LISTEN "{channel}"')
print("watching", flush=True)
for note in conn.notifies():
    seen = time.monotonic()
    if note.payload == "zz-sentinel":
        break
    print(json.dumps({"ticket": int(note.payload), "seen": seen}), flush=True)
conn.close()
"""


class ChaosEngine:
    """The stand-in (ENGINE) in its own process; its stdout lines are collected by a thread."""

    def __init__(self, procs, token: Path):
        self.proc = procs.start([sys.executable, "-c", ENGINE, GENERATION, token],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        line = read_line(self.proc.stdout)
        assert line.strip().isdigit(), f"the stand-in did not start: {line!r}"
        self.port = int(line)
        self.backend = f"127.0.0.1:{self.port}"
        self.url = f"http://{self.backend}"
        self.lines: list[list[str]] = []
        self.overlaps: list[str] = []
        self.marked = threading.Event()
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for raw in iter(self.proc.stdout.readline, b""):
            words = raw.decode().split()
            if words == ["mark"]:
                self.marked.set()
            elif words[:1] == ["overlap"]:
                self.overlaps.append(f"proxy {words[1]} (seen by the engine)")
            else:
                self.lines.append(words)

    def stats(self) -> dict:
        return json.loads(request(self.port, "GET", "/stats")[2])

    def log(self) -> list[list[str]]:
        """Every change of the in-flight count so far, in order."""
        request(self.port, "GET", "/chaos-mark")
        assert self.marked.wait(TIMEOUT), "the engine's log never reached its mark"
        return list(self.lines)


# -- the lane's store: what the run reads of it ---------------------------------------------------
class Observer:
    """An observer process (OBSERVER, PG_OBSERVER): "watching" once it watches, then a JSON line
    per queue entry it sees, collected by a thread until it ends."""

    def __init__(self, procs, argv):
        self.proc = procs.start(argv, stdout=subprocess.PIPE)
        assert read_line(self.proc.stdout).strip() == "watching"
        self.lines: list[dict] = []
        self.drain = threading.Thread(target=lambda: self.lines.extend(
            json.loads(line) for line in iter(self.proc.stdout.readline, b"")))
        self.drain.start()

    def ended(self) -> list[dict]:
        assert self.proc.wait(TIMEOUT) == 0
        self.drain.join(TIMEOUT)
        return self.lines


class FlockRecords:
    """The flock store's records: the lane's lock file (the kernel's word on who holds it) and the
    holder record beside it, the queue directory watched with inotify (OBSERVER), the journal
    file."""

    name = "flock"
    gone_within = GONE_WITHIN

    def __init__(self, procs, backend: str):
        self.gate = Gate(backend)
        where = json_of(["where", "-b", backend, "--json"])
        self.lock, self.journal_path = Path(where["lock_path"]), Path(where["journal_path"])
        # The lane's files and its queue directory, made as a first waiter would
        # (store/flock/queue.py), so the observer watches it from the first entry on.
        with Gate(backend).turn(session="setup"):
            pass
        self.queue_dir = self.lock.with_suffix(".queue")
        self.queue_dir.mkdir(mode=0o1777, exist_ok=True)
        os.chmod(self.queue_dir, 0o1777)
        self.observer = Observer(procs, [sys.executable, "-c", OBSERVER, self.queue_dir])

    def holder(self) -> tuple[int, str | None] | None:
        """(pid, session) of the lane's holder, as the killer finds it; None when it is free."""
        holders = flock_entries(self.lock)[0]
        if not holders:
            return None
        try:
            session = json.loads(self.lock.with_suffix(".json").read_text()).get("session")
        except (OSError, ValueError, AttributeError):
            session = None
        return holders[0], session

    def queue(self) -> list[dict]:
        """The live queue entries, asked of the store as `status` asks it."""
        return self.gate.store.survey(self.gate.lane)[0].queue

    def blocked(self) -> str:
        """Who waits on whom: the kernel's view, each waiter blocked in flock() on the lane or on
        a queue entry, and whose that is."""
        names = {}
        for path in [self.lock, *self.queue_dir.iterdir()]:
            try:
                st = path.stat()
            except OSError:
                continue
            names[f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"] = \
                "the lane" if path == self.lock else f"entry {path.name}"
        holding, waiting = {}, []
        with open("/proc/locks") as handle:
            for line in handle:
                words = line.split()
                blocked = words[1] == "->"
                pid, inode = words[-4], words[-3]
                if inode in names:
                    if blocked:
                        waiting.append(f"pid {pid} waits on {names[inode]}")
                    else:
                        holding[inode] = pid
        queue = [(entry["pid"], entry["session"], entry["effective_class"])
                 for entry in self.queue()]
        return (f"lane held by "
                f"{[pid for inode, pid in holding.items() if names[inode] == 'the lane']}; "
                f"queue {queue}; {waiting}; entries held: "
                f"{ {names[inode]: pid for inode, pid in holding.items()} }")

    def arrivals(self, tmp: Path) -> tuple[list[dict], list]:
        """Once the load has stopped: (every entry the observer saw, as {arrival, rank, pid,
        session, seen}; what it says it missed: an inotify overflow)."""
        (tmp / SENTINEL).write_text("")
        os.rename(tmp / SENTINEL, self.queue_dir / SENTINEL)   # the observer ends on it
        lines = self.observer.ended()
        os.unlink(self.queue_dir / SENTINEL)
        entries = []
        for line in lines:
            if "name" in line:
                arrival, rank, pid, _ = line["name"].split(".")
                entries.append({"arrival": int(arrival) / 1e9, "rank": int(rank), "pid": int(pid),
                                "session": line["session"], "seen": line["seen"]})
        return entries, [line for line in lines if line.get("overflow")]

    def journal(self) -> tuple[list[dict], int]:
        """(events in the order they were appended, torn lines)."""
        return journal.read(str(self.journal_path))

    def problems(self, texts: list[str], events: list[dict]) -> dict:
        return {}

    def report(self) -> list[str]:
        return []


class PgRecords:
    """The PostgreSQL store's records: the holder row of the session that holds the lane's
    advisory lock, the queue and the events read through the store, the exact arrivals from a
    trigger of the test's own on lanelock_queue (a table, and a notification to PG_OBSERVER), and
    the server's log. Everything the test adds to the server -- shared by the whole test session
    -- is dropped at teardown (after every process of the run is dead), with the lane's rows."""

    name = "postgresql"
    gone_within = PG_GONE_WITHIN

    def __init__(self, procs, backend: str, server, after, tmp: Path):
        import psycopg
        from psycopg import sql

        self.gate, self.server = Gate(backend), server
        self.log_start = os.path.getsize(server.log_path)
        self.kept = tmp / "server.log"   # the run's part of the server's log, for a failure
        # The store's tables, made as a first turn makes them; and the setup turn's journal lines.
        with Gate(backend).turn(session="setup"):
            pass
        self.channel = f"lanelock_chaos_{os.getpid()}_{backend.rsplit(':', 1)[1]}"
        self.sql = {"table": sql.Identifier(f"{self.channel}_arrivals"),
                    "function": sql.Identifier(f"{self.channel}_log"),
                    "trigger": sql.Identifier(f"{self.channel}_trigger"),
                    "channel": sql.Literal(self.channel), "lane": sql.Literal(self.gate.lane.name)}
        self.admin = psycopg.connect(server.dsn, autocommit=True)
        self.look, self.guard = None, threading.Lock()
        after(self.close)
        self._execute("CREATE TABLE {table} (ticket bigint, rank integer, arrival timestamptz, "
                      "facts jsonb)")
        self._execute("""CREATE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                INSERT INTO {table} VALUES (NEW.ticket, NEW.rank, NEW.arrival, NEW.facts);
                PERFORM pg_notify({channel}, NEW.ticket::text);   -- delivered after the commit
                RETURN NULL;
            END $$""")
        self._execute("CREATE TRIGGER {trigger} AFTER INSERT ON lanelock_queue FOR EACH ROW "
                      "WHEN (NEW.lane = {lane}) EXECUTE FUNCTION {function}()")
        # The arrivals are the server's clock_timestamp(), the wall clock of this machine (the
        # server runs here); the journal's "monotonic" is this machine's CLOCK_MONOTONIC. One
        # offset between the two, measured once, here, converts the one into the other.
        self.offset = wall_minus_monotonic()
        self.observer = Observer(procs, [sys.executable, "-c", PG_OBSERVER, server.dsn,
                                         self.channel])
        # One session for the killer's and the stall watcher's looks (a connection each would
        # cost more than the look), read as `status` reads the lane.
        self.look = self.gate.store.open(self.gate.lane)

    def _execute(self, statement: str, params=()):
        from psycopg import sql

        return self.admin.execute(sql.SQL(statement).format(**self.sql), params)

    def survey(self):
        with self.guard:
            return self.gate.store.survey(self.gate.lane, self.look)[0]

    def holder(self) -> tuple[int, str | None] | None:
        """(pid, session) of the lane's holder: its holder row, once that row is the record of
        the session holding the lock; None when free (or the new holder has not written it)."""
        facts = self.survey()
        if not (facts.held and facts.matches and facts.record):
            return None
        return facts.record.get("pid"), facts.record.get("session")

    def queue(self) -> list[dict]:
        return self.survey().queue

    def blocked(self) -> str:
        """Who waits on whom: the server's view (each session in a lock wait, and the sessions
        it waits for), with the lane's holder and queue."""
        facts = self.survey()
        with self.guard:
            waits = self.look.conn.execute(
                "SELECT pid, pg_blocking_pids(pid), application_name, left(query, 60) "
                "FROM pg_stat_activity WHERE wait_event_type = 'Lock'").fetchall()
        record = facts.record or {}
        queue = [(entry["pid"], entry["session"], entry["effective_class"])
                 for entry in facts.queue]
        return (f"lane held by server pids {[holder['pid'] for holder in facts.holders]} "
                f"(holder row: pid {record.get('pid')}, session {record.get('session')}, of the "
                f"holding session: {facts.matches}); queue {queue}; sessions in a lock wait "
                f"(pid, waiting for, who, statement): {waits}")

    def arrivals(self, tmp: Path) -> tuple[list[dict], list]:
        """Once the load has stopped: (every row the trigger copied, as {arrival -- in
        CLOCK_MONOTONIC seconds --, rank, pid, session, seen}; the rows the observer was never
        told of)."""
        self._execute("SELECT pg_notify({channel}, %s)", (SENTINEL,))   # the observer ends on it
        seen = {line["ticket"]: line["seen"] for line in self.observer.ended()}
        rows = self._execute("SELECT ticket, rank, extract(epoch FROM arrival)::float8, facts "
                             "FROM {table} ORDER BY ticket").fetchall()
        entries = [{"arrival": arrival - self.offset, "rank": rank, "pid": facts.get("pid"),
                    "session": facts.get("session"), "seen": seen[ticket]}
                   for ticket, rank, arrival, facts in rows if ticket in seen]
        # Beside the server's log, which names tickets (its advisory keys): whose they were.
        (self.kept.parent / "tickets.json").write_text(json.dumps(
            {ticket: dict(facts, rank=rank, arrival=arrival - self.offset, seen=seen.get(ticket))
             for ticket, rank, arrival, facts in rows}, indent=0))
        return entries, [f"ticket {ticket} never notified" for ticket, *_ in rows
                         if ticket not in seen]

    def journal(self) -> tuple[list[dict], int]:
        """(events in the order they were written -- each by a holder, while it held -- , rows
        that are not an event)."""
        return self.gate.store.events(self.gate.lane, None)

    def server_log(self) -> list[str]:
        """What the server logged since the run began (support/pg_server.py keeps its stderr)."""
        with open(self.server.log_path, "rb") as log:
            log.seek(self.log_start)
            text = log.read().decode(errors="replace")
        self.kept.write_text(text)
        return text.splitlines()

    def problems(self, texts: list[str], events: list[dict]) -> dict:
        said = [line.strip() for text in texts for line in text.splitlines()
                if any(words in line for words in FAILED_OPEN)]
        failed = [f"{event.get('session')} (pid {event.get('pid')}): {event.get('reason')}"
                  for event in events if event.get("event") == "fail-open"]
        return {
            "turns that failed open, or said 'gate unavailable' or 'deadlock detected'":
                failed + said,
            f"the server logged {NOT_OWNED!r} (its log: {self.kept})": [
                line for line in self.server_log() if NOT_OWNED in line],
            # no wait of lanelock's is a statement that times out or is cancelled (queue.py)
            f"ERROR lines of lanelock's sessions in the server's log (its log: {self.kept})":
                lanelock_errors("\n".join(self.server_log())),
        }

    def report(self) -> list[str]:
        """The server's log in kinds (its WARNING, ERROR and FATAL messages, counted)."""
        kinds: dict[str, int] = {}
        for line in self.server_log():
            for level in ("WARNING:", "ERROR:", "FATAL:"):
                if level in line:
                    said = line[line.index(level):]
                    said = said if "lock timeout" in said else said[:70]
                    kinds[said] = kinds.get(said, 0) + 1
        shown = sorted(kinds.items(), key=lambda kind: -kind[1])
        return [f"  the server logged: {shown if shown else 'no warning, error or fatal'}; "
                f"clock offset (wall - monotonic) moved {self.drift() * 1000:+.3f} ms over the run"]

    def drift(self) -> float:
        return wall_minus_monotonic() - self.offset

    def close(self) -> None:
        try:
            if self.look is not None:
                self.look.close()
            self.admin.execute("SET lock_timeout = '10s'")
            self._execute("DROP TRIGGER IF EXISTS {trigger} ON lanelock_queue")
            self._execute("DROP FUNCTION IF EXISTS {function}()")
            self._execute("DROP TABLE IF EXISTS {table}")
            for table in ("lanelock_queue", "lanelock_events", "lanelock_holders",
                          "lanelock_counts"):
                self.admin.execute(f"DELETE FROM {table} WHERE lane = %s", (self.gate.lane.name,))
        finally:
            self.admin.close()


def wall_minus_monotonic() -> float:
    """time.time() - time.monotonic(), from the closest of a few pairs of readings."""
    closest = None
    for _ in range(20):
        before, wall, after = time.monotonic(), time.time(), time.monotonic()
        if closest is None or after - before < closest[0]:
            closest = (after - before, wall - (before + after) / 2)
    return closest[1]


def effective(rank: int, arrival: float, now: float) -> int:
    """The class a waiter counts as at `now` (store/flock/queue.py's rule, in seconds)."""
    return min(len(CLASSES) - 1, rank + max(0, int((now - arrival) // AGING)))


class Worker:
    """One long-lived load process (API, asyncio, proxy client) under a supervisor thread that
    restarts it when killed. Its stdout lines ("done SESSION", "lost ...", anything else is a
    problem) are read by that thread; closing its stdin asks it to finish its turn and end."""

    def __init__(self, load: "Load", kind: str, name: str, argv_of):
        self.load, self.kind, self.name, self.argv_of = load, kind, name, argv_of
        self.generation = 0
        self.proc: subprocess.Popen | None = None
        self.thread = threading.Thread(target=self._supervise, name=name)

    @property
    def prefix(self) -> str:
        return f"{self.name}-g{self.generation}"

    def _supervise(self) -> None:
        while not self.load.stop.is_set():
            with open(self.load.tmp / f"{self.prefix}.stderr", "wb") as stderr:
                self.proc = self.load.procs.start(self.argv_of(self.prefix, self.generation),
                                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                  stderr=stderr)
            self.load.register(self.proc.pid, self)
            if self.load.stop.is_set():
                self.proc.stdin.close()
            for line in iter(self.proc.stdout.readline, b""):
                self.load.report(self.kind, line.decode().split())
            status = self.proc.wait(TIMEOUT)
            self.load.unregister(self.proc.pid)
            self.generation += 1
            if status != -signal.SIGKILL:
                if status != 0:
                    self.load.problems.append(f"{self.name} exited {status}")
                return

    def finish(self) -> None:
        proc = self.proc
        if proc is not None and proc.stdin and not proc.stdin.closed:
            try:
                proc.stdin.close()
            except OSError:
                pass


class ProxyHost:
    """One `lanelock proxy --wait` on a fixed port, restarted on that port when killed; close()
    ends it with SIGTERM (its exit status must then be 0)."""

    def __init__(self, load: "Load", index: int):
        self.load, self.index = load, index
        self.port: int | None = None
        self.proxy: Proxy | None = None
        self.starts = 0
        self.closing = False
        self.statuses: list[int] = []
        self.lock = threading.Lock()
        self.up = threading.Event()
        self.thread = threading.Thread(target=self._supervise, name=f"proxy{index}")

    def _start(self) -> Proxy:
        listen = () if self.port is None else ("--listen", f"127.0.0.1:{self.port}")
        proxy = Proxy(self.load.procs, self.load.engine.backend, "--wait", "120", "--priority",
                      "normal", "--max-priority", "interactive", *listen)
        self.port, self.starts = proxy.port, self.starts + 1
        return proxy

    def _supervise(self) -> None:
        while True:
            with self.lock:
                if self.closing:
                    return
            proxy = self._start()
            with self.lock:
                self.proxy = proxy
                self.load.register(proxy.proc.pid, self)
                if self.closing:
                    proxy.proc.send_signal(signal.SIGTERM)
            self.up.set()
            while True:   # Server.wait() gives up after TIMEOUT; a proxy may serve for longer
                try:
                    status = proxy.wait()
                    break
                except subprocess.TimeoutExpired:
                    continue
            self.load.unregister(proxy.proc.pid)
            self.load.proxy_logs.append(proxy.log())
            if status != -signal.SIGKILL:
                self.statuses.append(status)
                return

    def close(self) -> None:
        with self.lock:
            self.closing = True
            if self.proxy is not None:
                self.proxy.proc.send_signal(signal.SIGTERM)   # a no-op once it is reaped
        self.thread.join(TIMEOUT)
        assert not self.thread.is_alive(), f"proxy {self.index} did not stop"


class Load:
    """The whole load: its processes, what they report, the killer."""

    def __init__(self, procs, tmp: Path, engine: ChaosEngine, records, token: Path):
        self.procs, self.tmp, self.engine, self.token = procs, tmp, engine, token
        self.records = records                       # the lane's store: FlockRecords, PgRecords
        self.stop = threading.Event()
        self.finished = threading.Event()
        self.guard = threading.Lock()
        self.owners: dict[int, object] = {}          # live pid -> its Worker / ProxyHost / "run"
        self.done: list[str] = []                    # sessions of completed turns
        self.lost: list[str] = []                    # turns whose process was killed under them
        self.overlaps: list[str] = []                # a generating client found the token held
        self.problems: list[str] = []
        self.proxy_logs: list[str] = []
        self.run_stderr: list[str] = []
        self.kills: dict[str, int] = {"holder": 0, "waiter": 0, "proxy": 0, "client": 0}
        self.kill_log: list[tuple[float, int, str]] = []   # (sent, pid, client's session prefix)
        self.gone_after: list[tuple[float, int]] = []   # (seconds, looks) a killed process
        #                                                 still counted as queued after its death

    # -- bookkeeping --------------------------------------------------------------------------
    def register(self, pid: int, owner) -> None:
        with self.guard:
            self.owners[pid] = owner

    def unregister(self, pid: int) -> None:
        with self.guard:
            self.owners.pop(pid, None)

    def report(self, kind: str, words: list[str]) -> None:
        with self.guard:
            if words[:1] == ["done"] and len(words) == 2:
                self.done.append(words[1])
                if len(self.done) >= TARGET:
                    self.finished.set()
            elif words[:1] == ["lost"] and len(words) > 1:
                self.lost.append(words[1])
            elif words[:1] == ["overlap"]:
                self.overlaps.append(f"{kind} {' '.join(words[1:])}")
            elif words:
                self.problems.append(f"{kind}: {' '.join(words)}")

    # -- the `lanelock run` loops (a thread each: one turn, one process) ------------------------
    def run_loop(self, klass: str, name: str, seed: int) -> None:
        rng = random.Random(seed)
        n = 0
        while not self.stop.wait(rng.uniform(0, THINK)):
            session = f"{name}-{n}"
            n += 1
            curl = ["curl", "-sf", "--max-time", "60", "-o", "/dev/null",
                    "-H", "Content-Type: application/json", "-H", f"X-Lanelock-Session: {session}",
                    "--data-binary", chat_body().decode(), self.engine.url + CHAT]
            proc = self.procs.start([*LANELOCK, "run", "-q", "--wait", "120", "--priority", klass,
                                     "-s", session, "-b", self.engine.backend, "--", "sh", "-c",
                                     RUN_GENERATE, self.token, session, *curl],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            self.register(proc.pid, "run")
            _, err = proc.communicate(timeout=TIMEOUT * 3)
            self.unregister(proc.pid)
            err = err.decode(errors="replace")
            self.run_stderr.append(err)
            if proc.returncode == 0:
                self.report("run", ["done", session])
            elif proc.returncode == -signal.SIGKILL:
                self.report("run", ["lost", session])
            elif proc.returncode == 99 and err.startswith("overlap"):
                self.report("run", err.split())
            else:
                self.report("run", ["bad", session, str(proc.returncode), err[-300:]])

    # -- the killer -------------------------------------------------------------------------------
    def killer(self, seed: int) -> None:
        rng = random.Random(seed)
        while not self.stop.wait(rng.uniform(*KILL_EVERY)):
            if rng.random() < 0.45:
                holder = self.records.holder()
                if holder is None:
                    continue
                (pid, session), target = holder, "holder"
            else:
                queue = self.records.queue()
                if not queue:
                    continue
                entry = rng.choice(queue)
                pid, target, session = entry["pid"], "waiter", entry.get("session")
            with self.guard:
                owner = self.owners.get(pid)
            if owner is None:
                continue   # ended meanwhile
            if isinstance(owner, ProxyHost) and rng.random() < 0.7:
                # Mostly the client: its proxy must give the request's wait or generation up.
                client = self._proxy_client(session)
                if client is not None and client.proc is not None:
                    prefix = client.prefix
                    if self._kill(client.proc.pid, client, prefix):
                        self.kills["client"] += 1
                    continue
            if self._kill(pid, owner, ""):
                self.kills["proxy" if isinstance(owner, ProxyHost) else target] += 1
                # The kernel (the server) dropped the dead process's locks on its queue
                # entries: they no longer count. Asked of the store as `status` asks it (a state
                # no process reports), until they are gone.
                died, looks = time.monotonic(), 0
                while any(entry["pid"] == pid for entry in self.records.queue()):
                    looks += 1
                    if time.monotonic() - died > self.records.gone_within:
                        break
                    time.sleep(0.001)
                self.gone_after.append((time.monotonic() - died if looks else 0.0, looks))

    def _kill(self, pid: int, owner, prefix: str) -> bool:
        """SIGKILL through a pidfd, if pid is still this owner's live process; True once dead."""
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            return False
        try:
            with self.guard:
                if self.owners.get(pid) is not owner:   # reaped (and maybe reused) meanwhile
                    return False
            self.kill_log.append((time.monotonic(), pid, prefix))
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            ready, _, _ = select.select([pidfd], [], [], TIMEOUT)
            assert ready, f"pid {pid} outlived SIGKILL"
            return True
        finally:
            os.close(pidfd)

    def _proxy_client(self, session: str | None) -> Worker | None:
        if not session:
            return None
        with self.guard:
            for owner in self.owners.values():
                if isinstance(owner, Worker) and owner.kind == "proxy" and \
                        session.startswith(owner.prefix + "-"):
                    return owner
        return None


def watch_for_stalls(load: Load, records, stalls: list[str]) -> None:
    """While the load runs: once the engine has been quiet for half of STALL seconds, write down
    who waits on whom (the kernel's or the server's view: records.blocked()), for the failure
    message. Polled, as a stall is a state no process reports."""
    seen = None
    while not load.stop.wait(0.25) and len(stalls) < 3:
        begun = [float(words[1]) for words in load.engine.lines[-1:]]
        if not begun or begun == seen or time.monotonic() - begun[0] < STALL / 2:
            continue
        seen = begun   # one look per quiet spell, half way to a stall
        view = records.blocked()
        stalls.append(f"no generation for {time.monotonic() - begun[0]:.1f}s; {view}")
