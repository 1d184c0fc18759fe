#!/usr/bin/env python3
"""What `lanelock metrics --all` costs on a busy machine: 100 lanes, each with 10,000 journal lines
and a year's worth of counts, a few of them held while it runs.

    python bench/metrics.py [--lanes 100] [--lines 10000] [--held 5] [--runs 9]

Needs lanelock with its metrics extra in this Python (`pip install '.[metrics]'`). The lanes are
made by one real turn each (lock file, holder record, counts file), then their journals and counts
are written directly: ten thousand turns per lane would take an hour. The exposition reads the
counts files, never the journals, so the journals' size must not show in the figure. Prints a
markdown table with PASS/MISS; nothing here is a test.
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

_SCRIPT = os.path.join(os.path.dirname(sys.executable), "lanelock")
LANELOCK = [_SCRIPT] if os.access(_SCRIPT, os.X_OK) else [sys.executable, "-m", "lanelock"]
FIRST_PORT = 19200
TARGET_MS = 300.0


def make_lanes(root: str, lanes: int, lines: int) -> None:
    from lanelock import Gate
    from lanelock.store import counts

    os.environ["LANELOCK_DIR"] = root
    for index in range(lanes):
        port = FIRST_PORT + index
        with Gate(f"127.0.0.1:{port}", warn=lambda message: None).turn(session="bench"):
            pass
        stem = os.path.join(root, f"localhost-{port}")
        # Half the lines in the rotated generation, half in the current one, as a journal
        # rotating at journal_max_bytes keeps them.
        for suffix, share in ((".journal.1", lines // 2), (".journal", lines - lines // 2)):
            with open(stem + suffix, "w") as handle:
                handle.writelines(journal_line(port, number) for number in range(share))
        data = counts.empty()
        data["turns"].update(local=lines // 3, waited=lines // 20, deflected=lines // 10,
                             busy=lines // 25)
        data["deflections"]["local_backend_busy"] = lines // 10 + lines // 25
        for number in range(lines // 3 + lines // 20):
            counts.observe(data["hold"], 0.5 + (number % 97) * 0.9)
        for number in range(lines // 20):
            counts.observe(data["wait"], 0.1 + (number % 13))
        with open(stem + ".counts", "w") as handle:
            json.dump(data, handle)


def journal_line(port: int, number: int) -> str:
    event = "acquired" if number % 2 == 0 else "released"
    now = 1_790_000_000 + number * 7.5
    fields = {"event": event, "time": time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(now)),
              "ts": now, "monotonic": 1000 + number * 7.5, "lane": f"localhost:{port}",
              "pid": 40000 + number % 3000, "session": "agent-7@pts/3", "model": "qwen2.5-coder"}
    if event == "released":
        fields.update(duration=round(3.2 + number % 11, 6), exit_status=0)
    return json.dumps(fields) + "\n"


def hold(root: str, lanes: int, held: int) -> list[subprocess.Popen]:
    """`held` lanes held by real turns for the whole measurement (their child waits on stdin)."""
    env = dict(os.environ, LANELOCK_DIR=root)
    holders = []
    for index in range(held):
        port = FIRST_PORT + index * max(1, lanes // max(held, 1))
        holders.append(subprocess.Popen(
            LANELOCK + ["run", "-q", "-b", f"127.0.0.1:{port}", "--", "sh", "-c",
                        "echo ready; read line"],
            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE))
    for proc in holders:
        assert proc.stdout.readline() == b"ready\n", "a holder did not start"
    return holders


def timed(argv: list[str], env: dict) -> tuple[float, bytes]:
    start = time.perf_counter()
    done = subprocess.run(argv, env=env, capture_output=True, check=False)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{argv} failed: {done.stderr.decode()[-400:]}")
    return elapsed, done.stdout


def median_ms(argv: list[str], env: dict, runs: int) -> tuple[float, bytes]:
    timed(argv, env)   # the page cache warm, as it is on a machine that scrapes every minute
    results = [timed(argv, env) for _ in range(runs)]
    return statistics.median(elapsed for elapsed, _ in results) * 1000, results[-1][1]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lanes", type=int, default=100)
    parser.add_argument("--lines", type=int, default=10_000, help="journal lines per lane")
    parser.add_argument("--held", type=int, default=5, help="lanes held while measuring")
    parser.add_argument("--runs", type=int, default=9)
    args = parser.parse_args()
    # The default root /run/lock/lanelock is on tmpfs: measure there when we may.
    base = "/run/lock" if os.access("/run/lock", os.W_OK) else None
    root = tempfile.mkdtemp(prefix="lanelock-bench-metrics-", dir=base)
    textfiles = tempfile.mkdtemp(prefix="lanelock-bench-textfile-")
    env = dict(os.environ, LANELOCK_DIR=root)
    rows = []
    holders: list[subprocess.Popen] = []
    try:
        print(f"making {args.lanes} lanes x {args.lines} journal lines under {root} ...",
              file=sys.stderr, flush=True)
        made = time.perf_counter()
        make_lanes(root, args.lanes, args.lines)
        journal_bytes = sum(os.path.getsize(os.path.join(root, name))
                            for name in os.listdir(root) if ".journal" in name)
        print(f"  made in {time.perf_counter() - made:.1f}s "
              f"({journal_bytes / 1e6:.0f} MB of journals)", file=sys.stderr, flush=True)
        holders = hold(root, args.lanes, args.held)

        every, text = median_ms(LANELOCK + ["metrics", "--all"], env, args.runs)
        lanes_seen = text.count(b"lanelock_lane_held{")
        held_seen = sum(1 for line in text.splitlines()
                        if line.startswith(b"lanelock_lane_held{") and line.endswith(b" 1.0"))
        rows.append((f"`metrics --all`, {args.lanes} lanes x {args.lines} journal lines, "
                     f"{args.held} held (median ms)", f"{every:.0f}", f"<= {TARGET_MS:.0f} ms",
                     "PASS" if every <= TARGET_MS and lanes_seen == args.lanes else "MISS"))
        rows.append(("lanes / held lanes in the exposition", f"{lanes_seen} / {held_seen}",
                     f"{args.lanes} / {args.held}",
                     "PASS" if (lanes_seen, held_seen) == (args.lanes, args.held) else "MISS"))
        textfile, _ = median_ms(LANELOCK + ["metrics", "--all", "--textfile", textfiles], env,
                                args.runs)
        rows.append(("`metrics --all --textfile DIR` (median ms)", f"{textfile:.0f}",
                     f"<= {TARGET_MS:.0f} ms", "PASS" if textfile <= TARGET_MS else "MISS"))
        one, _ = median_ms(LANELOCK + ["metrics", "-b", f"127.0.0.1:{FIRST_PORT + 1}"], env,
                           args.runs)
        rows.append(("`metrics -b LANE`, one lane (median ms)", f"{one:.0f}", "", ""))
        floor, _ = median_ms([sys.executable, "-c", "import prometheus_client, psutil, click"],
                             env, args.runs)
        rows.append(("floor: `python -c 'import prometheus_client, psutil, click'` (median ms)",
                     f"{floor:.0f}", "", ""))
        rows.append(("per lane above one lane (ms)",
                     f"{(every - one) / max(args.lanes - 1, 1):.2f}", "", ""))
        promtool = shutil.which("promtool")
        if promtool:
            check = subprocess.run([promtool, "check", "metrics"], input=text,
                                   capture_output=True)
            rows.append(("`promtool check metrics` on the exposition",
                         "ok" if check.returncode == 0 else check.stderr.decode()[:80], "ok",
                         "PASS" if check.returncode == 0 else "MISS"))
    finally:
        for proc in holders:
            proc.stdin.close()
            proc.wait()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(textfiles, ignore_errors=True)
    machine = f"{os.cpu_count()} cores, {os.uname().sysname} {os.uname().release}"
    print(f"\n{time.strftime('%Y-%m-%d')}, {machine}, Python {sys.version.split()[0]}, "
          f"median of {args.runs} runs\n")
    print("| measure | value | target | |\n| --- | --- | --- | --- |")
    for name, value, target, verdict in rows:
        print(f"| {name} | {value} | {target} | {verdict} |")
    return 0 if all(verdict != "MISS" for *_, verdict in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
