"""The witness on the PostgreSQL store, across hosts: host A's `lanelock watch` reads
the engine box's account and the lane through the store, so a turn held on host B covers the
engine's generation -- and a client of host B that bypasses lanelock is still seen.

The site is test_pg_proxy.py's (support/netns.py): the stand-in engine and PostgreSQL on the engine
box's LAN address 10.213.77.1, two hosts in network namespaces with their own hostnames. Needs
root, iproute2, util-linux's unshare and Debian's postgresql package; skipped without them.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from support.cli import LANELOCK, TIMEOUT
from support.processes import read_line
from support.netns import Host, lan_engine, two_hosts

pytest.importorskip("psycopg")
pytest.importorskip("aiohttp")   # test_pg_proxy's site imports it

PYTHON = sys.executable


@pytest.mark.slow   # the default tier's time: the slow tier (CI) runs it
def test_a_turn_held_on_another_host_covers_the_engine_and_a_bypass_is_seen(lock_roots, procs,
                                                                             run_cmd):
    host_a, host_b = two_hosts(lock_roots, ("host-a", "host-b"), Host)
    engine = lan_engine(procs, tokens=10, interval=0.08)   # a generation: 0.8 s
    url = f"http://{engine.backend}"
    watch = procs.start([*host_a.prefix, *LANELOCK, "watch", "-b", engine.backend, "--store",
                         host_a.store, "--interval", "0.2"], stdout=subprocess.DEVNULL,
                        stderr=subprocess.PIPE)
    lines = [read_line(watch.stderr)]
    assert f"watching the engine at {url} (llama.cpp, /slots) for lane {engine.backend}" \
        in lines[0], lines
    client = [PYTHON, "-m", "lanelock.testing", "client", url]
    for _ in range(3):   # turns held on host B, through the store
        done = host_b.lanelock(run_cmd, "run", "-b", engine.backend, "--store", host_b.store,
                               "--", *client)
        assert done.returncode == 0, done.stderr
    bypass = run_cmd([*host_b.prefix, *client])   # host B, straight to the engine
    assert bypass.returncode == 0, bypass.stderr
    while "unseen generation" not in lines[-1]:
        lines.append(read_line(watch.stderr))
        assert lines[-1], lines
    watch.terminate()
    lines += watch.stderr.read().decode(errors="replace").splitlines()
    assert watch.wait(TIMEOUT) == 0
    unseen = [line for line in lines if "unseen generation" in line]
    assert len(unseen) == 1 and "while no turn held the lane" in unseen[0], lines
    assert engine.stats()["total"] == 4
    history = host_b.lanelock(run_cmd, "history", "-b", engine.backend, "--store", host_b.store,
                              "--json")
    import json

    events = json.loads(history.stdout)["events"]
    assert [event["event"] for event in events].count("acquired") == 3
    (event,) = [event for event in events if event["event"] == "unseen"]
    assert (event["turns"], event["witness"]) == (0, "watch")
