#!/usr/bin/env python3
"""What the witness costs the engine: the owner's tokens/s with `lanelock watch` on and off.

    python bench/witness.py [--pairs 10] [--tokens 256] [--interval 0.25]

A real llama-server (SmolLM2-135M, scripts/real-backend build and model first) and the owner's
turn as a user runs it: `lanelock run -- client` asking for --tokens tokens. Pairs alternate the
order (off then on, on then off) so neither side gets the warmer engine; "on" has `lanelock
watch` running as a user runs it (its own process, the default interval, one GET of /slots per
sample) for the whole turn. The engine's own timings give tokens/s. Target: on >= 0.99 x off
(medians). Prints a markdown table with PASS/MISS; nothing here is a test.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import real_engine_ready, start_real_engine, stop_real_engine  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
TOP = os.path.dirname(HERE)
LANELOCK = [sys.executable, "-m", "lanelock"]
TARGET = 0.99


def owner_turn(backend: str, url: str, tokens: int, env: dict) -> float:
    ask = [sys.executable, "-m", "lanelock.testing", "client", "--json", "--max-tokens",
           str(tokens), "--prompt", "Write a long story about a lighthouse keeper.", url]
    done = subprocess.run(LANELOCK + ["run", "-q", "-b", backend, "--"] + ask, env=env,
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"turn failed: {done.stderr.strip()[-300:]}")
    return json.loads(done.stdout)["timings"]["predicted_per_second"]


def start_watch(backend: str, interval: float, env: dict) -> subprocess.Popen:
    watch = subprocess.Popen(LANELOCK + ["watch", "-b", backend, "--interval", str(interval)],
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    line = watch.stderr.readline().decode()   # "watching the engine ...": it is sampling
    if "watching the engine" not in line:
        raise SystemExit(f"watch did not start: {line!r}")
    return watch


def stop_watch(watch: subprocess.Popen) -> str:
    watch.send_signal(signal.SIGTERM)
    rest = watch.stderr.read().decode()
    watch.wait(10)
    return rest


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--interval", type=float, default=0.25)
    args = parser.parse_args()
    if not real_engine_ready():
        return 2
    port, pid = start_real_engine(parallel=2)
    backend, url = f"127.0.0.1:{port}", f"http://127.0.0.1:{port}"
    env = dict(os.environ, LANELOCK_DIR=tempfile.mkdtemp(prefix="lanelock-witness-bench-"),
               PYTHONPATH=TOP)
    said = ""
    speeds = {"off": [], "on": []}
    try:
        owner_turn(backend, url, args.tokens, env)   # load the model's pages once, for both
        for pair in range(args.pairs):
            for side in (("off", "on") if pair % 2 == 0 else ("on", "off")):
                watch = start_watch(backend, args.interval, env) if side == "on" else None
                try:
                    speeds[side].append(owner_turn(backend, url, args.tokens, env))
                finally:
                    if watch is not None:
                        said += stop_watch(watch)
    finally:
        stop_real_engine(pid)
    off, on = statistics.median(speeds["off"]), statistics.median(speeds["on"])
    ratio = on / off
    print(f"\n{time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, llama-server --parallel 2, "
          f"SmolLM2-135M Q4_1, {args.tokens} tokens, {args.pairs} pairs, witness interval "
          f"{args.interval:g} s\n")
    print("| owner's turn | tokens/s (median) | min | max |")
    print("| --- | --- | --- | --- |")
    for side in ("off", "on"):
        print(f"| witness {side} | {statistics.median(speeds[side]):.1f} | "
              f"{min(speeds[side]):.1f} | {max(speeds[side]):.1f} |")
    print(f"\n| measure | value | target | |\n| --- | --- | --- | --- |\n"
          f"| on / off | {ratio:.3f} | >= {TARGET} | {'PASS' if ratio >= TARGET else 'MISS'} |")
    unseen = said.count("unseen generation")
    print(f"| unseen generations reported (gated turns only: 0 expected) | {unseen} | 0 | "
          f"{'PASS' if unseen == 0 else 'MISS'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
