#!/usr/bin/env python3
"""Whether `lanelock proxy` keeps its memory flat under load (run by hand; not a test).

    python bench/proxy_memory.py [--warm-up 1000] [--requests 10000] [--clients 8]

The stand-in engine, a second stand-in as a URL fallback, and a proxy; an aiohttp client sends
rounds of 2,000 requests: half on a free lane one at a time (plain and streamed, OpenAI chat and
completions, llama.cpp's /completion, Anthropic messages; a new session per request and seven
recurring ones), half while a `lanelock run` holder holds the lane, --clients at once (busy
answers, and deflections to the fallback). The proxy's VmRSS is read after the warm-up and after
each round. Target: < 10% growth after the warm-up (tests/test_proxy_memory.py holds the same
bound in the slow tier). Prints a markdown table with PASS/MISS.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import free_port, wait_port  # noqa: E402

LANELOCK = [sys.executable, "-m", "lanelock"]
ROUND = 2_000
RECURRING = 7


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def shaped(number: int) -> tuple[str, bytes, dict]:
    """(path, body, headers) of request `number` (as tests/test_proxy_memory.py shapes them)."""
    session = f"s{number % RECURRING}" if number % 3 == 0 else f"session-{number}"
    stream = number % 2 == 0
    kind = number % 5
    if kind in (0, 1):
        body = {"model": "stand-in", "stream": stream, "max_tokens": 4, "user": session,
                "messages": [{"role": "user", "content": "hi"}]}
        return "/v1/chat/completions", json.dumps(body).encode(), {}
    if kind == 2:
        body = {"model": "stand-in", "prompt": "hi", "max_tokens": 4, "stream": stream}
        return "/v1/completions", json.dumps(body).encode(), {"X-Lanelock-Session": session}
    if kind == 3:
        body = {"prompt": "hi", "n_predict": 4, "stream": stream}
        return "/completion", json.dumps(body).encode(), {"X-Lanelock-Session": session}
    body = {"model": "stand-in", "max_tokens": 4, "metadata": {"user_id": session},
            "messages": [{"role": "user", "content": "hi"}]}
    return "/v1/messages", json.dumps(body).encode(), {}


async def drive(port: int, numbers: range, concurrent: int, answers: dict) -> None:
    import aiohttp

    left = iter(numbers)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrent)) as session:
        async def client():
            for number in left:
                path, body, headers = shaped(number)
                async with session.post(f"http://127.0.0.1:{port}{path}", data=body, headers={
                        "Content-Type": "application/json", **headers}) as answer:
                    await answer.read()
                    key = f"{answer.status} {answer.headers.get('X-Lanelock-State')}"
                    answers[key] = answers.get(key, 0) + 1

        await asyncio.gather(*(client() for _ in range(concurrent)))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--warm-up", type=int, default=1_000)
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--clients", type=int, default=8)
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="lanelock-proxy-memory-")
    env = dict(os.environ, LANELOCK_DIR=os.path.join(work, "locks"),
               LANELOCK_CONFIG=os.path.join(work, "none.toml"),
               LANELOCK_SYSTEM_CONFIG=os.path.join(work, "none.toml"))
    procs = []
    sent = 0
    answers: dict = {}

    def one_round(size: int) -> None:
        nonlocal sent
        busy = size // 2
        asyncio.run(drive(proxy_port, range(sent, sent + size - busy), 1, answers))
        holder = subprocess.Popen(LANELOCK + ["run", "-b", backend, "--", "sh", "-c",
                                              "echo ready; read x"],
                                  env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        holder.stdout.readline()   # its command runs: the lane is held
        asyncio.run(drive(proxy_port, range(sent + size - busy, sent + size), args.clients,
                          answers))
        holder.communicate(b"0\n")
        sent += size

    try:
        engine_port, fallback_port, proxy_port = free_port(), free_port(), free_port()
        for port in (engine_port, fallback_port):
            procs.append(subprocess.Popen([sys.executable, "-m", "lanelock.testing", "serve",
                                           "--port", str(port), "--delay", "0", "--tokens", "4",
                                           "--token-interval", "0"], env=env))
            wait_port(port, procs[-1])
        backend = f"127.0.0.1:{engine_port}"
        proxy = subprocess.Popen(LANELOCK + ["proxy", "-q", "--listen", f"127.0.0.1:{proxy_port}",
                                             "-b", backend, "--fallback",
                                             f"http://127.0.0.1:{fallback_port}/v1"], env=env)
        procs.append(proxy)
        wait_port(proxy_port, proxy)
        started = rss_mib(proxy.pid)
        one_round(args.warm_up)
        before = rss_mib(proxy.pid)
        print(f"  RSS {started:.1f} MiB at start, {before:.1f} after {args.warm_up} requests",
              file=sys.stderr, flush=True)
        clock = time.monotonic()
        afters = []
        while sent < args.warm_up + args.requests:
            one_round(min(ROUND, args.warm_up + args.requests - sent))
            afters.append(rss_mib(proxy.pid))
            print(f"  RSS {afters[-1]:.1f} MiB after {sent} requests", file=sys.stderr,
                  flush=True)
        took = time.monotonic() - clock
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
        shutil.rmtree(work, ignore_errors=True)
    growth = afters[-1] / before - 1
    per_request = (afters[-1] - before) * 1024 * 1024 / args.requests
    rows = [
        ("proxy RSS at start / after the warm-up", f"{started:.1f} / {before:.1f} MiB "
         f"({args.warm_up} requests)", "", ""),
        (f"after {args.requests} more (each {ROUND})",
         " / ".join(f"{value:.1f}" for value in afters) + f" MiB ({took:.0f} s)", "", ""),
        ("growth after the warm-up", f"{growth:+.1%} ({per_request:+.0f} bytes a request)",
         "< 10%", "PASS" if growth < 0.10 else "MISS"),
        ("answers", ", ".join(f"{count} {key}" for key, count in sorted(answers.items())),
         "", ""),
    ]
    print("| measure | value | target | |\n| --- | --- | --- | --- |")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
