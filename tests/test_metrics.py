"""`lanelock metrics`, checked by Prometheus's own tools and by what really happened.

1. promtool accepts the exposition in every state a lane can be in (never used, held, stopped,
   waited for, deflected from) and the proxy's GET /metrics.
2. The values are the turns that ran: local, waited, deflected, busy, fail_open (a lane whose lock
   file is a symlink) and ungated (the proxy's, in memory); histograms agree with the counters.
3. Counters never go backwards: not across journal rotations (the journal is 4096 bytes here),
   not while concurrent turns count into the same file, not when a turn dies halfway through
   writing its count, and every scrape is one consistent snapshot (holds == local + waited,
   deflections == busy + deflected).
   Counts that cannot be read are said once (metrics and the turn both warn, naming the file),
   left out rather than shown as 0 (lanelock_counts_readable 0), and never written over.
4. --textfile DIR replaces DIR/lanelock.prom atomically; anything but a writable directory is 2.
5. A real Prometheus scrapes a real node_exporter's textfile collector and a running proxy, and
   its query API returns the counts the turns made (and the Grafana dashboard's queries run).

Synchronisation is never a sleep: holders report "ready PID" on a pipe, a waiting turn is seen
blocked in /proc/locks, servers name their port on stderr once they listen. The one poll is
Prometheus's query API: Prometheus scrapes on its own schedule (every second here), so the test
asks until the values arrive, with a deadline.

The Prometheus tools are Debian's prometheus and prometheus-node-exporter packages (.ci/run installs
them); their tests skip without them unless LANELOCK_REQUIRE_PROM is set.
"""

from __future__ import annotations

import http.client
import json
import os
import select
import signal
import stat
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from support.cli import LANE, LANELOCK, STEM, TIMEOUT, cli_in_process, json_of
from support.kernel_locks import is_queued, is_waiting
from support.processes import wait_for
from support.server import Server
from lanelock import __version__ as lanelock_version
from support.engine import Engine
from support.prometheus import tool
from support.ports import free_port

BUSY = 75
PYTHON = sys.executable
OUTCOMES = ("local", "waited", "deflected", "busy", "ungated", "fail_open")
REASON = "local_backend_busy"
DASHBOARD = Path(__file__).resolve().parent.parent / "docs" / "grafana-lanelock.json"

# Scrapes `ARGV` (a `lanelock metrics` command line) in a loop, each scrape's text followed by a
# NUL on stdout, until the test closes our stdin.
SCRAPER_SCRIPT = """
import select, subprocess, sys
while not select.select([0], [], [], 0)[0]:
    done = subprocess.run(sys.argv[1:], capture_output=True)
    if done.returncode != 0:
        sys.stdout.buffer.write(b"FAILED %d %s" % (done.returncode, done.stderr))
    else:
        sys.stdout.buffer.write(done.stdout)
    sys.stdout.buffer.write(b"\\0")
    sys.stdout.buffer.flush()
"""

# Counts one turn into a lane's .counts the way every turn does, and dies where a kill -9 could
# land: after the pwrite, before the truncate (os.ftruncate is this process's _exit).
DIES_WHILE_COUNTING = """
import os, sys
from lanelock.store import counts
os.ftruncate = lambda fd, length: os._exit(9)
counts.add(os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY), sys.argv[2], "local",
           held=float(sys.argv[3]))
"""

# `lanelock run` in a loop; each turn's exit status on its own line.
TURNS_LOOP = ('i=0; while [ "$i" -lt "$3" ]; do "$1" -m lanelock run -q --grace 0 -b "$2" -- true; '
              'echo "$?"; i=$((i + 1)); done')


# -- the Prometheus tools -----------------------------------------------------------------------
@pytest.fixture
def promtool() -> str:
    return tool("promtool")


def promtool_check(run_cmd, promtool: str, text: str) -> "Scrape":
    """`promtool check metrics` on the text (stdin): no parse error, no lint finding."""
    done = run_cmd([promtool, "check", "metrics"], input=text)
    assert (done.returncode, done.stdout, done.stderr) == (0, "", ""), (done, text)
    return Scrape(text)


# -- reading an exposition ----------------------------------------------------------------------
class Scrape:
    """One exposition, parsed by prometheus-client's own parser: series -> value."""

    def __init__(self, text: str):
        self.text = text
        self.series: dict[tuple, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                key = (sample.name, frozenset(sample.labels.items()))
                assert key not in self.series, f"series twice: {sample}"
                self.series[key] = sample.value

    def value(self, name: str, **labels) -> float:
        return self.series[(name, frozenset(labels.items()))]

    def lanes(self) -> set[str]:
        return {dict(labels)["lane"] for name, labels in self.series
                if name == "lanelock_lane_held"}

    def turns(self, lane: str) -> dict[str, int]:
        found = {dict(labels)["outcome"]: value for (name, labels), value in self.series.items()
                 if name == "lanelock_turns_total" and dict(labels)["lane"] == lane}
        assert set(found) == set(OUTCOMES), found
        assert all(value == int(value) for value in found.values()), found
        return {outcome: int(value) for outcome, value in found.items()}

    def histogram(self, name: str, lane: str) -> tuple[dict[str, float], int, float]:
        """({le: cumulative count}, count, sum) of a lane's histogram."""
        buckets = {dict(labels)["le"]: value for (sample, labels), value in self.series.items()
                   if sample == f"{name}_bucket" and dict(labels)["lane"] == lane}
        return (buckets, int(self.value(f"{name}_count", lane=lane)),
                self.value(f"{name}_sum", lane=lane))

    def gauges(self, lane: str) -> dict[str, float]:
        return {name: self.value(name, lane=lane) for name in (
            "lanelock_lane_held", "lanelock_lane_waiters", "lanelock_lane_held_since_seconds",
            "lanelock_lane_holder_stopped")}

    def counters(self) -> dict[tuple, float]:
        """Every series that must never go down: counters, buckets, counts and sums."""
        return {key: value for key, value in self.series.items()
                if key[0].endswith(("_total", "_bucket", "_count", "_sum"))}


def scrape(lanelock, *args) -> Scrape:
    done = lanelock("metrics", *args)
    assert (done.returncode, done.stderr) == (0, ""), done
    return Scrape(done.stdout)


def scrape_here(*args) -> Scrape:
    """`lanelock metrics ARGS` through the CLI's entry point in this process (no process start:
    the loops below scrape hundreds of times)."""
    done = cli_in_process(["metrics", *args])
    assert (done.returncode, done.stderr) == (0, ""), done
    return Scrape(done.stdout)


def consistent(scrape: Scrape, lane: str) -> dict[str, int]:
    """One snapshot, not a half-applied update: every turn's count lands at once. Returns the
    turns."""
    turns = scrape.turns(lane)
    buckets, count, total = scrape.histogram("lanelock_lane_hold_seconds", lane)
    assert count == turns["local"] + turns["waited"], (turns, count)
    cumulative = [buckets[le] for le in sorted(buckets, key=float)]
    assert cumulative == sorted(cumulative) and cumulative[-1] == count, buckets
    assert total >= 0
    assert scrape.value("lanelock_deflections_total", lane=lane, reason=REASON) == \
        turns["busy"] + turns["deflected"], turns
    waits, wait_count, _ = scrape.histogram("lanelock_lane_wait_seconds", lane)
    assert waits["+Inf"] == wait_count
    return turns


def assert_monotonic(scrapes: list[Scrape]) -> None:
    for number, (before, after) in enumerate(zip(scrapes, scrapes[1:]), 1):
        for key, value in before.counters().items():
            assert after.series.get(key, -1.0) >= value, \
                f"{key} went from {value} to {after.series.get(key)} at scrape {number}"


def outcomes(**counts) -> dict[str, int]:
    """Turns by outcome: these counts, every other outcome 0."""
    return {outcome: counts.get(outcome, 0) for outcome in OUTCOMES}


# -- servers ----------------------------------------------------------------------------------
def engine(procs, name="stand-in", delay=0.05) -> int:
    """The stand-in engine in its own process; its port."""
    return Engine(procs, delay=delay, name=name).port


def proxy(procs, backend: str, *args, env=None) -> Server:
    return Server(procs, [*LANELOCK, "proxy", "--listen", "127.0.0.1:0", "-b", backend, *args],
                  r"proxy listening on http://127\.0\.0\.1:(\d+) ", env=env)


def request(port: int, method: str, path: str, body: bytes | None = None,
         headers: dict | None = None) -> tuple[int, dict, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
    try:
        conn.request(method, path, body, {"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        conn.close()


CHAT = json.dumps({"model": "stand-in", "messages": [{"role": "user", "content": "hi"}]}).encode()


def chat(port: int, path: str = "/v1/chat/completions", wait: str | None = None):
    """(status, X-Lanelock-State) of one generation request through the proxy."""
    status, headers, _ = request(port, "POST", path, CHAT,
                              {"X-Lanelock-Wait": wait} if wait is not None else None)
    return status, headers.get("x-lanelock-state")


def proxy_metrics(port: int) -> str:
    status, headers, body = request(port, "GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain"), (status, headers)
    return body.decode()


class waited_request:
    """A generation request the proxy makes wait (its --wait), in a thread, returned once the
    proxy's pid is blocked in flock() on the lane (/proc/locks, polled with a deadline). Start it
    before any request of this proxy gave up on the busy lane: the one thread that waits for the
    lane in the proxy would already be there (see store/flock/waiting.py's _Waiter)."""

    def __init__(self, port: int, lock: Path, pid: int):
        assert not is_waiting(lock, pid), "the proxy already waits for this lane"
        self.answers: list = []
        self.thread = threading.Thread(target=lambda: self.answers.append(chat(port)))
        self.thread.start()
        wait_for(lambda: is_waiting(lock, pid) or self.answers,
                 what="the proxy's request to wait")
        assert not self.answers, self.answers

    def answer(self) -> tuple:
        self.thread.join(TIMEOUT)
        (answer,) = self.answers
        return answer


def counted(fetch, lane: str, expected: dict) -> Scrape:
    """The scrape, once it shows these turns. The proxy counts a turn after the client has its
    answer (the lane is let go, then the count is added), and nothing reports that moment: asked
    with a deadline."""
    return wait_for(lambda: (lambda seen: seen if seen.turns(lane) == expected else None)(fetch()),
                    what=f"the counts {expected}")


def blocked_turn(procs, lock: Path, *args) -> subprocess.Popen:
    """`lanelock run --wait 30 ARGS -- true`, returned once it waits in the lane's queue (nothing
    else can tell: the queue directory, polled with a deadline)."""
    waiter = procs.start([*LANELOCK, "run", "-q", "--wait", "30", *args, "--", "true"],
                         stderr=subprocess.PIPE)
    wait_for(lambda: is_queued(lock, waiter.pid) or waiter.poll() is not None,
             what="the waiting turn to queue")
    assert waiter.returncode is None, waiter.stderr.read()
    return waiter


# -- 1. promtool accepts every state ----------------------------------------------------------------
def test_promtool_accepts_the_exposition_in_every_state(lanelock, holder, procs, lock_dir,
                                                         promtool, run_cmd):
    lock = lock_dir / f"{STEM}.lock"

    # Never used: no lock root yet. The lane is there with zeros; --all has no lane at all.
    free = promtool_check(run_cmd, promtool, scrape(lanelock).text)
    assert free.lanes() == {LANE}
    assert free.turns(LANE) == outcomes() and free.gauges(LANE)["lanelock_lane_held"] == 0
    assert free.value("lanelock_build_info", version=lanelock_version) == 1
    nothing = promtool_check(run_cmd, promtool, scrape(lanelock, "--all").text)
    assert nothing.lanes() == set()

    # Held.
    held = holder()
    seen = promtool_check(run_cmd, promtool, scrape(lanelock).text)
    assert seen.gauges(LANE)["lanelock_lane_held"] == 1
    assert seen.gauges(LANE)["lanelock_lane_held_since_seconds"] > 0
    assert seen.gauges(LANE)["lanelock_lane_waiters"] == 0

    # Held by a stopped command (^Z): the holder keeps the lane, and says so. The kernel changes
    # the state when the signal lands; nothing reports that moment.
    os.kill(held.child_pid, signal.SIGSTOP)
    try:
        stopped = wait_for(lambda: (lambda s: s if s.gauges(LANE)["lanelock_lane_holder_stopped"]
                                    else None)(scrape_here()), what="the holder to show stopped")
        promtool_check(run_cmd, promtool, stopped.text)
    finally:
        os.kill(held.child_pid, signal.SIGCONT)
    wait_for(lambda: not scrape_here().gauges(LANE)["lanelock_lane_holder_stopped"],
             what="the holder to show running again")

    # Waited for.
    waiter = blocked_turn(procs, lock)
    waited = promtool_check(run_cmd, promtool, scrape(lanelock).text)
    assert waited.gauges(LANE)["lanelock_lane_waiters"] == 1

    # Deflected from: a fallback ran, and nothing ran (75).
    assert lanelock("run", "-q", "-f", "true", "--", "true").returncode == 0
    assert lanelock("run", "-q", "--", "true").returncode == BUSY
    deflected = promtool_check(run_cmd, promtool, scrape(lanelock).text)
    assert consistent(deflected, LANE) == outcomes(deflected=1, busy=1)

    # Released: the waiter took it after the holder.
    assert held.release() == 0
    assert waiter.wait(timeout=TIMEOUT) == 0, waiter.stderr.read()
    after = promtool_check(run_cmd, promtool, scrape(lanelock, "--all").text)
    assert after.lanes() == {LANE}
    assert consistent(after, LANE) == outcomes(local=1, waited=1, deflected=1, busy=1)
    assert after.gauges(LANE) == {"lanelock_lane_held": 0, "lanelock_lane_waiters": 0,
                                  "lanelock_lane_held_since_seconds": 0,
                                  "lanelock_lane_holder_stopped": 0}


def test_promtool_accepts_the_proxys_metrics_and_they_count_its_requests(
        procs, holder, lanelock, lock_dir, promtool, run_cmd):
    port = engine(procs)
    fallback = engine(procs, name="fallback")
    backend = f"127.0.0.1:{port}"
    lane = f"localhost:{port}"
    lock = lock_dir / f"localhost-{port}.lock"
    served = proxy(procs, backend, "--wait", "30", "--fallback", f"http://127.0.0.1:{fallback}/v1")

    first = promtool_check(run_cmd, promtool, proxy_metrics(served.port))
    assert first.lanes() == {lane} and first.turns(lane) == outcomes()

    assert chat(served.port) == (200, "held")
    held = holder("-b", backend)
    waiting = waited_request(served.port, lock, served.proc.pid)
    assert chat(served.port, wait="0") == (200, "deflected")        # to the fallback URL
    assert chat(served.port, "/completion", wait="0") == (503, "busy")   # no URL fallback for it
    busy = promtool_check(run_cmd, promtool, proxy_metrics(served.port))
    assert busy.gauges(lane)["lanelock_lane_held"] == 1
    assert busy.gauges(lane)["lanelock_lane_waiters"] == 1   # the proxy's one waiting thread
    assert held.release() == 0
    assert waiting.answer() == (200, "held")

    expected = outcomes(local=2, waited=1, deflected=1, busy=1)
    final = counted(lambda: promtool_check(run_cmd, promtool, proxy_metrics(served.port)), lane,
                    expected)
    assert consistent(final, lane) == expected
    # The CLI reads the same file: both paths say the same (the proxy adds only what no file
    # records, its ungated requests, none here).
    assert consistent(scrape(lanelock, "-b", backend), lane) == expected


def test_the_proxy_counts_ungated_requests_in_memory(procs, lanelock, lock_dir, tmp_path,
                                                      promtool, run_cmd):
    port = engine(procs)
    never = tmp_path / "ungated.toml"
    never.write_text('gate = "never"\n')
    served = proxy(procs, f"127.0.0.1:{port}", env={"LANELOCK_CONFIG": never})
    for _ in range(3):
        assert chat(served.port) == (200, "ungated")   # no lock taken
    lane = f"localhost:{port}"
    seen = promtool_check(run_cmd, promtool, proxy_metrics(served.port))
    assert seen.turns(lane) == outcomes(ungated=3)
    # No lane file records an ungated turn: the CLI cannot see them, and nothing was created.
    assert scrape(lanelock, "-b", f"127.0.0.1:{port}").turns(lane) == outcomes()
    assert not (lock_dir / f"localhost-{port}.counts").exists()


# -- 2. the values are what happened ------------------------------------------------------------
def test_counts_and_histograms_match_the_turns_that_ran(lanelock, holder, procs, lock_dir,
                                                        tmp_path):
    lock = lock_dir / f"{STEM}.lock"
    started = time.monotonic()
    for _ in range(3):
        assert lanelock("run", "-q", "--", "true").returncode == 0
    assert lanelock("run", "-q", "--", "sleep", "0.3").returncode == 0   # holds >= 0.3 s
    held = holder()
    for _ in range(2):
        assert lanelock("run", "-q", "--", "true").returncode == BUSY
    for _ in range(2):
        assert lanelock("run", "-q", "-f", "true", "--", "true").returncode == 0
    # Deflected after waiting 0.1 s: a wait is observed for it too (while the holder holds).
    assert lanelock("run", "-q", "--wait", "0.1", "-f", "true", "--", "true").returncode == 0
    waiters = [blocked_turn(procs, lock) for _ in range(2)]
    assert held.release() == 0
    for waiter in waiters:
        assert waiter.wait(timeout=TIMEOUT) == 0, waiter.stderr.read()

    # Fail open: the lane's lock file is a symlink, so the gate cannot be taken, but the root is
    # usable: the turn runs ungated with one warning, and the count lands in the lane's .counts.
    (tmp_path / "elsewhere").write_text("")
    (lock_dir / "localhost-7019.lock").symlink_to(tmp_path / "elsewhere")
    open_turn = lanelock("run", "-b", "localhost:7019", "--", "true")
    assert open_turn.returncode == 0 and "gate unavailable" in open_turn.stderr, open_turn
    elapsed = time.monotonic() - started

    seen = scrape(lanelock, "--all")
    assert seen.lanes() == {LANE, "localhost:7019"}
    assert consistent(seen, LANE) == outcomes(local=5, waited=2, deflected=3, busy=2)
    assert seen.turns("localhost:7019") == outcomes(fail_open=1)
    assert seen.histogram("lanelock_lane_hold_seconds", "localhost:7019")[1] == 0

    # Holds: 7 (5 local, 2 waited), one way apart on one lane, so their sum fits the test's time;
    # the `sleep 0.3` turn is above 0.25 s, and so is the holder's (the 0.1 s wait ran inside it).
    buckets, count, total = seen.histogram("lanelock_lane_hold_seconds", LANE)
    assert count == 7
    assert 0.3 + 0.1 <= total <= elapsed
    assert buckets["0.1"] <= count - 2 and buckets["0.25"] <= count - 1
    assert all(value == count for le, value in buckets.items()
               if le == "+Inf" or float(le) >= elapsed)
    # Waits: the two waiters' and the deflected turn's 0.1 s (busy turns without --wait: none).
    waits, wait_count, wait_total = seen.histogram("lanelock_lane_wait_seconds", LANE)
    assert wait_count == 3
    assert 0.1 <= wait_total <= 3 * elapsed
    assert waits["0.1"] <= wait_count - 1
    assert all(value == wait_count for le, value in waits.items()
               if le == "+Inf" or float(le) >= elapsed)


def test_the_waiters_gauge_counts_the_turns_status_counts(lanelock, holder, procs, lock_dir):
    """A waiter is a turn that still wants the lane -- its queue entry says so.
    lanelock_lane_waiters counted processes blocked on the lane's own lock (/proc/locks), which
    is only the first of the queue: 1 while `status` said [3 waiting]."""
    lock = lock_dir / f"{STEM}.lock"
    held = holder()
    waiters = [blocked_turn(procs, lock) for _ in range(3)]
    plain = lanelock("status").stdout
    assert "[3 waiting" in plain, plain
    assert scrape(lanelock).gauges(LANE)["lanelock_lane_waiters"] == 3
    assert held.release() == 0
    for waiter in waiters:
        assert waiter.wait(timeout=TIMEOUT) == 0, waiter.stderr.read()
    assert scrape(lanelock).gauges(LANE)["lanelock_lane_waiters"] == 0


# -- 3. counters never go backwards ---------------------------------------------------------------
@pytest.mark.slow   # a soak: turns across several journal rotations
def test_counters_never_go_backwards_across_journal_rotations(lanelock, holder, lock_dir,
                                                              config_files):
    config_files[1].write_text("journal_max_bytes = 4096\n")   # a rotation every ~9 turns
    journal = lock_dir / f"{STEM}.journal"
    scrapes, inodes = [], []

    def look() -> None:
        scrapes.append(scrape_here())
        consistent(scrapes[-1], LANE)
        inodes.append(journal.stat().st_ino)   # a new journal file: a rotation since the last look

    for _ in range(5):                        # 5 x (holder, busy, deflected, 17 local) = 100
        held = holder()
        look()
        assert lanelock("run", "-q", "--", "true").returncode == BUSY
        look()
        assert lanelock("run", "-q", "-f", "true", "--", "true").returncode == 0
        look()
        assert held.release() == 0
        look()
        for _ in range(17):
            assert lanelock("run", "-q", "--", "true").returncode == 0
            look()

    assert_monotonic(scrapes)
    assert scrapes[-1].turns(LANE) == outcomes(local=90, busy=5, deflected=5)
    assert scrapes[-1].histogram("lanelock_lane_hold_seconds", LANE)[1] == 90
    # The journal did rotate, many times, and lost the early turns: the counts did not.
    rotations = sum(before != after for before, after in zip(inodes, inodes[1:]))
    assert rotations >= 5, f"only {rotations} rotations seen"
    print(f"\n{rotations} journal rotations seen across {len(scrapes)} scrapes")
    assert Path(f"{journal}.1").exists() and not Path(f"{journal}.2").exists()
    assert json_of(["history", "--json"])["summary"]["turns"] < 90


@pytest.mark.parametrize("writers, turns", [
    (4, 25),                                             # ~4 s on two cores: the default tier
    pytest.param(8, 50, marks=pytest.mark.slow),         # the full stress, ~12 s: the slow tier
])
def test_concurrent_turns_lose_no_count_and_readers_see_whole_updates(procs, lanelock, writers,
                                                                      turns):
    backend, lane = "localhost:7302", "localhost:7302"
    scraper = procs.start([PYTHON, "-c", SCRAPER_SCRIPT, *LANELOCK, "metrics", "-b", backend],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    # The scraper's first scrape has ended before any turn starts: it reads throughout.
    output = bytearray()
    while b"\0" not in output:
        ready, _, _ = select.select([scraper.stdout], [], [], TIMEOUT)
        assert ready, "the scraper never scraped"
        chunk = os.read(scraper.stdout.fileno(), 65536)
        assert chunk, "the scraper ended"
        output += chunk
    collector = threading.Thread(target=lambda: output.extend(scraper.stdout.read()), daemon=True)
    collector.start()

    loops = [procs.start(["sh", "-c", TURNS_LOOP, "sh", PYTHON, backend, str(turns)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(writers)]
    statuses = []
    for loop in loops:
        out, err = loop.communicate(timeout=10 * TIMEOUT)
        assert loop.returncode == 0 and err == "", err
        statuses += out.split()
    scraper.stdin.close()   # the scraper's signal to stop
    assert scraper.wait(timeout=TIMEOUT) == 0
    collector.join(TIMEOUT)

    assert len(statuses) == writers * turns and set(statuses) <= {"0", "75"}, statuses
    local, busy = statuses.count("0"), statuses.count("75")
    texts = [text.decode() for text in bytes(output).split(b"\0")[:-1]]
    assert not [text for text in texts if text.startswith("FAILED")], texts
    scrapes = [Scrape(text) for text in texts]
    for seen in scrapes:
        consistent(seen, lane)
    assert_monotonic(scrapes)
    final = scrape(lanelock, "-b", backend)
    assert_monotonic([*scrapes, final])
    assert consistent(final, lane) == outcomes(local=local, busy=busy)
    assert local + busy == writers * turns
    during = [seen.turns(lane)["local"] + seen.turns(lane)["busy"] for seen in scrapes]
    print(f"\n{writers} x {turns} turns: {local} local, {busy} busy; {len(scrapes)} scrapes "
          f"meanwhile, seeing {sorted(set(during))[:12]}...")


def test_a_turn_killed_while_counting_never_resets_the_counts(lanelock, run_cmd, lock_dir):
    for _ in range(2):
        assert lanelock("run", "-q", "--", "true").returncode == 0
    before = scrape(lanelock)
    total = before.histogram("lanelock_lane_hold_seconds", LANE)[2]
    # A hold that rounds the sum to a whole second: the counts' text gets shorter than before.
    held = round(1 - total % 1, 6)
    died = run_cmd([PYTHON, "-c", DIES_WHILE_COUNTING, lock_dir, f"{STEM}.counts", str(held)])
    assert died.returncode == 9, died
    after = scrape(lanelock)
    # The count that was written stands (a torn tail read as "no counts": every counter 0).
    assert after.turns(LANE) == outcomes(local=3)
    assert_monotonic([before, after])
    assert lanelock("run", "-q", "--", "true").returncode == 0
    assert scrape(lanelock).turns(LANE) == outcomes(local=4)


# Counts that cannot be read: a damaged STEM.counts read as no counts at all --
# every counter back to 0, which Prometheus takes for a reset -- with exit 0, and the next turn
# wrote its one turn over it, silently. Now: `metrics` says so once and leaves those series out
# (lanelock_counts_readable 0), a turn says once that it was not counted and leaves the file alone.
def _moved_behind_a_symlink(path: Path) -> None:
    real = path.with_name("elsewhere.counts")
    path.rename(real)
    path.symlink_to(real)


DAMAGES = {
    "garbage": lambda path: path.write_bytes(b"\x00\xff not the counts"),
    "not-an-object": lambda path: path.write_text("[1, 2, 3]\n"),
    "too-large": lambda path: path.write_text(json.dumps({"turns": {"local": 2},
                                                          "padding": "x" * 70000})),
    "a-directory": lambda path: (path.unlink(), path.mkdir()),
    "a-symlink": _moved_behind_a_symlink,
}


def file_state(path: Path):
    """What a turn must not change: the bytes, or what stands at the path."""
    if path.is_symlink():
        return ("symlink", os.readlink(path), path.resolve().read_bytes())
    if path.is_dir():
        return ("directory", sorted(os.listdir(path)))
    return ("file", path.read_bytes())


def lane_series(scrape: Scrape, lane: str, prefix: str) -> dict:
    return {(name, labels): value for (name, labels), value in scrape.series.items()
            if name.startswith(prefix) and dict(labels).get("lane") == lane}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_unreadable_counts_are_said_once_and_never_reset(damage, lanelock, holder, lock_dir,
                                                         promtool, run_cmd):
    for _ in range(2):
        assert lanelock("run", "-q", "--", "true").returncode == 0
    path = lock_dir / f"{STEM}.counts"
    DAMAGES[damage](path)
    before = file_state(path)

    done = lanelock("metrics")
    assert done.returncode == 0, done
    (warning,) = done.stderr.splitlines()
    assert warning.startswith("lanelock: warning: ") and str(path) in warning, warning
    seen = promtool_check(run_cmd, promtool, done.stdout)
    assert seen.value("lanelock_counts_readable", lane=LANE) == 0
    # Nothing that could not be read shows as 0: its series are left out, not reset.
    for prefix in ("lanelock_turns", "lanelock_deflections", "lanelock_lane_hold_seconds",
                   "lanelock_lane_wait_seconds"):
        assert lane_series(seen, LANE, prefix) == {}, prefix
    assert seen.gauges(LANE)["lanelock_lane_held"] == 0   # the rest of the lane is there

    # A turn runs as ever, says once that it was not counted, and leaves the file as it was.
    ran = lanelock("run", "--", "echo", "ran")
    assert (ran.returncode, ran.stdout) == (0, "ran\n"), ran
    (line,) = ran.stderr.splitlines()
    assert line.startswith("lanelock: warning: ") and "not counted" in line, line
    assert str(path) in line
    assert lanelock("run", "-q", "--", "true").stderr == ""   # -q: no warnings
    held = holder()
    deflected = lanelock("run", "-f", "true", "--", "true")
    assert deflected.returncode == 0
    assert sum("not counted" in line for line in deflected.stderr.splitlines()) == 1, deflected
    assert held.release() == 0
    assert file_state(path) == before


@pytest.mark.parametrize("damage", ["a-bad-field", "trailing-bytes"])
def test_partly_damaged_counts_keep_what_parses(damage, lanelock, holder, lock_dir, promtool,
                                                run_cmd):
    for _ in range(3):
        assert lanelock("run", "-q", "--", "true").returncode == 0
    held = holder()
    assert lanelock("run", "-q", "--", "true").returncode == BUSY
    assert held.release() == 0
    path = lock_dir / f"{STEM}.counts"
    data = json.loads(path.read_bytes())
    if damage == "a-bad-field":
        data["turns"]["local"] = "four"
        path.write_text(json.dumps(data))
    else:
        path.write_bytes(json.dumps(data).encode() + b"\x00garbage")
    before = path.read_bytes()

    done = lanelock("metrics")
    assert done.returncode == 0, done
    (warning,) = done.stderr.splitlines()
    assert str(path) in warning, warning
    seen = promtool_check(run_cmd, promtool, done.stdout)
    assert seen.value("lanelock_counts_readable", lane=LANE) == 0
    assert seen.value("lanelock_turns_total", lane=LANE, outcome="busy") == 1   # kept
    assert seen.value("lanelock_deflections_total", lane=LANE, reason=REASON) == 1
    assert seen.histogram("lanelock_lane_hold_seconds", LANE)[1] == 4
    local = ("lanelock_turns_total", frozenset({("lane", LANE), ("outcome", "local")}))
    if damage == "a-bad-field":
        assert "turns.local" in warning
        assert local not in seen.series   # the one counter that cannot be read: left out
    else:
        assert seen.series[local] == 4

    ran = lanelock("run", "--", "true")
    assert ran.returncode == 0 and "not counted" in ran.stderr, ran
    assert path.read_bytes() == before   # never rewritten from what could not all be read

    # Once someone removes it, the counts start again -- and say they are readable.
    path.unlink()
    assert lanelock("run", "--", "true").stderr == ""
    done = lanelock("metrics")
    assert done.stderr == ""
    seen = promtool_check(run_cmd, promtool, done.stdout)
    assert seen.value("lanelock_counts_readable", lane=LANE) == 1
    assert seen.turns(LANE) == outcomes(local=1)


# -- 4. --textfile -------------------------------------------------------------------------------
def test_textfile_is_replaced_atomically_and_always_parses(lanelock, procs, tmp_path):
    for backend in ("localhost:7311", "localhost:7312"):
        assert lanelock("run", "-q", "-b", backend, "--", "true").returncode == 0
    directory = tmp_path / "textfile"
    directory.mkdir()
    prom = directory / "lanelock.prom"
    writes = 15
    writer = procs.start(["sh", "-c", 'i=0; while [ "$i" -lt "$3" ]; do "$1" -m lanelock metrics '
                          '--all --textfile "$2" || exit 1; i=$((i + 1)); done',
                          "sh", PYTHON, directory, str(writes)], stderr=subprocess.PIPE)
    reads, inodes = 0, set()
    while True:
        # Read for as long as the writer writes: every read is a whole file, old or new.
        finished = writer.poll() is not None
        try:
            fd = os.open(prom, os.O_RDONLY)
        except FileNotFoundError:
            assert reads == 0, "the file vanished between two writes"
        else:
            with os.fdopen(fd, "rb") as handle:
                inodes.add(os.fstat(handle.fileno()).st_ino)
                text = handle.read().decode()
            seen = Scrape(text)
            assert text.endswith("\n") and seen.lanes() == {"localhost:7311", "localhost:7312"}
            for lane in seen.lanes():
                assert consistent(seen, lane) == outcomes(local=1)
            reads += 1
        if finished:
            break
    assert writer.returncode == 0, writer.stderr.read()
    assert reads > 1 and len(inodes) > 1   # a new inode per write: renamed into place
    assert sorted(os.listdir(directory)) == ["lanelock.prom"]   # no temp file left behind
    assert stat.S_IMODE(prom.stat().st_mode) == 0o644
    assert prom.read_text() == lanelock("metrics", "--all").stdout


def test_textfile_needs_a_writable_directory(lanelock, tmp_path, tmpfs):
    plain = tmp_path / "a-file"
    plain.write_text("")
    for where in (plain, tmp_path / "missing"):
        done = lanelock("metrics", "--textfile", where)
        assert done.returncode == 2 and "not a directory" in done.stderr, done
        assert done.stdout == ""
    assert plain.read_text() == ""
    assert lanelock("metrics", "--all", "-b", LANE).returncode == 2
    read_only = tmpfs("ro,size=1m")
    done = lanelock("metrics", "--all", "--textfile", read_only)
    assert done.returncode == 2 and "cannot write" in done.stderr, done
    assert os.listdir(read_only) == []


# -- 5. a real Prometheus ----------------------------------------------------------------------
def query(port: int, expression: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expression})
    with urllib.request.urlopen(url, timeout=10) as response:
        data = json.load(response)
    assert data["status"] == "success", data
    return data["data"]["result"]


def by_label(result: list[dict], label: str) -> dict[str, float]:
    return {series["metric"][label]: float(series["value"][1]) for series in result}


def until(what: str, fetch, expected, timeout: float = 60.0):
    """Ask Prometheus until it answers `expected`: it scrapes on its own clock (every second
    here), and nothing tells us when a scrape has landed. A poll with a deadline."""
    deadline = time.monotonic() + timeout
    while True:
        got = fetch()
        if got == expected:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"Prometheus never showed {what}: {got} != {expected}")
        time.sleep(0.2)


def test_prometheus_scrapes_the_textfile_and_the_proxy(procs, holder, lanelock, lock_dir,
                                                        tmp_path):
    prometheus = tool("prometheus")
    node_exporter = tool("prometheus-node-exporter", "node_exporter")
    textfiles = tmp_path / "textfile"
    textfiles.mkdir()
    exporter = Server(procs, [node_exporter, "--collector.disable-defaults",
                              "--collector.textfile", f"--collector.textfile.directory={textfiles}",
                              "--web.listen-address=127.0.0.1:0"],
                      r'msg="Listening on" address=127\.0\.0\.1:(\d+)')
    port = engine(procs)
    backend, engine_lane = f"127.0.0.1:{port}", f"localhost:{port}"
    fallback = engine(procs, name="fallback")
    served = proxy(procs, backend, "--wait", "30", "--fallback", f"http://127.0.0.1:{fallback}/v1")
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
        "scrape_configs:\n"
        f"  - job_name: node\n    static_configs: [{{targets: ['127.0.0.1:{exporter.port}']}}]\n"
        f"  - job_name: lanelock-proxy\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{served.port}']}}]\n")
    server = Server(procs, [prometheus, f"--config.file={config}",
                            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                            "--web.listen-address=127.0.0.1:0"],
                    r'msg="Listening on" address=127\.0\.0\.1:(\d+)')
    refresh = ["metrics", "--all", "--textfile", textfiles]

    # The textfile path, while a holder holds the default lane and a turn waits for it.
    for _ in range(2):
        assert lanelock("run", "-q", "--", "true").returncode == 0
    held = holder()
    assert lanelock("run", "-q", "--", "true").returncode == BUSY
    assert lanelock("run", "-q", "-f", "true", "--", "true").returncode == 0
    waiter = blocked_turn(procs, lock_dir / f"{STEM}.lock")
    assert lanelock(*refresh).returncode == 0
    until("the held lane", lambda: (
        by_label(query(server.port, f'lanelock_lane_held{{job="node",lane="{LANE}"}}'), "lane"),
        by_label(query(server.port, f'lanelock_lane_waiters{{job="node",lane="{LANE}"}}'),
                 "lane")), ({LANE: 1.0}, {LANE: 1.0}))
    assert held.release() == 0
    assert waiter.wait(timeout=TIMEOUT) == 0

    # The proxy path, on the engine's lane.
    for _ in range(2):
        assert chat(served.port) == (200, "held")
    engine_holder = holder("-b", backend)
    waiting = waited_request(served.port, lock_dir / f"localhost-{port}.lock", served.proc.pid)
    assert chat(served.port, wait="0") == (200, "deflected")
    assert chat(served.port, "/completion", wait="0") == (503, "busy")
    assert engine_holder.release() == 0
    assert waiting.answer() == (200, "held")
    expected = outcomes(local=3, waited=1, deflected=1, busy=1)
    counted(lambda: scrape_here("-b", backend), engine_lane, expected)
    assert lanelock(*refresh).returncode == 0   # both lanes, now free

    cli_lane = proxy_lane = {outcome: float(value) for outcome, value in expected.items()}

    def turns(job: str, lane: str) -> dict[str, float]:
        return by_label(query(server.port, f'lanelock_turns_total{{job="{job}",lane="{lane}"}}'),
                        "outcome")

    until("the textfile's default lane", lambda: turns("node", LANE), cli_lane)
    until("the textfile's engine lane", lambda: turns("node", engine_lane), proxy_lane)
    until("the proxy's lane", lambda: turns("lanelock-proxy", engine_lane), proxy_lane)
    assert by_label(query(server.port, 'lanelock_lane_held{job="node"}'), "lane") == \
        {LANE: 0.0, engine_lane: 0.0}
    for lane, jobs in ((LANE, {"node": 4.0}), (engine_lane, {"node": 4.0, "lanelock-proxy": 4.0})):
        holds = query(server.port, f'lanelock_lane_hold_seconds_count{{lane="{lane}"}}')
        assert by_label(holds, "job") == jobs   # local + waited
    deflections = query(server.port, f'lanelock_deflections_total{{reason="{REASON}"}}')
    assert sorted(float(series["value"][1]) for series in deflections) == [2.0, 2.0, 2.0]
    assert by_label(query(server.port, "up"), "job") == {"node": 1.0, "lanelock-proxy": 1.0}
    assert [float(series["value"][1]) for series in
            query(server.port, "node_textfile_scrape_error")] == [0.0]

    # docs/grafana-lanelock.json's queries are valid PromQL for this Prometheus (its variables
    # filled as Grafana fills them).
    panels = json.loads(DASHBOARD.read_text())["panels"]
    expressions = [target["expr"] for panel in panels for target in panel["targets"]]
    assert len(expressions) >= 6
    for expression in expressions:
        filled = (expression.replace("$__rate_interval", "1m").replace("$job", ".+")
                  .replace("$lane", ".+"))
        query(server.port, filled)   # status "success", or the assertion shows the error
    assert "level=error" not in server.log(), server.log()


def test_pg_counts_that_cannot_be_read_are_left_out_not_reset(postgres, lanelock, promtool,
                                                              run_cmd, monkeypatch):
    """On the PostgreSQL store too: counts the scrape cannot read (here a role that may read the
    lanes but not lanelock_counts) are left out, with lanelock_counts_readable 0 and one warning
    -- never shown as 0, which Prometheus would take for a reset."""
    import psycopg

    monkeypatch.setenv("LANELOCK_STORE", postgres.dsn)
    # A lane of this test's own: the worker's server keeps every earlier test's lanes and counts.
    monkeypatch.setenv("LANELOCK_BACKEND", f"127.0.0.1:{free_port()}")
    for _ in range(2):
        assert lanelock("run", "-q", "--", "true").returncode == 0
    with psycopg.connect(postgres.dsn, autocommit=True) as conn:
        conn.execute("DROP ROLE IF EXISTS lanelock_reader")
        conn.execute("CREATE ROLE lanelock_reader LOGIN")
        conn.execute("GRANT SELECT ON lanelock_holders, lanelock_events, lanelock_queue "
                     "TO lanelock_reader")
    try:
        reader = postgres.dsn.replace("postgresql://postgres@", "postgresql://lanelock_reader@")
        done = lanelock("metrics", env={"LANELOCK_STORE": reader})
        assert done.returncode == 0, done
        seen = promtool_check(run_cmd, promtool, done.stdout)
        lane = json.loads(lanelock("where", "--json").stdout)["lane"]
        assert seen.value("lanelock_counts_readable", lane=lane) == 0
        for prefix in ("lanelock_turns", "lanelock_deflections", "lanelock_lane_hold_seconds"):
            assert lane_series(seen, lane, prefix) == {}, prefix
        assert "lanelock_counts" in done.stderr and "not all read" in done.stderr, done.stderr
        # the owner still reads them
        owner = promtool_check(run_cmd, promtool, lanelock("metrics").stdout)
        assert owner.value("lanelock_counts_readable", lane=lane) == 1
        assert owner.value("lanelock_turns_total", lane=lane, outcome="local") == 2
    finally:
        with psycopg.connect(postgres.dsn, autocommit=True) as conn:
            conn.execute("REVOKE ALL ON lanelock_holders, lanelock_events, lanelock_queue "
                         "FROM lanelock_reader")
            conn.execute("DROP ROLE lanelock_reader")
