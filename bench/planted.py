#!/usr/bin/env python3
"""What files other users plant in a shared lock root cost (run by hand; not a test).

    python bench/planted.py [--runs 15] [--files 20000] [--lanes 3000]

A turn (`lanelock run -- true`, a whole process) on a lane of two seats, with nothing planted and
with FILES files planted in its seats folder (1777: anyone may add to it); then `status --all`
and `metrics --all` over a root of LANES lanes another user made (a lock file and a record each).
Each figure is the median of RUNS runs (min-max beside it); memory is the process's peak RSS.
Prints one table, PASS/MISS against the targets.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

LANELOCK = [sys.executable, "-m", "lanelock"]


def timed(argv: list, env: dict) -> tuple[float, int]:
    """(seconds, peak RSS in KB) of one run of argv, which must succeed."""
    began = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    took = time.perf_counter() - began
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{argv} failed: {status}")
    return took, usage.ru_maxrss


def figures(argv: list, env: dict, runs: int) -> tuple[list[float], int]:
    samples = [timed(argv, env) for _ in range(runs)]
    return [took for took, _ in samples], max(rss for _, rss in samples)


def shown(samples: list[float]) -> str:
    return (f"{statistics.median(samples) * 1000:.0f} ms "
            f"({min(samples) * 1000:.0f}-{max(samples) * 1000:.0f})")


def plant(folder: str, names) -> None:
    for name in names:
        os.close(os.open(os.path.join(folder, name), os.O_CREAT | os.O_WRONLY, 0o644))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--files", type=int, default=20_000)
    parser.add_argument("--lanes", type=int, default=3_000)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as top:
        root = os.path.join(top, "locks")
        env = dict(os.environ, LANELOCK_DIR=root,
                   LANELOCK_CONFIG=os.path.join(top, "none.toml"),
                   LANELOCK_SYSTEM_CONFIG=os.path.join(top, "none.toml"))
        subprocess.run([*LANELOCK, "seats", "2"], env=env, check=True, capture_output=True)
        turn = [*LANELOCK, "run", "--", "true"]
        clean, _ = figures(turn, env, args.runs)
        plant(os.path.join(root, "localhost-8080.seats"),
              (f"planted-{number}" for number in range(args.files)))
        planted, _ = figures(turn, env, args.runs)
        extra = statistics.median(planted) - statistics.median(clean)
        rows.append((f"a turn, 2 seats, {args.files} files planted in the seats folder",
                     f"{shown(planted)} vs {shown(clean)}", "<= 10 ms more", extra <= 0.010))
        plant(root, (f"planted-{number}.{kind}" for number in range(args.lanes)
                     for kind in ("lock", "json")))
        for what in ("status", "metrics"):
            samples, rss = figures([*LANELOCK, what, "--all"], env, max(3, args.runs // 5))
            rows.append((f"`{what} --all`, {args.lanes} planted lanes",
                         f"{shown(samples)}, {rss // 1024} MB", "<= 2 s, <= 64 MB",
                         statistics.median(samples) <= 2.0 and rss <= 64 * 1024))
    print("| what | measured | target | |")
    print("| --- | --- | --- | --- |")
    for what, measured, target, passed in rows:
        print(f"| {what} | {measured} | {target} | {'PASS' if passed else 'MISS'} |")
    return 0 if all(row[3] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
