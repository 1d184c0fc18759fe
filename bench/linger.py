#!/usr/bin/env python3
"""What `lanelock proxy --linger` buys on a real engine (run by hand; not a test).

    python bench/linger.py [--rounds 6] [--linger 3]

llama-server with one slot (--parallel 1, prompt cache on) and SmolLM2-135M. Session A is an
agent's tool-call loop: a conversation of ~1,600 tokens that grows each round; between its
requests a tool "runs" for a moment, and session B asks a short question meanwhile. B's question
evicts A's conversation from the engine's only slot, so A's next request must process its whole
history again -- unless the lane lingers for A and B goes to the fallback (a stand-in: a cloud).

Three ways, A's time to first token per round (median over rounds after the first):
  ungated          both sessions talk to the engine directly;
  proxy            both through `lanelock proxy` (no linger): B takes the lane between A's requests;
  proxy --linger   the lane stays A's between its requests; B is deflected to the fallback.
Needs scripts/real-backend build && scripts/real-backend model.
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
from common import free_port, real_engine_ready, wait_port  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
TOP = os.path.dirname(HERE)
SCRIPT = [sys.executable, os.path.join(TOP, "scripts", "real-backend")]
LANELOCK = [sys.executable, "-m", "lanelock"]
HISTORY = " ".join(f"Fact {n}: the lighthouse on island {n} has {n % 7 + 2} lamps and a keeper "
                   f"named Keeper{n}." for n in range(90))






def ask(port: int, messages: list, session: str, tokens: int = 8) -> tuple[float, str, str]:
    """(seconds to the first streamed token, the answer, X-Lanelock-State) of one request."""
    import http.client

    body = json.dumps({"messages": messages, "max_tokens": tokens, "stream": True,
                       "temperature": 0, "cache_prompt": True}).encode()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    start = time.perf_counter()
    connection.request("POST", "/v1/chat/completions", body,
                       {"Content-Type": "application/json", "X-Lanelock-Session": session})
    response = connection.getresponse()
    state = response.getheader("X-Lanelock-State") or "-"
    first, text = None, ""
    for line in response:
        if line.startswith(b"data: {"):
            if first is None:
                first = time.perf_counter() - start
            delta = json.loads(line[6:])["choices"][0]
            text += (delta.get("delta") or {}).get("content") or delta.get("text") or ""
    connection.close()
    return (first if first is not None else float("nan")), text, state


def run_case(a_port: int, b_port: int, rounds: int, pause: float, salt: str) -> list[float]:
    # salt: every case starts from a prompt the engine has not cached yet
    messages = [{"role": "system", "content": f"[{salt}] You answer briefly. Known facts: "
                                              + HISTORY}]
    firsts = []
    for index in range(rounds):
        messages.append({"role": "user", "content": f"Question {index}: how many lamps on "
                                                    f"island {index}?"})
        first, text, _ = ask(a_port, messages, "agent-A")
        firsts.append(first)
        messages.append({"role": "assistant", "content": text or "ok"})
        # the tool runs; meanwhile session B asks something short
        other = threading.Thread(target=ask, args=(b_port, [{"role": "user", "content":
                                                              f"Say hi {index}."}], "chat-B"))
        other.start()
        other.join()
        time.sleep(pause)
    return firsts


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--linger", type=float, default=3.0)
    parser.add_argument("--pause", type=float, default=0.3, help="the tool's run between requests")
    args = parser.parse_args()
    if not real_engine_ready():
        return 2
    work = tempfile.mkdtemp(prefix="lanelock-linger-")
    env = dict(os.environ, LANELOCK_DIR=os.path.join(work, "locks"))
    tables = {}
    for cache_ram in (0, None):   # without, then with llama-server's host prompt cache
        tables[cache_ram] = measure_engine(cache_ram, args, env)
    print(f"\n{time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, llama-server --parallel 1, "
          f"SmolLM2-135M Q4_1, session A ~1,600 tokens of history growing per round, "
          f"{args.rounds} rounds, B asks between A's requests\n")
    print("| llama-server | how | A's time to first token, median of rounds 2.. (s) | "
          "each round (s) |")
    print("| --- | --- | --- | --- |")
    for cache_ram, results in tables.items():
        engine = "--cache-ram 0" if cache_ram == 0 else "default prompt cache (8 GiB RAM)"
        for label, firsts in results.items():
            print(f"| {engine} | {label} | {statistics.median(firsts[1:]):.2f} | "
                  f"{', '.join(f'{value:.2f}' for value in firsts)} |")
    return 0


def measure_engine(cache_ram, args, env) -> dict:
    engine_port, cloud_port = free_port(), free_port()
    extra = [] if cache_ram is None else ["--cache-ram", str(cache_ram)]
    pid = int(subprocess.run(SCRIPT + ["start", "--port", str(engine_port), "--parallel", "1",
                                       *extra], capture_output=True, text=True,
                             check=True).stdout)
    procs = []
    results = {}
    try:
        cloud = subprocess.Popen([sys.executable, "-m", "lanelock.testing", "serve", "--port",
                                  str(cloud_port), "--delay", "0.2", "--name", "cloud"], env=env)
        procs.append(cloud)
        wait_port(cloud_port, cloud)
        ask(engine_port, [{"role": "user", "content": "warm up"}], "warm")
        results["ungated"] = run_case(engine_port, engine_port, args.rounds, args.pause, "u")
        for label, linger in (("proxy", 0.0), (f"proxy --linger {args.linger:g}", args.linger)):
            port = free_port()
            proxy = subprocess.Popen(LANELOCK + ["proxy", "-q", "--listen", f"127.0.0.1:{port}",
                                                 "-b", f"127.0.0.1:{engine_port}", "--fallback",
                                                 f"http://127.0.0.1:{cloud_port}/v1",
                                                 "--linger", str(linger)], env=env)
            procs.append(proxy)
            wait_port(port, proxy)
            results[label] = run_case(port, port, args.rounds, args.pause, label)
            proxy.terminate()
            proxy.wait(timeout=30)
    finally:
        for proc in procs:
            proc.terminate()
        subprocess.run(SCRIPT + ["stop", str(pid)], capture_output=True)
    return results


if __name__ == "__main__":
    sys.exit(main())
