"""The async turn and the proxy on PostgreSQL, end to end. Two `lanelock proxy`
processes on two hosts share one PostgreSQL store and one engine: many streaming clients through
both, and the engine never sees two generations at once; `kill -9` of the proxy that holds the lane
frees it within the documented bound, and the other host's proxy then holds it.

The site: this network namespace is the engine box -- the contention-detecting stand-in
(lanelock.testing.standin, strict) and the PostgreSQL server both listen on its LAN address
10.213.77.1. Each host is a network namespace with its own veth link to it and its own hostname
(`ip netns exec NS unshare --uts`), so each has its own loopback, its own "localhost" and its own
`hostname()`; its proxy listens on its own 127.0.0.1 and its clients run beside it. Both proxies
are given `-b 10.213.77.1:PORT`, a LAN address to both, so both key the one lane "10.213.77.1:PORT"
(`lanelock where --json` on each host says so). The engine box runs no lanelock of its own: there
10.213.77.1 is one of its own addresses, which lanelock keys as the per-host lane
"localhost:PORT@HOSTNAME" -- another lane.

Needs root, iproute2, util-linux's unshare and Debian's postgresql package; skipped without them.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from support.cli import LANELOCK, TIMEOUT
from support.processes import ExitWatch, read_line, wait_for
from support.server import Server
from support.netns import Host, lan_engine, two_hosts

pytest.importorskip("aiohttp")
pytest.importorskip("psycopg")

PYTHON = sys.executable
LISTENING = re.compile(r"proxy listening on http://127\.0\.0\.1:(\d+) for (\S+) \(lane ([^)]+)\)")
HOST_NAMES = ("host-a", "host-b")
CLIENTS_PER_HOST = 12

# One host's clients: COUNT streaming chat requests at once through the proxy on this host's
# loopback, let go together by a line on stdin. Each reads its answer to the end and reports the
# status, X-Lanelock-State, whether the stream ended with [DONE], and its monotonic times (one
# clock for every namespace): sent, answer headers, last byte. One JSON list on stdout.
CLIENTS_SCRIPT = """
import http.client, json, sys, threading, time

port, count, max_tokens = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
body = json.dumps({"model": "stand-in", "stream": True, "max_tokens": max_tokens,
                   "messages": [{"role": "user", "content": "hi"}]})
results = [None] * count

def client(index):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        sent = time.monotonic()
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        answered = time.monotonic()
        text = response.read().decode()
        results[index] = {"status": response.status,
                          "state": response.getheader("X-Lanelock-State"),
                          "done": text.rstrip().endswith("data: [DONE]"),
                          "tokens": text.count('"chat.completion.chunk"'),
                          "sent": sent, "answered": answered, "ended": time.monotonic()}
    except Exception as error:
        results[index] = {"error": repr(error)}
    finally:
        conn.close()

print("ready", flush=True)
sys.stdin.readline()
threads = [threading.Thread(target=client, args=(index,)) for index in range(count)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print(json.dumps(results), flush=True)
"""

# The holding client: one streaming request through this host's proxy. One JSON line once the
# answer's headers and first event are in (the lane is held and the engine generating), then reads
# on until the stream ends and says how: "eof", or the error.
HOLDING_SCRIPT = """
import http.client, json, sys

conn = http.client.HTTPConnection("127.0.0.1", int(sys.argv[1]), timeout=120)
conn.request("POST", "/v1/chat/completions",
             json.dumps({"model": "stand-in", "stream": True,
                         "messages": [{"role": "user", "content": "hi"}]}),
             {"Content-Type": "application/json"})
response = conn.getresponse()
first = response.readline()
print(json.dumps({"status": response.status, "state": response.getheader("X-Lanelock-State"),
                  "first": first.decode()}), flush=True)
try:
    while response.read1(65536):
        pass
    print("eof", flush=True)
except Exception as error:
    print(repr(error), flush=True)
"""


# -- the site ------------------------------------------------------------------------------------
class ProxyHost(Host):
    """A host of the site (netns.Host) that runs proxies and their clients."""

    def where(self, run_cmd, backend: str) -> dict:
        done = self.lanelock(run_cmd, "where", "--json", "-b", backend, "--store", self.store)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    def probe(self, run_cmd, backend: str) -> int:
        """`lanelock probe`'s exit status on this host: 0 free, 1 busy."""
        return self.lanelock(run_cmd, "probe", "-b", backend, "--store", self.store).returncode

    def proxy(self, procs, backend: str, *args) -> Server:
        """`lanelock proxy` on this host's loopback in front of the engine, started when its
        startup line has been read (conftest's Server). Its pid is the proxy's own: ip netns exec,
        unshare and sh all exec."""
        proxy = Server(procs, [*self.prefix, *LANELOCK, "proxy", "--listen", "127.0.0.1:0",
                               "-b", backend, "--store", self.store, *args], LISTENING.pattern)
        proxy.lane = proxy.found.group(3)
        command = psutil.Process(proxy.proc.pid).cmdline()
        assert command[:len(LANELOCK) + 1] == [*LANELOCK, "proxy"], command
        return proxy

    def start(self, procs, script: str, *args, **popen) -> subprocess.Popen:
        """A python script run on this host (its clients), stdout a pipe."""
        return procs.start([*self.prefix, PYTHON, "-c", script, *map(str, args)],
                           stdout=subprocess.PIPE, **popen)


@pytest.fixture
def hosts(lock_roots):
    """[host A, host B]: two hosts linked to this namespace, the engine box, where a PostgreSQL
    server listens on 10.213.77.1 and trusts both hosts' addresses (netns.two_hosts)."""
    return two_hosts(lock_roots, HOST_NAMES, ProxyHost)


def assert_one_lane(hosts, run_cmd, backend: str) -> None:
    """Both hosts key the engine as the one LAN lane, and each knows itself by its own name."""
    for host in hosts:
        where = host.where(run_cmd, backend)
        assert (where["lane"], where["scope"], where["store"]) == (backend, "lan", "postgresql"), \
            (host.hostname, where)
        named = run_cmd([*host.prefix, "hostname"])
        assert named.stdout.strip() == host.hostname, named


# -- many clients through both proxies ---------------------------------------------------------------
@pytest.mark.slow
def test_two_proxies_on_two_hosts_never_let_the_engine_see_two_generations(hosts, procs, run_cmd):
    engine = lan_engine(procs, tokens=8, interval=0.03)   # 7 gaps of 30 ms: ~0.2 s a generation
    assert_one_lane(hosts, run_cmd, engine.backend)
    proxies = [host.proxy(procs, engine.backend, "--wait", "60") for host in hosts]
    assert [proxy.lane for proxy in proxies] == [engine.backend] * 2

    go_read, go_write = os.pipe()
    clients = []
    try:
        for host, proxy in zip(hosts, proxies):
            clients.append(host.start(procs, CLIENTS_SCRIPT, proxy.port, CLIENTS_PER_HOST, 8,
                                      stdin=go_read))
        os.close(go_read)
        for client in clients:
            assert read_line(client.stdout) == "ready\n"
    finally:
        os.write(go_write, b"go\n" * len(clients))   # both hosts' clients go at once
        os.close(go_write)
    results = []
    for client in clients:
        out, _ = client.communicate(timeout=TIMEOUT * 2)
        assert client.returncode == 0
        results.append(json.loads(out))

    for host, answers in zip(hosts, results):
        assert all(answer.get("status") == 200 and answer["state"] == "held" and answer["done"]
                   and answer["tokens"] == 8 for answer in answers), (host.hostname, answers)
    stats = engine.stats()
    assert stats["max_in_flight"] == 1, stats
    assert stats["total"] == 2 * CLIENTS_PER_HOST and stats["hangups"] == 0, stats
    # Contention across hosts: every request of both hosts was sent while the first answer was
    # still streaming, so all but one waited for a lane that one request at a time could hold.
    every = [answer for answers in results for answer in answers]
    assert max(answer["sent"] for answer in every) < min(answer["ended"] for answer in every)
    # How often the lane changed host (PostgreSQL's queue order, not asserted: one host's whole
    # batch may queue first).
    granted = sorted((answer["answered"], index) for index, answers in enumerate(results)
                     for answer in answers)
    switches = sum(a[1] != b[1] for a, b in zip(granted, granted[1:]))
    waits = [answer["answered"] - answer["sent"] for answer in every]
    print(f"\n{CLIENTS_PER_HOST} held requests through each proxy, engine max in flight "
          f"{stats['max_in_flight']}, total {stats['total']}; the holder changed host {switches} "
          f"times; longest wait for the lane {max(waits):.2f} s")
    for host in hosts:
        assert host.probe(run_cmd, engine.backend) == 0   # free again, seen from either host
    for proxy in proxies:
        assert proxy.stop() == 0, proxy.log()


# -- kill -9 of the proxy holding the lane ------------------------------------------------------------
@pytest.mark.parametrize("killed", [0, pytest.param(1, marks=pytest.mark.slow)],
                         ids=HOST_NAMES)   # one host in the default tier, both in the slow
def test_kill_9_of_the_proxy_holding_the_lane_frees_it_for_the_other_host(killed, hosts, procs,
                                                                           run_cmd):
    from lanelock.store.pg.session import BOUND_SECONDS

    engine = lan_engine(procs, tokens=1200, interval=0.05)   # a minute-long stream unless cut
    assert_one_lane(hosts, run_cmd, engine.backend)
    holding_host, other_host = hosts[killed], hosts[1 - killed]
    holding_proxy = holding_host.proxy(procs, engine.backend)
    other_proxy = other_host.proxy(procs, engine.backend)

    holding = holding_host.start(procs, HOLDING_SCRIPT, holding_proxy.port)
    answer = json.loads(read_line(holding.stdout))
    assert (answer["status"], answer["state"]) == (200, "held"), answer
    assert answer["first"].startswith("data: "), answer   # the engine is generating for it
    assert other_host.probe(run_cmd, engine.backend) == 1   # busy, seen from the other host
    status = other_host.lanelock(run_cmd, "status", "--json", "-b", engine.backend,
                                 "--store", other_host.store)
    assert status.returncode == 0, status.stderr
    (lane,) = json.loads(status.stdout)["lanes"]
    # The other host's status names the holder: the proxy about to be killed, on its own host.
    assert (lane["state"], lane["holder"]["host"], lane["holder"]["pid"]) == \
        ("held", holding_host.hostname, holding_proxy.proc.pid), lane

    death = ExitWatch(holding_proxy.proc.pid)
    os.kill(holding_proxy.proc.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    death.wait()
    # Nothing reports a lane freed by a dead session: ask the store, as the other host would.
    probes = []
    wait_for(lambda: probes.append(other_host.probe(run_cmd, engine.backend)) or probes[-1] == 0,
             what="the lane to be free after the kill", timeout=BOUND_SECONDS + 10)
    freed_after = time.monotonic() - killed_at
    assert holding_proxy.wait() == -signal.SIGKILL
    assert read_line(holding.stdout) != "", "the holding client's stream did not end"

    client = other_host.start(procs, CLIENTS_SCRIPT, other_proxy.port, 1, 3,
                              stdin=subprocess.PIPE)
    assert read_line(client.stdout) == "ready\n"
    out, _ = client.communicate(b"go\n", timeout=TIMEOUT)
    (after,) = json.loads(out)
    assert (after.get("status"), after.get("state"), after.get("done")) == (200, "held", True), \
        after
    stats = engine.stats()
    assert (stats["max_in_flight"], stats["total"], stats["hangups"]) == (1, 2, 1), stats
    assert freed_after <= BOUND_SECONDS, f"lane freed {freed_after:.1f}s after the kill"
    print(f"\nkill -9 of {holding_host.hostname}'s proxy: lane free {freed_after:.2f} s later "
          f"(bound {BOUND_SECONDS} s; probe {len(probes)} from {other_host.hostname} was the "
          f"first to see it free), then held through {other_host.hostname}'s proxy")
    assert other_proxy.stop() == 0, other_proxy.log()
