"""The PostgreSQL store's edges: the first turns on a fresh database, and a holder whose
host vanishes mid-turn (a network namespace whose link is cut). A real server from Debian's
postgresql package; skipped without it unless LANELOCK_REQUIRE_PG is set.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import time
import uuid

import pytest

from support.cli import LANELOCK, TIMEOUT, environ
from support.processes import read_line
from support.netns import namespace, reachable_server  # noqa: F401

pg_server = pytest.importorskip("support.pg_server")
psycopg = pytest.importorskip("psycopg")


def fresh_database(postgres, lock_roots) -> str:
    """A database lanelock never saw, watched by the teardown check."""
    name = f"lanes_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(postgres.dsn, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return lock_roots.watch_store(postgres.dsn.rsplit("/", 1)[0] + f"/{name}")


def first_turns_at_once(procs, dsn: str, count: int = 10) -> list:
    """count turns released together onto a database lanelock never saw: each waits for one line
    on a shared pipe (fd 3), written all at once; the one that gets the lane prints LOCAL and
    holds until told. Returns the Popens."""
    go_read, go_write = os.pipe()
    turns = []
    for _ in range(count):
        turn = procs.start(["sh", "-c", 'read go <&3; exec 3<&-; exec "$@"', "sh", *LANELOCK,
                            "run", "--store", dsn, "-b", "localhost:7030", "--",
                            "sh", "-c", "echo LOCAL; read done"],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           env=environ(), pass_fds=(go_read,),
                           preexec_fn=lambda: os.dup2(go_read, 3))
        turns.append(turn)
    os.close(go_read)
    os.write(go_write, b"go\n" * count)
    os.close(go_write)
    return turns


@pytest.mark.parametrize("round_", range(3))
def test_the_first_turns_on_a_fresh_database_agree_on_one_holder(round_, postgres, procs,
                                                                 lock_roots):
    dsn = fresh_database(postgres, lock_roots)
    turns = first_turns_at_once(procs, dsn)
    locals_ = []
    pending = {turn.stdout.fileno(): turn for turn in turns}
    deadline = time.monotonic() + TIMEOUT
    while pending and len(locals_) + sum(t.poll() is not None for t in turns) < len(turns):
        ready, _, _ = select.select(list(pending), [], [], max(0.0, deadline - time.monotonic()))
        assert ready, "turns neither held nor ended"
        for fd in ready:
            turn = pending.pop(fd)
            line = read_line(turn.stdout)
            if line == "LOCAL\n":
                locals_.append(turn)
    deflected = [turn for turn in turns if turn not in locals_]
    for turn in deflected:
        turn.wait(timeout=TIMEOUT)
    assert len(locals_) == 1, [turn.returncode for turn in turns]
    assert [turn.returncode for turn in deflected] == [75] * (len(turns) - 1)
    locals_[0].stdin.write(b"\n")
    locals_[0].stdin.close()
    assert locals_[0].wait(timeout=TIMEOUT) == 0
    for turn in turns:
        err = turn.stderr.read().decode()
        assert "warning" not in err and "gate unavailable" not in err, err


def test_every_session_sets_the_servers_keepalives(postgres):
    from lanelock.store.pg.session import SERVER_KEEPALIVES, connect

    conn = connect(postgres.dsn, "lanelock test")
    try:
        for name, value in SERVER_KEEPALIVES.items():
            shown = conn.execute(f"SHOW {name}").fetchone()[0]
            assert shown.rstrip("ms") == str(value), (name, shown)
    finally:
        conn.close()


def test_where_states_the_bound_for_a_vanished_host(postgres, run_cmd):
    where = run_cmd([*LANELOCK, "where", "--store", postgres.dsn, "--json"])
    assert "within about 11 s" in where.stdout, where.stdout


# -- a holder whose host vanishes -----------------------------------------------------------------
@pytest.mark.slow
def test_a_holder_whose_host_vanishes_loses_the_lane_within_the_bound(namespace, reachable_server,
                                                                      holder, run_cmd):
    from lanelock.store.pg.session import BOUND_SECONDS

    port = reachable_server.port
    remote = f"postgresql://postgres@{namespace.host_ip}:{port}/postgres"
    local = f"postgresql://postgres@127.0.0.1:{port}/postgres"
    holder("--store", remote, "-b", "localhost:7031", prefix=["ip", "netns", "exec", namespace.name])
    busy = run_cmd([*LANELOCK, "probe", "--store", local, "-b", "localhost:7031"])
    assert busy.returncode == 1, busy
    namespace.cut()   # a power loss or a dropped Wi-Fi: no FIN, no RST, nothing
    cut_at = time.monotonic()
    # --wait blocks on the server, which wakes it the moment the dead session's lock goes.
    waiter = run_cmd([*LANELOCK, "run", "--store", local, "-b", "localhost:7031",
                      "--wait", "120", "--", "true"], timeout=150)
    freed_after = time.monotonic() - cut_at
    assert waiter.returncode == 0, waiter
    assert freed_after <= BOUND_SECONDS + 4, f"lane freed {freed_after:.1f}s after the cut"
    print(f"lane freed {freed_after:.1f}s after the cut (bound {BOUND_SECONDS}s)")


@pytest.mark.slow   # the default tier's time: the slow tier (CI) runs it
def test_the_engine_box_keys_its_own_lan_address_as_the_other_hosts_do(namespace,
                                                                       reachable_server,
                                                                       holder, run_cmd):
    """Found by the two-host proxy test: on the engine's own box, -b ITS_LAN_ADDRESS:PORT was
    keyed localhost:PORT@BOX while every other host keyed it ADDRESS:PORT -- two advisory keys,
    two gates, a turn on each side held at once. Now the box keys it as the others do."""
    if shutil.which("unshare") is None:
        pytest.skip("needs util-linux's unshare for a host's own hostname")
    backend = f"{namespace.host_ip}:{20000 + os.getpid() % 20000}"   # this side's own address
    here = reachable_server.dsn
    there = here.replace("127.0.0.1", namespace.host_ip)
    other = ["ip", "netns", "exec", namespace.name, "unshare", "--uts", "sh", "-c",
             'hostname other-host && exec "$@"', "other"]
    box = json.loads(run_cmd([*LANELOCK, "where", "--json", "-b", backend, "--store", here]).stdout)
    far = json.loads(run_cmd([*other, *LANELOCK, "where", "--json", "-b", backend,
                              "--store", there]).stdout)
    assert (box["lane"], box["scope"]) == (backend, "lan") == (far["lane"], far["scope"])
    assert box["lock_path"].split("#")[1] == far["lock_path"].split("#")[1]   # one advisory key
    held = holder("-b", backend, "--store", here, "-s", "engine-box")
    done = run_cmd([*other, *LANELOCK, "run", "-b", backend, "--store", there, "--", "true"])
    assert done.returncode == 75, done.stderr
    assert "local_backend_busy" in done.stderr and "engine-box" in done.stderr
    assert held.release() == 0
    # A loopback spelling on the box stays the box's own lane.
    local = json.loads(run_cmd([*LANELOCK, "where", "--json", "-b", "127.0.0.1:8080",
                                "--store", here]).stdout)
    assert local["lane"].startswith("localhost:8080@")
