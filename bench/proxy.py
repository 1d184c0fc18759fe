#!/usr/bin/env python3
"""What `lanelock proxy` costs, on loopback against the stand-in engine (run by hand; not a test).

    python bench/proxy.py [--requests 200] [--skip-litellm] [--litellm PATH]

Measures, side by side in one run: time to first byte of a streamed answer (p50/p95), direct and
through the proxy (which takes the lane per request), and through LiteLLM's proxy (one worker) when
its console script is given or found; the relay rate of a long stream (events/s); the proxy's RSS;
and 200 concurrent idle keep-alive connections. Targets: <= 1 ms added p50, >= 0.95x direct relay
rate. Prints a markdown table with PASS/MISS.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import free_port, streamed, wait_port  # noqa: E402

LANELOCK = [sys.executable, "-m", "lanelock"]
ROWS: list[tuple[str, str, str, str]] = []


def row(name, value, target="", ok=None):
    ROWS.append((name, value, target, "" if ok is None else ("PASS" if ok else "MISS")))
    print(f"  {name}: {value} {ROWS[-1][3]}", file=sys.stderr, flush=True)






BODY = b'{"model":"stand-in","stream":true,"max_tokens":%d,"messages":[{"role":"user","content":"hi"}]}'


def stream_once(port: int, tokens: int, path: str = "/v1/chat/completions",
                headers: str = "") -> tuple[float, float, int]:
    """(seconds to the first byte of the body, seconds to the end, events) over a new
    connection: the same plain client for every target."""
    body = BODY % tokens
    request = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json"
               f"\r\nContent-Length: {len(body)}\r\nConnection: close\r\n{headers}\r\n").encode() + body
    first, total, data = streamed(port, request)
    return first or float("nan"), total, data.count(b"data: {")


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def pct(values, fraction):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(fraction * (len(ordered) - 1))))]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--skip-litellm", action="store_true")
    parser.add_argument("--litellm", default=shutil.which("litellm") or
                        ("/tmp/litellm-venv/bin/litellm"
                         if os.path.exists("/tmp/litellm-venv/bin/litellm") else None))
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="lanelock-proxy-bench-")
    env = dict(os.environ, LANELOCK_DIR=os.path.join(work, "locks"),
               LANELOCK_CONFIG=os.path.join(work, "none.toml"),
               LANELOCK_SYSTEM_CONFIG=os.path.join(work, "none.toml"))
    procs = []
    try:
        engine_port, proxy_port = free_port(), free_port()
        engine = subprocess.Popen([sys.executable, "-m", "lanelock.testing", "serve", "--port",
                                   str(engine_port), "--delay", "0.01", "--tokens", "20",
                                   "--token-interval", "0.002"], env=env)
        procs.append(engine)
        wait_port(engine_port, engine)
        proxy = subprocess.Popen(LANELOCK + ["proxy", "-q", "--listen", f"127.0.0.1:{proxy_port}",
                                             "-b", f"127.0.0.1:{engine_port}"], env=env)
        procs.append(proxy)
        wait_port(proxy_port, proxy)
        targets = {"direct": engine_port, "lanelock proxy": proxy_port}
        if args.litellm and not args.skip_litellm:
            litellm_port = free_port()
            config = os.path.join(work, "litellm.yaml")
            with open(config, "w") as handle:
                handle.write("model_list:\n  - model_name: stand-in\n    litellm_params:\n"
                             f"      model: openai/stand-in\n      api_base: http://127.0.0.1:"
                             f"{engine_port}/v1\n      api_key: none\n")
            litellm = subprocess.Popen([args.litellm, "--config", config, "--port",
                                        str(litellm_port), "--num_workers", "1"],
                                       env=dict(env, LITELLM_LOG="ERROR"),
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            procs.append(litellm)
            wait_port(litellm_port, litellm, timeout=180)
            targets["LiteLLM 1.80.0 proxy"] = litellm_port
        for port in targets.values():   # warm up
            for _ in range(5):
                stream_once(port, 20)
        firsts = {name: [] for name in targets}
        for _ in range(args.requests):   # interleaved: noise hits every target alike
            for name, port in targets.items():
                firsts[name].append(stream_once(port, 20)[0] * 1000)
        direct50, direct95 = pct(firsts["direct"], 0.5), pct(firsts["direct"], 0.95)
        for name, values in firsts.items():
            p50, p95 = pct(values, 0.5), pct(values, 0.95)
            if name == "direct":
                row("time to first byte, direct (p50 / p95)", f"{p50:.2f} / {p95:.2f} ms")
                continue
            ok = (p50 - direct50) <= 1.0 if name == "lanelock proxy" else None
            row(f"time to first byte via {name}: added p50 / p95",
                f"{p50 - direct50:+.2f} / {p95 - direct95:+.2f} ms ({p50:.2f} / {p95:.2f} ms)",
                "<= 1 ms p50" if ok is not None else "", ok)
        # relay rate: one long stream as fast as the engine can send it
        subprocess.run([sys.executable, "-c", "pass"])
        fast_port, fast_proxy_port = free_port(), free_port()
        fast = subprocess.Popen([sys.executable, "-m", "lanelock.testing", "serve", "--port",
                                 str(fast_port), "--token-interval", "0"], env=env)
        procs.append(fast)
        wait_port(fast_port, fast)
        fast_proxy = subprocess.Popen(LANELOCK + ["proxy", "-q", "--listen",
                                                  f"127.0.0.1:{fast_proxy_port}", "-b",
                                                  f"127.0.0.1:{fast_port}"], env=env)
        procs.append(fast_proxy)
        wait_port(fast_proxy_port, fast_proxy)
        rates = {"direct": [], "lanelock proxy": []}
        for _ in range(5):   # interleaved
            for name, port in (("direct", fast_port), ("lanelock proxy", fast_proxy_port)):
                _, total, events = stream_once(port, 4000)
                rates[name].append(events / total)
        rates = {name: statistics.median(values) for name, values in rates.items()}
        ratio = rates["lanelock proxy"] / rates["direct"]
        row("relay rate, 4000-event stream (direct / proxy)",
            f"{rates['direct']:.0f} / {rates['lanelock proxy']:.0f} events/s: {ratio:.2f}x",
            ">= 0.95x", ratio >= 0.95)
        # 200 idle client connections, each after a request (keep-alive), to the proxy
        before = rss_mib(proxy.pid)
        idle = []
        for _ in range(200):
            sock = socket.create_connection(("127.0.0.1", proxy_port))
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2"
                         b"\r\n\r\n{}")
            sock.recv(65536)
            idle.append(sock)
        under_load = [stream_once(proxy_port, 20)[0] * 1000 for _ in range(50)]
        row("proxy RSS: after the runs / with 200 idle keep-alive connections",
            f"{before:.1f} / {rss_mib(proxy.pid):.1f} MiB (TTFB p50 {pct(under_load, 0.5):.2f} ms "
            "with them open)")
        for sock in idle:
            sock.close()
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
        shutil.rmtree(work, ignore_errors=True)
    print("| measure | value | target | |\n| --- | --- | --- | --- |")
    for name, value, target, verdict in ROWS:
        print(f"| {name} | {value} | {target} | {verdict} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
