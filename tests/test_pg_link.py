"""A holder whose link to the PostgreSQL store is lost while the server stays up for the others:
not a restart. Its link goes through a relay (support/relay.py) that cuts, resets or freezes it;
another host (its own hostname) reaches the server directly. Under `--on-lost stop` the holder's
command is stopped before the other host's command starts (both commands stamp the moment); by
default the holder goes on, says so, and both sides journal the overlap once its link is back.
"""

from __future__ import annotations

import subprocess

import pytest

from support.cli import LANELOCK, TIMEOUT, environ
from support.processes import line_with, read_line
from support.relay import Relay

pg_server = pytest.importorskip("support.pg_server")
pytest.importorskip("psycopg")

LANE = "gpu-box.lan:8080"   # one lane for every host (not a loopback spelling)
# The holder's command: its start, then its stop (SIGTERM) stamped in the files $1 and $2.
HOLDER = ('date +%s%N > "$1"; trap \'date +%s%N > "$2"; exit 0\' TERM; echo ready; '
          'while :; do sleep 0.05; done')
GOING_ON = 'echo ready; read go; exit 4'
STAMP = 'date +%s%N > "$1"'


def on_host(name: str) -> list[str]:
    """A command's words run under its own hostname (another host, for the lane store)."""
    return ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', name]


@pytest.fixture
def server(private_postgres):
    return private_postgres


@pytest.fixture
def relay(server, lock_roots):
    relay = Relay(server.port)
    lock_roots.after(relay.close)
    return relay


def history(dsn: str) -> list[dict]:
    import json

    result = subprocess.run([*LANELOCK, "history", "--store", dsn, "-b", LANE, "--json"],
                            capture_output=True, text=True, env=environ(), timeout=TIMEOUT)
    return json.loads(result.stdout)["events"]


def break_link(relay: Relay, how: str) -> None:
    {"cut": relay.cut, "reset": relay.reset, "freeze": relay.freeze}[how]()


@pytest.mark.slow
@pytest.mark.parametrize("how", ["reset", "cut", "freeze"])
def test_on_lost_stop_stops_the_holder_before_another_host_starts(server, relay, procs,
                                                                  tmp_path, how):
    started, stopped, other = (tmp_path / name for name in ("started", "stopped", "other"))
    holder = procs.start([*on_host("host-a"), *LANELOCK, "run", "--store", relay.dsn(), "-b",
                          LANE, "--on-lost", "stop", "--", "sh", "-c", HOLDER, "sh",
                          str(started), str(stopped)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=environ())
    assert read_line(holder.stdout) == "ready\n"
    taker = procs.start([*on_host("host-b"), *LANELOCK, "run", "--store", server.dsn, "-b",
                         LANE, "--wait", "120", "--", "sh", "-c", STAMP, "sh", str(other)],
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=environ())

    break_link(relay, how)

    said = line_with(holder.stderr, " lost:")
    assert "stopping the command (--on-lost stop)" in said, said
    relay.restore()   # the link back: the holder journals its loss
    assert holder.wait(timeout=TIMEOUT) == 75
    assert taker.wait(timeout=TIMEOUT * 2) == 0, taker.stderr.read()
    gap = (int(other.read_text()) - int(stopped.read_text())) / 1e9
    print(f"{how}: the other host's command started {gap:.2f} s after the holder's stopped")
    assert gap > 0, "another host's command started before the holder's was stopped"
    events = history(server.dsn)
    lost = [event for event in events if event.get("event") == "lost"]
    assert len(lost) == 1, events


@pytest.mark.slow
def test_by_default_a_reset_holder_goes_on_and_both_sides_journal_the_overlap(server, relay,
                                                                             procs, tmp_path):
    other = tmp_path / "other"
    holder = procs.start([*on_host("host-a"), *LANELOCK, "run", "--store", relay.dsn(), "-b",
                          LANE, "--", "sh", "-c", GOING_ON],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=environ())
    assert read_line(holder.stdout) == "ready\n"
    taker = procs.start([*on_host("host-b"), *LANELOCK, "run", "--store", server.dsn, "-b",
                         LANE, "--wait", "120", "--", "sh", "-c", STAMP, "sh", str(other)],
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=environ())

    relay.reset()

    said = line_with(holder.stderr, " lost:")
    assert "the command goes on, no longer gated" in said, said
    assert taker.wait(timeout=TIMEOUT * 2) == 0
    relay.restore()
    holder.stdin.write(b"go\n")
    holder.stdin.close()
    assert holder.wait(timeout=TIMEOUT) == 4
    events = history(server.dsn)
    lost = [event for event in events if event.get("event") == "lost"]
    took = [event for event in events if event.get("event") == "took-over"]
    assert len(lost) == 1 and len(took) == 1, events
    assert took[0]["from"]["turn"] == lost[0]["turn"]
    assert took[0]["overlap"] and took[0]["overlap"] > 0, took


@pytest.mark.slow
def test_a_frozen_link_keeps_no_lane_after_its_holder_ended(server, relay, procs, tmp_path):
    """The holder's command ends while its link is frozen: its release gives up, and the server
    ends the silent session when its lease runs out -- the lane is not kept for ever."""
    import time

    holder = procs.start([*on_host("host-a"), *LANELOCK, "run", "--store", relay.dsn(), "-b",
                          LANE, "--", "sh", "-c", GOING_ON],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=environ())
    assert read_line(holder.stdout) == "ready\n"
    relay.freeze()
    frozen = time.monotonic()
    holder.stdin.write(b"go\n")
    holder.stdin.close()
    assert holder.wait(timeout=TIMEOUT) == 4
    taker = procs.start([*on_host("host-b"), *LANELOCK, "run", "--store", server.dsn, "-b",
                         LANE, "--wait", "120", "--", "true"],
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=environ())
    assert taker.wait(timeout=TIMEOUT * 2) == 0
    waited = time.monotonic() - frozen
    print(f"the lane was free {waited:.1f} s after the link froze")
    from lanelock.store.pg.lease import LEASE

    assert waited < LEASE + 5
