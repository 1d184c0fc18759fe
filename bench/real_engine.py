#!/usr/bin/env python3
"""What the gate buys, on a real engine: llama-server (--parallel 2) with SmolLM2-135M.

    python bench/real_engine.py [--reps 3] [--tokens 128] [--json]

The primary session's 128-token turn (a) alone, (b) while a second session generates ungated on the
same server, (c) while the second session goes through lanelock and is deflected to the fallback.
The fallback here is the stand-in backend (a cloud answers from elsewhere: it must not eat this
machine's cores). Needs scripts/real-backend build and model first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import real_engine_ready, start_real_engine, stop_real_engine  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
TOP = os.path.dirname(HERE)
LANELOCK = [sys.executable, "-m", "lanelock"]




def turn(argv: list[str], env: dict) -> dict:
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"turn failed: {done.stderr.strip()[-300:]}")
    return json.loads(done.stdout)


def measure(local: str, cloud: str, tokens: int, reps: int, env: dict) -> dict:
    ask = [sys.executable, "-m", "lanelock.testing", "client", "--json", "--max-tokens", str(tokens),
           "--prompt", "Write a short story about a lighthouse keeper."]
    backend = local.removeprefix("http://")
    primary = LANELOCK + ["run", "-q", "-b", backend, "--"] + ask + [local]
    import shlex

    gated_second = LANELOCK + ["run", "-q", "-b", backend, "-f", shlex.join(ask + [cloud]), "--"] \
        + ask + [local]
    ungated_second = ask + [local]
    results = {"alone": [], "ungated": [], "gated": []}
    second = {"ungated": [], "gated": []}
    turn(primary, env)   # warm the model and the page cache
    for _ in range(reps):
        results["alone"].append(turn(primary, env))
        for case, argv in (("ungated", ungated_second), ("gated", gated_second)):
            holder = {}
            thread = threading.Thread(target=lambda: holder.update(turn(primary, env)))
            thread.start()
            time.sleep(0.3)   # the primary is generating: now the second session arrives
            second[case].append(turn(argv, env))
            thread.join()
            results[case].append(holder)
    table = {}
    for case, answers in results.items():
        table[case] = {
            "primary_tok_s": statistics.median(a["timings"]["predicted_per_second"] for a in answers),
            "primary_latency_s": statistics.median(a["ended"] - a["started"] for a in answers),
        }
    for case, answers in second.items():
        table[case]["second_latency_s"] = statistics.median(a["ended"] - a["started"] for a in answers)
        table[case]["second_on"] = "local" if all(a["url"] == local for a in answers) else "fallback"
    return table


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--json", action="store_true", help="one flat JSON object for bench.py")
    args = parser.parse_args()
    if not real_engine_ready():
        return 2
    port, pid = start_real_engine(parallel=2)
    sys.path.insert(0, TOP)
    from lanelock import testing

    cloud = testing.make_server(0, 0.8, "cloud")
    threading.Thread(target=cloud.serve_forever, daemon=True).start()
    env = dict(os.environ, LANELOCK_DIR=tempfile.mkdtemp(prefix="lanelock-real-bench-"))
    try:
        table = measure(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{cloud.server_address[1]}",
                        args.tokens, args.reps, env)
    finally:
        stop_real_engine(pid)
        cloud.shutdown()
    if args.json:
        flat = {}
        for case, row in table.items():
            label = {"alone": "(a) alone", "ungated": "(b) beside an ungated 2nd session",
                     "gated": "(c) beside a gated 2nd session"}[case]
            flat[f"real engine {label}: primary tok/s, latency s"] = \
                f"{row['primary_tok_s']:.0f}, {row['primary_latency_s']:.2f}"
            if "second_latency_s" in row:
                flat[f"real engine {label}: 2nd session answer s (on)"] = \
                    f"{row['second_latency_s']:.2f} ({row['second_on']})"
        print(json.dumps(flat))
        return 0
    print(f"\n{time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, llama-server --parallel 2, "
          f"SmolLM2-135M Q4_1, {args.tokens} tokens, median of {args.reps}\n")
    print("| case | primary tok/s | primary latency (s) | 2nd session answer (s) | 2nd on |")
    print("| --- | --- | --- | --- | --- |")
    names = {"alone": "(a) alone", "ungated": "(b) 2nd session ungated",
             "gated": "(c) 2nd session gated by lanelock"}
    for case, row in table.items():
        print(f"| {names[case]} | {row['primary_tok_s']:.0f} | {row['primary_latency_s']:.2f} | "
              f"{row.get('second_latency_s', float('nan')):.2f} | {row.get('second_on', '-')} |")
    if sys.stdout.isatty():
        top = max(row["primary_tok_s"] for row in table.values())
        print()
        for case, row in table.items():
            bar = "█" * int(40 * row["primary_tok_s"] / top)
            print(f"{names[case]:<36} {bar} {row['primary_tok_s']:.0f} tok/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
