"""Waits on the PostgreSQL store are wake-ups, not statements that wait: the server's log holds no
ERROR line of a lanelock session in normal operation. Each of these ended as one before: the lane's
first waiter blocked in pg_advisory_lock under a lock_timeout ("canceling statement due to lock
timeout" when its --wait ran out), a cancelled wait was conn.cancel() ("canceling statement due
to user request": the proxy's client hanging up, a `run --wait` interrupted), and a stopped
waiter passed over was pg_cancel_backend'ed by the waiter behind it. And a holder killed with -9,
which notifies no one, still hands the lane on at once. Real server, real `lanelock run`/`proxy`.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time

import pytest

from support.cli import LANELOCK, TIMEOUT, environ
from support.processes import read_line, wait_for
from support.server import Server
from support.pg_server import lanelock_errors
from support.ports import free_port

psycopg = pytest.importorskip("psycopg")
LISTENING = r"proxy listening on http://127\.0\.0\.1:(\d+) for "
KILL_HANDS_ON_WITHIN = 1.0   # seconds from kill -9 of the holder to the next command's start


@pytest.fixture
def quiet_log(postgres):
    """The server's log from here on; the test's own ERROR lines of lanelock's at its end."""
    start = os.path.getsize(postgres.log_path)

    def errors() -> list[str]:
        with open(postgres.log_path, "rb") as log:
            log.seek(start)
            return lanelock_errors(log.read().decode(errors="replace"))
    return errors


def queued(postgres, backend: str) -> int:
    """The lane's waiting turns as `status` lists them: the host's head in the server's queue,
    the others on this host's lane behind it (store/pg/hostqueue.py)."""
    import json

    shown = subprocess.run([*LANELOCK, "status", "--store", postgres.dsn, "-b", backend, "--json"],
                           capture_output=True, text=True, env=environ(), timeout=TIMEOUT)
    return len(json.loads(shown.stdout)["lanes"][0]["queue"])


def waiter(procs, postgres, backend: str, *args, word: str = "go"):
    """A `run --wait` turn whose command says word on stdout."""
    return procs.start([*LANELOCK, "run", "--store", postgres.dsn, "-b", backend, *args, "--",
                        "echo", word], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       env=environ(), text=True)


def test_a_first_waiter_whose_wait_runs_out_across_aging_steps_logs_no_error(
        postgres, procs, holder, lock_roots, quiet_log):
    lock_roots.watch_store(postgres.dsn)
    backend = f"127.0.0.1:{free_port()}"
    held = holder("--store", postgres.dsn, "-b", backend)
    # Aging every 0.4 s: the batch turn's class rises through several steps while it is first.
    turn = procs.start([*LANELOCK, "run", "--store", postgres.dsn, "-b", backend, "--wait", "2",
                        "--priority", "batch", "--", "true"], stderr=subprocess.PIPE,
                       env=environ({"LANELOCK_PRIORITY_AGING": "0.4"}), text=True)
    wait_for(lambda: queued(postgres, backend) == 1, "the waiter queued")
    assert turn.wait(timeout=TIMEOUT) == 75, turn.stderr.read()
    assert held.release() == 0
    assert quiet_log() == []


@pytest.mark.slow   # the default tier's time: the slow tier (CI) runs it
def test_a_stopped_first_waiter_is_passed_over_with_no_error_and_goes_next_once_continued(
        postgres, procs, holder, lock_roots, quiet_log):
    lock_roots.watch_store(postgres.dsn)
    backend = f"127.0.0.1:{free_port()}"
    held = holder("--store", postgres.dsn, "-b", backend)
    first = waiter(procs, postgres, backend, "--wait", "60", word="first")
    wait_for(lambda: queued(postgres, backend) == 1, "the first waiter queued")
    os.kill(first.pid, signal.SIGSTOP)
    second = waiter(procs, postgres, backend, "--wait", "60", word="second")
    wait_for(lambda: queued(postgres, backend) == 2, "the second waiter queued")
    # The one behind looks again every second (order.STOPPED_LOOK) and passes the stopped one
    # over: two such looks before the release.
    time.sleep(2.2)
    assert held.release() == 0
    assert read_line(second.stdout, TIMEOUT).strip() == "second"
    assert second.wait(timeout=TIMEOUT) == 0, second.stderr.read()
    os.kill(first.pid, signal.SIGCONT)
    assert first.wait(timeout=TIMEOUT) == 0, first.stderr.read()
    assert first.stdout.read().strip() == "first"
    assert quiet_log() == []


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["INT", "TERM"])
def test_a_run_wait_interrupted_logs_no_error(signum, postgres, procs, holder, lock_roots,
                                             quiet_log):
    lock_roots.watch_store(postgres.dsn)
    backend = f"127.0.0.1:{free_port()}"
    held = holder("--store", postgres.dsn, "-b", backend)
    first = waiter(procs, postgres, backend, "--wait", "60", word="first")
    behind = waiter(procs, postgres, backend, "--wait", "60", word="behind")
    wait_for(lambda: queued(postgres, backend) == 2, "both waiters queued")
    for turn in (behind, first):   # the one behind another, then the lane's first waiter
        os.kill(turn.pid, signum)
        assert turn.wait(timeout=TIMEOUT) != 0
        assert turn.stdout.read() == ""   # its command never ran
    wait_for(lambda: queued(postgres, backend) == 0, "the queue empty")
    assert held.release() == 0
    assert quiet_log() == []


def test_a_proxied_request_whose_client_hangs_up_while_waiting_logs_no_error(
        postgres, procs, holder, lock_roots, quiet_log):
    pytest.importorskip("aiohttp")
    lock_roots.watch_store(postgres.dsn)
    backend = f"127.0.0.1:{free_port()}"   # never asked: the lane stays held throughout
    held = holder("--store", postgres.dsn, "-b", backend)
    proxy = Server(procs, [*LANELOCK, "proxy", "--listen", "127.0.0.1:0", "--store", postgres.dsn,
                          "--no-witness", "-b", backend, "--wait", "60"], LISTENING)
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
    request = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
               f"\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
    clients = []
    for _ in range(2):   # the lane's first waiter and one behind it
        client = socket.create_connection(("127.0.0.1", proxy.port), timeout=TIMEOUT)
        client.sendall(request)
        clients.append(client)
        wait_for(lambda count=len(clients): queued(postgres, backend) == count, "the request queued")
    for client in reversed(clients):
        client.close()
    wait_for(lambda: queued(postgres, backend) == 0, "the hung-up requests out of the queue")
    assert held.release() == 0
    proxy.stop()
    assert quiet_log() == []


def test_a_holder_killed_with_9_hands_the_lane_on_at_once(postgres, procs, holder, lock_roots,
                                                         quiet_log):
    """Its session ends with no unlock and no notification: the waiter, which watches the
    holder's process (its row names it on this host), tries at once."""
    lock_roots.watch_store(postgres.dsn)
    backend = f"127.0.0.1:{free_port()}"
    held = holder("--store", postgres.dsn, "-b", backend)
    turn = waiter(procs, postgres, backend, "--wait", "60")
    wait_for(lambda: queued(postgres, backend) == 1, "the waiter queued")
    time.sleep(0.5)   # asleep on its LISTEN by now (what is under test: its wake-up)
    killed = time.monotonic()
    os.killpg(held.pid, signal.SIGKILL)   # the wrapper and its command
    assert read_line(turn.stdout, TIMEOUT).strip() == "go"
    took = time.monotonic() - killed
    print(f"\nkill -9 of the holder -> the next turn's command: {took * 1000:.0f} ms")
    assert turn.wait(timeout=TIMEOUT) == 0, turn.stderr.read()
    assert took < KILL_HANDS_ON_WITHIN, took
    held.wait()
    assert quiet_log() == []


def test_a_wait_whose_session_is_past_descriptor_1024_wakes(postgres, procs, holder, lock_roots,
                                                            quiet_log):
    """A waiter's session socket numbered past 1024 (a proxy with many clients; here a `run`
    started with 1,100 descriptors open) is slept on with poll(): select() cannot take it."""
    import resource

    lock_roots.watch_store(postgres.dsn)
    backend = f"127.0.0.1:{free_port()}"
    held = holder("--store", postgres.dsn, "-b", backend)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 4096), max(hard, 4096)))
    fds = []
    try:
        fds = [os.open("/dev/null", os.O_RDONLY) for _ in range(1100)]
        turn = procs.start([*LANELOCK, "run", "--store", postgres.dsn, "-b", backend, "--wait",
                            "60", "--", "echo", "go"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, env=environ(), text=True, pass_fds=fds)
    finally:
        for fd in fds:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    wait_for(lambda: queued(postgres, backend) == 1 or turn.poll() is not None,
             "the waiter queued")
    time.sleep(0.5)   # asleep on its session by now (what is under test: that sleep)
    assert turn.poll() is None, turn.stderr.read()   # it waits: it neither failed nor ran
    assert held.release() == 0
    assert turn.wait(timeout=TIMEOUT) == 0
    assert (turn.stdout.read().strip(), turn.stderr.read()) == ("go", "")
    assert quiet_log() == []
