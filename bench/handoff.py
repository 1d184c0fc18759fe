#!/usr/bin/env python3
"""The hand-off on the flock store and on a loopback PostgreSQL, side by side in ONE run.

    python bench/handoff.py [--quick] [--dsn postgresql://...] [--waiters 1,10,50] [--seats N]
                            [--rtt 0,10,40]

A holder (`lanelock run`) and N `lanelock run --wait` turns queued behind it; the holder's
command ends, and each turn's command stamps its start and end ($EPOCHREALTIME). Two measures:
- the STORE's hand-off, from the lane's journal: a turn's 'released' event (time.time() as its
  release begins: its command has ended, nothing of the release is done yet) to the next turn's
  'acquired' event (time.time() once it holds the lane), both to the microsecond. This is what
  the store does between two turns -- the holder's writes and unlock, the waiter's wake-up,
  checks and queue leave -- and what the target is about;
- the COMMAND's hand-off: from one command's end to the next command's start, which adds both
  wrappers' own work around the store's: `lanelock run` noticing its child's exit, the next turn
  writing its record and letting its parked child go. The flock store's own is ~5 ms here.
Each as first hand-off (the holder's to the first waiter's) and back to back (one queued turn
to the next). Without --dsn a PostgreSQL server is started on loopback
(tests/support/pg_server.py: Debian's postgresql package; as root it runs as the postgres user).
--rtt: the round trip to the server, ms; 0 is loopback, each other a TCP relay in front of the
server that delays each way by half of it (bench/delay.py: this VM's kernel has no netem).
Prints a markdown table with PASS/MISS against the targets, on loopback: PostgreSQL's store
hand-off, first, median within 5 ms; back to back, median within the flock store's + 5 ms. Nothing here is a test: tests assert behaviour, this reports speed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import TOP, free_port  # noqa: E402

_SCRIPT = os.path.join(os.path.dirname(sys.executable), "lanelock")
LANELOCK = [_SCRIPT] if os.access(_SCRIPT, os.X_OK) else [sys.executable, "-m", "lanelock"]
HOLDER = 'read -r _ < "$1"; echo $EPOCHREALTIME > "$2"'
WAITER = 'echo $EPOCHREALTIME > "$1"; echo $EPOCHREALTIME > "$2"'
SETTLE = 0.3        # seconds between the last waiter's queueing and the holder's end
TARGET_MS = 5.0     # PostgreSQL's first store hand-off, median, from the holder's release
OVER_FLOCK_MS = 5.0   # PostgreSQL's back-to-back store hand-off over the flock store's, median
RUNS = {1: 20, 10: 8, 50: 3}
STALL = 60.0        # seconds for a whole queue to run through; longer is a stall (counted)


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(fraction * (len(ordered) - 1))))]


def queued(env: dict, store: list[str], lane: str) -> int:
    """The lane's waiting turns as `status` lists them (the bench may poll; a test may not)."""
    shown = subprocess.run(argv(store, "status", "-b", lane, "--json"), env=env,
                           capture_output=True, text=True)
    try:
        return len(json.loads(shown.stdout)["lanes"][0]["queue"] or ())
    except (ValueError, KeyError, IndexError):
        return 0


def until(condition, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.02)


def journal_gaps(env: dict, store: list[str], lane: str, holder: int, pids: set):
    """The store's hand-offs from the lane's journal: (the holder's release to the next turn's
    acquire, ms; [each later release to the next acquire, ms]), or (None, []) unreadable. Only
    this run's turns (pids): a lane's port may have served a run before."""
    shown = subprocess.run(argv(store, "history", "-b", lane, "--json"), env=env,
                           capture_output=True, text=True)
    try:
        events = sorted((event for event in json.loads(shown.stdout)["events"]
                         if event.get("event") in ("acquired", "released")
                         and event.get("pid") in pids),
                        key=lambda event: event["ts"])
    except (ValueError, KeyError, TypeError):
        return None, []
    first, gaps = None, []
    for at, event in enumerate(events):
        if event["event"] != "released":
            continue
        taken = next((later for later in events[at + 1:] if later["event"] == "acquired"), None)
        if taken is None:
            continue
        gap = (taken["ts"] - event["ts"]) * 1000
        if event.get("pid") == holder:
            first = gap
        else:
            gaps.append(gap)
    return first, gaps


def once(env: dict, store: list[str], work: str, tag: str, waiters: int, seats: int = 1):
    """{measure: (first hand-off ms, [back-to-back ms])} of one holder and `waiters` queued
    turns, measure "store" (the journal's release to acquire) or "command" (the commands'
    stamps); "stalled" when the queue never ran through. seats > 1: the lane has that many,
    the others held all along by sitters, so the queue goes through the holder's seat while the
    queue's head waits on every seat at once."""
    lane = f"127.0.0.1:{free_port()}"   # a lane of its own: no queue left from a run before
    fifo, end = os.path.join(work, f"go-{tag}"), os.path.join(work, f"end-{tag}")
    os.mkfifo(fifo)
    sitters, stand_up = [], os.path.join(work, f"up-{tag}")
    if seats > 1:
        subprocess.run(argv(store, "seats", "-b", lane, str(seats)), env=env, check=True,
                       capture_output=True)
        os.mkfifo(stand_up)
        for _ in range(seats - 1):
            sitters.append(subprocess.Popen(argv(store, "run", "-q", "-b", lane, "--",
                                             "bash", "-c", 'read -r _ < "$1"', "s", stand_up),
                                            env=env))
            until(lambda: _held_seats(env, store, lane) == len(sitters), "a sitter to hold")
    stamps = [(os.path.join(work, f"s-{tag}-{n}"), os.path.join(work, f"e-{tag}-{n}"))
              for n in range(waiters)]
    holder = subprocess.Popen(argv(store, "run", "-q", "-b", lane, "--", "bash", "-c",
                               HOLDER, "h", fifo, end), env=env)
    until(lambda: _held_seats(env, store, lane) == seats, "the holder to hold")
    turns = []
    for start, stop in stamps:   # one at a time: each queued (arrival order) before the next
        turns.append(subprocess.Popen(argv(store, "run", "-q", "-b", lane, "--wait",
                                       "120", "--", "bash", "-c", WAITER, "w", start, stop),
                                      env=env))
        until(lambda: queued(env, store, lane) == len(turns), "a turn to queue")
    time.sleep(SETTLE)
    with open(fifo, "w") as go:
        go.write("go\n")
    deadline = time.monotonic() + STALL
    try:
        for process in (holder, *turns):
            process.wait(max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:   # a turn that never ends: said, and the run left out
        for process in (holder, *turns, *sitters):
            if process.poll() is None:
                process.kill()
                process.wait()
        return "stalled"
    finally:
        if sitters:
            with open(stand_up, "w") as up:   # every sitter reads its end from it at once
                up.write("\n" * len(sitters))
            for sitter in sitters:
                sitter.wait()
    measured = {"store": journal_gaps(env, store, lane, holder.pid,
                                      {holder.pid, *(turn.pid for turn in turns)})}
    try:
        ran = sorted((float(open(start).read()), float(open(stop).read()))
                     for start, stop in stamps)
        first = (ran[0][0] - float(open(end).read())) * 1000
        measured["command"] = (first, [(nxt[0] - prev[1]) * 1000
                                       for prev, nxt in zip(ran, ran[1:])])
    except (OSError, ValueError):
        measured["command"] = (None, [])
    return measured


def _held_seats(env: dict, store: list[str], lane: str) -> int:
    """How many of the lane's seats are held, as `status` says (0: free or unreadable)."""
    shown = subprocess.run(argv(store, "status", "-b", lane, "--json"), env=env,
                           capture_output=True, text=True)
    try:
        lane_status = json.loads(shown.stdout)["lanes"][0]
    except (ValueError, KeyError, IndexError):
        return 0
    if lane_status.get("state") != "held":
        return 0
    return lane_status.get("held_seats") or 1


def argv(store: list[str], command: str, *rest: str) -> list[str]:
    """A lanelock command on store (["--store", DSN], or none: flock)."""
    return [*LANELOCK, command, *store, *rest]


def start_server():
    sys.path.insert(0, os.path.join(TOP, "tests"))
    from support import pg_server

    return pg_server.Server().start()


class Far:
    """The server RTT ms away: bench/delay.py in front of it, a process of its own."""

    def __init__(self, port: int, rtt: float):
        self.proc = subprocess.Popen([sys.executable, os.path.join(HERE, "delay.py"), str(port),
                                      f"{rtt:g}"], stdout=subprocess.PIPE, text=True)
        self.port = int(self.proc.stdout.readline())

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer runs, for a smoke check")
    parser.add_argument("--dsn", help="a PostgreSQL server to use (default: start one; then "
                        "--rtt 0 only)")
    parser.add_argument("--waiters", default="1,10,50", help="queue lengths, e.g. 1,10")
    parser.add_argument("--seats", type=int, default=1,
                        help="the lane's seats (the others held by sitters all along)")
    parser.add_argument("--rtt", default="0,10,40",
                        help="round trips to the server, ms (0: loopback), e.g. 0,40")
    args = parser.parse_args()
    counts = [int(word) for word in args.waiters.split(",")]
    rtts = [float(word) for word in args.rtt.split(",")]
    left_out = None
    if args.dsn and any(rtt > 0 for rtt in rtts):
        left_out = "the delay is put in front of a server the bench starts (--dsn given)"
        print(f"RTT > 0 left out: {left_out}", file=sys.stderr)
        rtts = [rtt for rtt in rtts if rtt <= 0]
    server = far = None
    results, stalls = {}, {}
    root = work = None
    try:
        server = None if args.dsn else start_server()
        dsn = args.dsn or server.dsn
        base = "/run/lock" if os.access("/run/lock", os.W_OK) else None
        root = tempfile.mkdtemp(prefix="lanelock-bench-handoff-", dir=base)
        work = tempfile.mkdtemp(prefix="lanelock-bench-stamps-")
        env = dict(os.environ, LANELOCK_DIR=root)
        env.pop("LANELOCK_STORE", None)
        for rtt in rtts:
            if far is not None:
                far.stop()
                far = None
            there = dsn
            if rtt > 0:
                far = Far(server.port, rtt)
                there = dsn.replace(f":{server.port}/", f":{far.port}/")
            stores = {"flock": [], "postgresql": ["--store", there]}
            for waiters in counts:
                runs = max(2, RUNS.get(waiters, 5) // (3 if args.quick else 1))
                for run in range(runs):   # interleaved: noise hits both stores alike
                    for kind, store in stores.items():
                        tag = f"{kind}{waiters}-{rtt:g}-{run}"
                        measured = once(env, store, work, tag, waiters, args.seats)
                        if measured == "stalled":
                            stalls[(rtt, kind)] = stalls.get((rtt, kind), 0) + 1
                            print(f"  RTT {rtt:g} ms, {kind} {waiters} waiting, run {run + 1}/"
                                  f"{runs}: stalled", file=sys.stderr, flush=True)
                            continue
                        said = []
                        for measure, (first, gaps) in measured.items():
                            cell = results.setdefault((rtt, measure, kind, waiters), ([], []))
                            if first is not None:
                                cell[0].append(first)
                            cell[1].extend(gaps)
                            said.append(f"{measure} "
                                        f"{'-' if first is None else f'{first:.2f}'}")
                        print(f"  RTT {rtt:g} ms, {kind} {waiters} waiting, run {run + 1}/"
                              f"{runs}: first {', '.join(said)} ms", file=sys.stderr,
                              flush=True)
    finally:
        for made in (root, work):
            if made is not None:
                shutil.rmtree(made, ignore_errors=True)
        if far is not None:
            far.stop()
        if server is not None:
            server.stop()
    table(results, rtts, counts, args.seats)
    if left_out is not None:
        print(f"\nRTT > 0 left out: {left_out}")
    if stalls:
        print(f"\nruns whose queue never ran through (left out above): {stalls}")
    return 0


def table(results: dict, rtts: list[float], counts: list[int], seats: int) -> None:
    def cell(values: list[float]) -> str:
        if not values:
            return "-"
        return f"{statistics.median(values):.1f} / {percentile(values, 0.9):.1f}"

    machine = f"{os.cpu_count()} cores, {os.uname().sysname} {os.uname().release}"
    load = ", load %.1f %.1f %.1f" % os.getloadavg()
    print(f"\n{time.strftime('%Y-%m-%d')}, {machine}{load}, Python {sys.version.split()[0]}; "
          f"{seats} seat{'s' if seats != 1 else ''}; median / p90 ms\n")
    print("| RTT ms | waiting | hand-off | first: flock | first: PostgreSQL | back to back: flock "
          f"| back to back: PostgreSQL | target (RTT 0, store): first <= {TARGET_MS:g} ms, "
          f"back to back <= flock + {OVER_FLOCK_MS:g} ms |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    empty = ([], [])
    for rtt in rtts:
        for waiters in counts:
            for measure in ("store", "command"):
                flock = results.get((rtt, measure, "flock", waiters), empty)
                pg = results.get((rtt, measure, "postgresql", waiters), empty)
                verdict = ""
                if measure == "store" and rtt <= 0:
                    verdicts = ["first " + _verdict(pg[0], TARGET_MS)]
                    if flock[1] or pg[1]:
                        over = statistics.median(flock[1]) + OVER_FLOCK_MS if flock[1] else None
                        verdicts.append("back to back " + (_verdict(pg[1], over)
                                                           if over is not None else "MISS"))
                    verdict = ", ".join(verdicts)
                print(f"| {rtt:g} | {waiters} | {measure} | {cell(flock[0])} | {cell(pg[0])} | "
                      f"{cell(flock[1])} | {cell(pg[1])} | {verdict} |")


def _verdict(values: list[float], bound: float) -> str:
    return "PASS" if values and statistics.median(values) <= bound else "MISS"


if __name__ == "__main__":
    sys.exit(main())
