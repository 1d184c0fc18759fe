#!/usr/bin/env python3
"""Does pinning a session to a slot save its prompt? The figure behind `proxy --pin-slots`.

    python bench/pinning.py [--turns 6] [--words 200] [--cache-ram default,0] [--json FILE]

A real llama-server (--parallel 2, SmolLM2-135M from scripts/real-backend) serves chat sessions,
each with its own long system prompt (--words of distinct text, a few hundred tokens) and a short
new user message every turn, the answers kept in the history as a client keeps them. The sessions
take turns one after another (A, B, A, B, ... or A, B, C, A, B, C, ...), --turns each, and every
returning turn records what the engine says it did: `timings.prompt_n` (prompt tokens it processed
again), `timings.cache_n` (tokens it found cached) and the time to the first streamed token.

Scenarios, each on a fresh server (no cache carried over):
  engine   no id_slot: llama-server picks the slot (--slot-prompt-similarity, then the least
           recently used), and may restore a prompt from its RAM cache (--cache-ram)
  pinned   id_slot = the session's seat, chosen as lanelock seats are: the free seat the session
           held last, else the free seat held least recently
for two sessions on two slots and three sessions on two slots, with llama-server's own prompt
cache in RAM (--cache-ram, 8 GiB by default) and without it (--cache-ram 0).

Run by hand (a few minutes on 2 cores); it is not part of any test tier.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import REAL_BACKEND, free_port, real_engine_ready, stop_real_engine  # noqa: E402

SLOTS = 2
WORDS = ("river stone lantern harbour copper meadow signal orchard glacier violin quarry thimble "
         "compass falcon ember ledger marble pepper saddle tunnel velvet walnut anchor beacon "
         "cinder dagger engine fabric garnet hollow island jasper kettle lagoon mirror needle "
         "oyster pillar quartz ribbon shadow timber umbrella vessel willow yonder zephyr basket "
         "canyon dolphin eclipse feather gravel harvest indigo juniper kernel lilac mosaic nectar "
         "orbit parcel quiver rocket silver tundra").split()


def system_prompt(session: str, words: int) -> str:
    """Distinct text per session: the same seed gives the same prompt in every scenario."""
    rng = random.Random(f"pinning-{session}")
    facts = []
    for index in range(words // 10):
        facts.append(f"Fact {index + 1}: the {' '.join(rng.choice(WORDS) for _ in range(8))}.")
    return (f"You are the archivist of session {session}. Remember these facts and answer "
            f"briefly. " + " ".join(facts))


def start_engine(cache_ram: str, threads: int) -> tuple[str, int]:
    port = free_port()
    argv = REAL_BACKEND + ["start", "--port", str(port), "--parallel", str(SLOTS),
                           "--threads", str(threads)]
    if cache_ram != "default":
        argv += ["--cache-ram", cache_ram]
    pid = int(subprocess.run(argv, capture_output=True, text=True, check=True).stdout)
    return f"http://127.0.0.1:{port}", pid


def turn(url: str, messages: list, slot: int | None, tokens: int) -> dict:
    """One streamed chat turn: the answer, its timings and the time to the first token."""
    body = {"messages": messages, "max_tokens": tokens, "temperature": 0, "seed": 1,
            "stream": True}
    if slot is not None:
        body["id_slot"] = slot
    request = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    started = time.monotonic()
    first, text, timings = None, [], None
    with urllib.request.urlopen(request, timeout=600) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            for choice in event.get("choices", []):
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    if first is None:
                        first = time.monotonic()
                    text.append(piece)
            timings = event.get("timings") or timings
    return {"text": "".join(text), "timings": timings or {},
            "ttft_ms": ((first or time.monotonic()) - started) * 1000}


class Seats:
    """lanelock's choice of seat for a turn, all seats free (the turns come one at a time): the
    seat the session held last, else the seat held least recently."""

    def __init__(self, count: int):
        self.used = [-1] * count      # when each seat was last taken
        self.last: dict[str, int] = {}
        self.clock = 0

    def take(self, session: str) -> int:
        seat = self.last.get(session)
        if seat is None:
            seat = min(range(len(self.used)), key=lambda index: self.used[index])
        self.clock += 1
        self.used[seat] = self.clock
        self.last[session] = seat
        return seat


def scenario(url: str, sessions: list[str], pinned: bool, turns: int, words: int,
             tokens: int) -> list[dict]:
    histories = {name: [{"role": "system", "content": system_prompt(name, words)}]
                 for name in sessions}
    seats = Seats(SLOTS)
    rows = []
    for round_ in range(turns):
        for name in sessions:
            history = histories[name]
            history.append({"role": "user", "content": f"Turn {round_ + 1}: what is fact "
                                                       f"{round_ + 1}? One line."})
            slot = seats.take(name) if pinned else None
            answer = turn(url, history, slot, tokens)
            history.append({"role": "assistant", "content": answer["text"]})
            rows.append({"session": name, "round": round_, "slot": slot,
                         "prompt_n": answer["timings"].get("prompt_n"),
                         "cache_n": answer["timings"].get("cache_n"),
                         "prompt_ms": answer["timings"].get("prompt_ms"),
                         "ttft_ms": answer["ttft_ms"]})
    return rows


def summary(rows: list[dict]) -> dict:
    returning = [row for row in rows if row["round"] > 0]
    prompt = [row["prompt_n"] for row in returning]
    cached = [row["cache_n"] for row in returning]
    full = [row for row in returning if row["cache_n"] is not None and row["cache_n"] < 32]
    return {"turns": len(returning), "prompt_n_median": statistics.median(prompt),
            "prompt_n_total": sum(prompt), "cache_n_median": statistics.median(cached),
            "whole_prompt_again": len(full),
            "ttft_ms_median": statistics.median(row["ttft_ms"] for row in returning),
            "prompt_ms_median": statistics.median(row["prompt_ms"] for row in returning),
            "first_prompt_n": statistics.median(row["prompt_n"] for row in rows
                                                if row["round"] == 0)}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--turns", type=int, default=6, help="turns per session")
    parser.add_argument("--words", type=int, default=200, help="words in each system prompt")
    parser.add_argument("--tokens", type=int, default=24, help="tokens in each answer")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cache-ram", default="default,0",
                        help="llama-server --cache-ram values to run, comma-separated "
                             "('default': not given, 8 GiB)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="runs of each scenario, the order of engine and pinned swapped "
                             "each time (a shared machine's load falls on both alike)")
    parser.add_argument("--json", metavar="FILE", help="also write every turn here, as JSON")
    args = parser.parse_args()
    if not real_engine_ready():
        return 2
    results = []
    for cache_ram in args.cache_ram.split(","):
        for sessions, repeat in [(names, repeat) for names in (["A", "B"], ["A", "B", "C"])
                                 for repeat in range(args.repeat)]:
            for pinned in ((False, True) if repeat % 2 == 0 else (True, False)):
                url, pid = start_engine(cache_ram, args.threads)
                try:
                    rows = scenario(url, sessions, pinned, args.turns, args.words, args.tokens)
                finally:
                    stop_real_engine(pid)
                results.append({"cache_ram": cache_ram, "sessions": len(sessions),
                                "pinned": pinned, "repeat": repeat, "rows": rows,
                                **summary(rows)})
                print(f"pinning: cache-ram {cache_ram}, {len(sessions)} sessions, "
                      f"{'pinned' if pinned else 'engine'}: done", file=sys.stderr, flush=True)
    if args.json:
        with open(args.json, "w") as sink:
            json.dump(results, sink, indent=1)
    print(table(results, args.turns, args.tokens, args.threads))
    return 0


def table(results: list[dict], turns: int, tokens: int, threads: int) -> str:
    lines = [f"\n{time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, llama-server --parallel "
             f"{SLOTS} --threads {threads}, SmolLM2-135M Q4_1; a system prompt of "
             f"~{results[0]['first_prompt_n']:.0f} tokens per session, {turns} turns each, "
             f"{tokens}-token answers; returning turns only\n"]
    lines.append("| --cache-ram | sessions on 2 slots | slot | prompt tokens re-processed (median / "
                 "total) | cached tokens (median) | whole prompt again | engine's prompt time "
                 "(median ms) | first token (median ms) |")
    lines.append("| --- | --- | --- | --- | --- | --- | --- | --- |")
    caches = list(dict.fromkeys(result["cache_ram"] for result in results))
    for result in sorted(results, key=lambda result: (
            caches.index(result["cache_ram"]), result["sessions"], result["pinned"],
            result.get("repeat", 0))):
        lines.append(f"| {result['cache_ram']} | {result['sessions']} | "
                     f"{'pinned (id_slot = seat)' if result['pinned'] else 'engine chooses'} | "
                     f"{result['prompt_n_median']:.0f} / {result['prompt_n_total']} | "
                     f"{result['cache_n_median']:.0f} | {result['whole_prompt_again']} of "
                     f"{result['turns']} | {result.get('prompt_ms_median', float('nan')):.0f} | "
                     f"{result['ttft_ms_median']:.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
