"""The proxy as a holder whose link to the PostgreSQL store is lost while the server stays up for
another host: it cuts its request before that host's turn can start, says so, and its loss is
journaled once the link is back, beside the other host's `took-over`.

The site (support/netns.py): two hosts, each a network namespace with its own hostname, and the
engine box (this namespace) where the stand-in engine and the server listen on its LAN address.
Host A's proxy reaches the server through a relay on the engine box (support/relay.py) that
resets, cuts or freezes its link; host B's turn reaches the server directly. Both key the one
lane of the engine's LAN address.
"""

from __future__ import annotations

import json
import subprocess
import sys
from urllib.parse import urlsplit

import pytest

from support.cli import LANELOCK, TIMEOUT, environ
from support.netns import ENGINE_IP, lan_engine, two_hosts
from support.processes import read_line, wait_for
from support.relay import Relay
from support.server import Server

pytest.importorskip("aiohttp")
pytest.importorskip("psycopg")

LISTENING = r"proxy listening on http://127\.0\.0\.1:(\d+)"
# The holding client: one streamed request through the proxy; "first STATUS STATE" once its
# first event is in, then "whole" or "cut" with the wall-clock moment (ns) its answer ended.
CLIENT = r"""
import http.client, json, sys, time

conn = http.client.HTTPConnection("127.0.0.1", int(sys.argv[1]), timeout=120)
conn.request("POST", "/v1/chat/completions",
             json.dumps({"model": "stand-in", "stream": True, "messages": []}),
             {"Content-Type": "application/json"})
response = conn.getresponse()
response.readline()
print("first", response.status, response.getheader("X-Lanelock-State"), flush=True)
try:
    while response.read1(65536):
        pass
    print("whole", time.time_ns(), flush=True)
except Exception:
    print("cut", time.time_ns(), flush=True)
"""
STAMP = 'date +%s%N > "$1"'


@pytest.fixture
def site(lock_roots, procs):
    """(host A, host B, the relay in front of the server for host A, the engine)."""
    host_a, host_b = two_hosts(lock_roots, ("host-a", "host-b"))
    relay = Relay(urlsplit(host_a.store).port, ENGINE_IP, listen=ENGINE_IP)
    lock_roots.after(relay.close)
    return host_a, host_b, relay, lan_engine(procs, tokens=100000, interval=0.05)


def history(host, backend: str) -> list[dict]:
    done = subprocess.run([*host.prefix, *LANELOCK, "history", "--store", host.store, "-b",
                           backend, "--json"], capture_output=True, text=True, env=environ(),
                          timeout=TIMEOUT)
    return json.loads(done.stdout)["events"]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["reset", "cut", "freeze"])
def test_the_proxy_cuts_its_request_before_another_hosts_turn_starts(site, procs, tmp_path, how):
    host_a, host_b, relay, engine = site
    proxy = Server(procs, [*host_a.prefix, *LANELOCK, "proxy", "--listen", "127.0.0.1:0", "-b",
                           engine.backend, "--store", relay.dsn()], LISTENING)
    client = procs.start([*host_a.prefix, sys.executable, "-c", CLIENT, str(proxy.port)],
                         stdout=subprocess.PIPE)
    assert read_line(client.stdout).split() == ["first", "200", "held"]
    other = tmp_path / "other"
    taker = procs.start([*host_b.prefix, *LANELOCK, "run", "--store", host_b.store, "-b",
                         engine.backend, "--wait", "120", "--", "sh", "-c", STAMP, "sh",
                         str(other)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                        env=environ())

    {"cut": relay.cut, "reset": relay.reset, "freeze": relay.freeze}[how]()

    ended = read_line(client.stdout, TIMEOUT * 2).split()
    assert ended[0] == "cut", ended   # no [DONE]: the answer was cut
    said = proxy.said("lost mid-request")
    assert "the lane store cannot be reached from here" in said, said
    relay.restore()   # the link back: the proxy journals its loss
    assert taker.wait(timeout=TIMEOUT * 2) == 0, taker.stderr.read()
    gap = (int(other.read_text()) - int(ended[1])) / 1e9
    print(f"{how}: the other host's command started {gap:.2f} s after the request was cut")
    assert gap > 0, "another host's turn started before the proxy's request was cut"

    def both() -> tuple:
        events = history(host_b, engine.backend)
        lost = [event for event in events if event.get("event") == "lost"]
        took = [event for event in events if event.get("event") == "took-over"]
        return (lost, took) if lost and took else None

    lost, took = wait_for(both, "the lost and took-over events", timeout=TIMEOUT)
    assert len(lost) == 1 and len(took) == 1, (lost, took)
    assert took[0]["from"]["turn"] == lost[0]["turn"], (lost, took)
    assert len([line for line in proxy.log().splitlines() if "lost mid-request" in line]) == 1
