"""Who goes next across hosts and across users: the queue of test_priority.py, with its
waiters spread over two hosts sharing one PostgreSQL store, and over three users sharing one flock
root.

Two hosts: the site of test_pg_proxy.py (support/netns.py). This namespace is the engine box, where
a PostgreSQL server listens on its LAN address 10.213.77.1; each host is a network namespace with its
own link to it and its own hostname (`ip netns exec NS unshare --uts`). Every turn is given
`-b 10.213.77.1:PORT`, a LAN address to both hosts and one of the box's own addresses, so all of
them key the one lane "10.213.77.1:PORT" (`where --json` on each says so); nothing needs to listen
there, `run` never asks the engine. The hosts share this machine's files and pids (only the
network and UTS namespaces differ): each waiter's command appends its name to one file, in the
order the lane served them, and `status` names each queued waiter by its pid and host.

Three users: the shared root of other_users.py (a 1777 base under /tmp) and its launcher, a real
process of nobody, daemon or root. The queue directory is 1777 with the sticky bit like /tmp, so a
dead waiter's file can be removed only by its owner, the directory's owner or root: the others
must skip it.

Arrival order is made certain as in test_priority.py: each waiter is started only once the one
before it shows in the lane's queue (`status`). Aging is an hour: only class and arrival decide.
"""

from __future__ import annotations

import json
import os
import pwd
import signal
import subprocess
import time
from pathlib import Path

import pytest

from support.cli import LANELOCK, TIMEOUT, json_of
from support.kernel_locks import is_waiting
from support.processes import ExitWatch, wait_for
from support.netns import ENGINE_IP, Host, two_hosts
from support.other_users import launcher, shared_root, users  # noqa: F401 - fixtures


NO_AGING = "3600"
ENGINE = f"{ENGINE_IP}:8093"         # nobody listens: `run` never asks the engine
HOST_NAMES = ("host-a", "host-b")
# The served command: append "NAME USER" to the order file ($0), proving who ran it and when.
SERVED = 'echo "$1 $(id -un)" >> "$0"'
# PostgreSQL 14+ notices a dead client of a backend blocked in a lock wait within
# client_connection_check_interval (lanelock sets 1 s): a killed waiter leaves the queue within a
# few seconds, even on a loaded machine.
DEAD_WAITER_BOUND = 5.0


def served(order: Path) -> list[str]:
    """The names in the order their turns held the lane."""
    return [line.split()[0] for line in order.read_text().splitlines()]


def finished(waiters: dict) -> None:
    """Every waiter (name -> Popen) ended well, and said nothing on stderr."""
    for name, waiter in waiters.items():
        status = waiter.wait(TIMEOUT)
        said = waiter.stderr.read()
        assert status == 0, (name, said)
        assert said == "", f"{name} said: {said!r}"


def wait_queued(queue, waiter, name: str) -> dict:
    """Until the waiter (a Popen, its pid lanelock's own) shows in the queue; its entry. A waiter
    that ended instead (deflected, failed) fails the test at once with what it said."""
    def seen():
        if waiter.poll() is not None:
            raise AssertionError(f"{name} ended ({waiter.returncode}) instead of queueing: "
                                 f"{waiter.stderr.read()!r}")
        return next((entry for entry in queue() if entry["pid"] == waiter.pid), None)

    # The queue is the store's (a table on the server, files in a directory): no process says
    # when a waiter has joined it, so it is read until this one shows.
    return wait_for(seen, f"{name} to queue")


# == two hosts on one PostgreSQL store ============================================================
class QueueHost(Host):
    """A host of the site (netns.Host) whose turns queue for the engine's lane."""

    def waiter(self, procs, order: Path, name: str, klass: str):
        """`lanelock run --wait --priority KLASS` on this host, its command appending NAME to
        the order file. Its pid is lanelock's own (ip netns exec, unshare and sh all exec)."""
        return procs.start([*self.prefix, *LANELOCK, "run", "--wait", "120", "--priority", klass,
                            "-s", name, "-b", ENGINE, "--store", self.store, "--",
                            "sh", "-c", SERVED, str(order), name],
                           stderr=subprocess.PIPE, text=True)


@pytest.fixture
def hosts(lock_roots, monkeypatch):
    """[host A, host B], as in test_pg_proxy.py: two hosts linked to this namespace, the engine
    box, where a PostgreSQL server listens on 10.213.77.1 and trusts both hosts' addresses
    (netns.two_hosts)."""
    pytest.importorskip("psycopg")
    hosts = two_hosts(lock_roots, HOST_NAMES, QueueHost)
    monkeypatch.setenv("LANELOCK_PRIORITY_AGING", NO_AGING)   # every process of the test
    return hosts


def pg_lane(store: str) -> dict:
    """The lane as `status --json` reads it on the engine box (in this process)."""
    (lane,) = json_of(["status", "--json", "--store", store, "-b", ENGINE])["lanes"]
    return lane


def assert_one_lane(hosts, run_cmd) -> None:
    """Both hosts and the engine box key the engine as the one LAN lane, and each host knows
    itself by its own name."""
    for host in hosts:
        where = json.loads(host.lanelock(run_cmd, "where", "--json", "-b", ENGINE,
                                         "--store", host.store).stdout)
        assert (where["lane"], where["scope"], where["store"]) == (ENGINE, "lan", "postgresql"), \
            (host.hostname, where)
        named = run_cmd([*host.prefix, "hostname"])
        assert named.stdout.strip() == host.hostname, named
    where = json_of(["where", "--json", "-b", ENGINE, "--store", hosts[0].store])
    assert where["lane"] == ENGINE, where   # the box's status reads the hosts' lane


def assert_held_from(held, host) -> None:
    """The holder's turn holds the lane in the store, named by its host (a turn that could not
    reach the store runs ungated: it says why on stderr)."""
    lane = pg_lane(host.store)
    assert lane["holder"] and lane["holder"]["host"] == host.hostname, (lane, held.stderr())
    assert lane["holder"]["pid"] == held.pid, lane


def queue_on_hosts(hosts, procs, order, arrivals) -> dict:
    """Start the waiters (host, name, class) one at a time, each once the one before shows in
    the queue; name -> Popen."""
    waiters = {}
    for host, name, klass in arrivals:
        waiter = host.waiter(procs, order, name, klass)
        entry = wait_queued(lambda: pg_lane(host.store)["queue"], waiter, name)
        assert (entry["session"], entry["class"], entry["host"]) == (name, klass, host.hostname), \
            entry
        waiters[name] = waiter
    return waiters


def hold_and_queue(hosts, holding_host, holder, procs, run_cmd, order, arrivals):
    """The one lane on both hosts, held from holding_host (its turn in the store), then the
    waiters queued behind it (queue_on_hosts): (the holder, name -> Popen)."""
    assert_one_lane(hosts, run_cmd)
    first = holder("-b", ENGINE, "--store", holding_host.store, "-s", "holder",
                   prefix=holding_host.prefix)
    assert_held_from(first, holding_host)
    return first, queue_on_hosts(hosts, procs, order, arrivals)


@pytest.mark.slow
def test_waiters_on_two_hosts_are_served_by_class_then_arrival(hosts, holder, procs, run_cmd,
                                                                 tmp_path):
    """host A holds; waiters of mixed classes alternate between the hosts. The queue every host
    reads names each by its host and pid, in class then arrival order (the server's clock), and
    the lane serves them in that order."""
    host_a, host_b = hosts
    order = tmp_path / "order"
    arrivals = [(host_a, "a-batch", "batch"), (host_b, "b-normal", "normal"),
                (host_a, "a-interactive", "interactive"), (host_b, "b-batch", "batch"),
                (host_a, "a-normal", "normal"), (host_b, "b-interactive", "interactive")]
    first, waiters = hold_and_queue(hosts, host_a, holder, procs, run_cmd, order, arrivals)
    expected = ["a-interactive", "b-interactive", "b-normal", "a-normal", "a-batch", "b-batch"]
    host_of = {name: host.hostname for host, name, _ in arrivals}
    klass_of = {name: klass for _, name, klass in arrivals}
    # The queue as the box sees it and as host B sees it: one order, every waiter by its host.
    from_b = host_b.lanelock(run_cmd, "status", "--json", "-b", ENGINE, "--store", host_b.store)
    assert from_b.returncode == 0, from_b.stderr
    for lane in (pg_lane(host_a.store), json.loads(from_b.stdout)["lanes"][0]):
        assert lane["lane"] == ENGINE and lane["holder"]["host"] == "host-a", lane
        assert [(entry["position"], entry["session"], entry["class"], entry["effective_class"],
                 entry["host"], entry["pid"]) for entry in lane["queue"]] == \
            [(position, name, klass_of[name], klass_of[name], host_of[name], waiters[name].pid)
             for position, name in enumerate(expected, 1)]
    assert first.release() == 0
    finished(waiters)
    assert order.read_text().splitlines() == [f"{name} root" for name in expected]
    assert pg_lane(host_a.store)["queue"] == []


def kill_queued(waiter, name: str, store: str) -> float:
    """kill -9 of a queued waiter; seconds until the store's queue has dropped it."""
    death = ExitWatch(waiter.pid)
    os.kill(waiter.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    death.wait()
    # Nothing reports a session the server ended: its queue is read until the entry is gone.
    wait_for(lambda: all(entry["pid"] != waiter.pid for entry in pg_lane(store)["queue"]),
             f"killed {name} to leave the queue", timeout=DEAD_WAITER_BOUND + 30)
    return time.monotonic() - killed_at


@pytest.mark.slow
def test_kill_9_of_a_queued_waiter_on_one_host_leaves_the_queue_at_once(hosts, holder, procs,
                                                                          run_cmd, tmp_path):
    """kill -9 of the first in the queue (blocked in the server on the lane's own lock), then of
    one in the middle (blocked on the ticket lock of the one ahead), each on another host than
    the waiter behind it: each leaves the queue within seconds (the server ends the session of a
    client gone), and the rest are served in order."""
    host_a, host_b = hosts
    order = tmp_path / "order"
    arrivals = [(host_a, "a-normal", "normal"), (host_b, "b-doomed", "interactive"),
                (host_a, "a-interactive", "interactive"), (host_b, "b-batch", "batch"),
                (host_a, "a-middle", "normal"), (host_a, "a-batch", "batch")]
    first, waiters = hold_and_queue(hosts, host_b, holder, procs, run_cmd, order, arrivals)
    store = host_a.store
    assert [entry["session"] for entry in pg_lane(store)["queue"]] == \
        ["b-doomed", "a-interactive", "a-normal", "a-middle", "b-batch", "a-batch"]

    first_gone = kill_queued(waiters.pop("b-doomed"), "b-doomed", store)
    assert [entry["session"] for entry in pg_lane(store)["queue"]] == \
        ["a-interactive", "a-normal", "a-middle", "b-batch", "a-batch"]
    middle_gone = kill_queued(waiters.pop("a-middle"), "a-middle", store)
    queue = pg_lane(store)["queue"]
    assert [(entry["position"], entry["session"], entry["host"]) for entry in queue] == \
        [(1, "a-interactive", "host-a"), (2, "a-normal", "host-a"), (3, "b-batch", "host-b"),
         (4, "a-batch", "host-a")]
    assert first.release() == 0
    finished(waiters)
    assert served(order) == ["a-interactive", "a-normal", "b-batch", "a-batch"]
    print(f"\nkill -9 of a queued waiter on PostgreSQL: gone from the queue {first_gone:.2f} s "
          f"later (first in the queue), {middle_gone:.2f} s (in the middle)")
    assert first_gone <= DEAD_WAITER_BOUND and middle_gone <= DEAD_WAITER_BOUND, \
        (first_gone, middle_gone)


# == three users on one flock root ================================================================
BACKEND = "localhost:7043"


@pytest.fixture
def user_site(users, shared_root, monkeypatch):
    """(lock path, order file): the lane in the shared root, and a file every user can append
    to (root's, in the root-owned 1777 base)."""
    monkeypatch.setenv("LANELOCK_PRIORITY_AGING", NO_AGING)
    order = Path(shared_root).parent / "order"
    order.touch()
    order.chmod(0o666)
    lock = json_of(["where", "--json", "-b", BACKEND])["lock_path"]
    return Path(lock), order


def flock_queue() -> list[dict]:
    """The lane's queue as `status --json` reads it (in this process, as root: a reader that
    removes nothing)."""
    (lane,) = json_of(["status", "--json", "-b", BACKEND])["lanes"]
    return lane["queue"]


def user_waiter(procs, order: Path, user: str, name: str, klass: str):
    """`lanelock run --wait --priority KLASS` as user, returned once it shows in the queue."""
    waiter = procs.start([*launcher(user), "run", "--wait", "120", "--priority", klass, "-s", name,
                          "-b", BACKEND, "--", "sh", "-c", SERVED, str(order), name],
                         stderr=subprocess.PIPE, text=True)
    entry = wait_queued(flock_queue, waiter, name)
    assert (entry["session"], entry["class"]) == (name, klass), entry
    return waiter


def test_waiters_of_three_users_are_served_by_class_then_arrival(user_site, holder, procs):
    """Root holds; nobody, daemon and root queue in one 1777 queue directory, each in a file of
    its own, and are served by class then arrival, with no warning from anyone."""
    lock, order = user_site
    first = holder("-b", BACKEND, "-s", "root-holder", launcher=launcher("root"))
    arrivals = [("nobody", "nobody-batch", "batch"),
                ("daemon", "daemon-interactive", "interactive"),
                ("root", "root-normal", "normal"),
                ("nobody", "nobody-interactive", "interactive")]
    waiters = {name: user_waiter(procs, order, user, name, klass) for user, name, klass in arrivals}
    queue_dir = lock.with_suffix(".queue")
    assert queue_dir.stat().st_mode & 0o7777 == 0o1777
    owners = {pwd.getpwuid(path.stat().st_uid).pw_name for path in queue_dir.iterdir()}
    assert owners == {"nobody", "daemon", "root"}   # each waiter's file is its own
    assert [(entry["session"], entry["pid"]) for entry in flock_queue()] == \
        [(name, waiters[name].pid) for name in ("daemon-interactive", "nobody-interactive",
                                                "root-normal", "nobody-batch")]
    assert first.release() == 0
    assert first.stderr() == ""
    finished(waiters)
    assert order.read_text().splitlines() == [
        "daemon-interactive daemon", "nobody-interactive nobody", "root-normal root",
        "nobody-batch nobody"]
    assert flock_queue() == []


def test_a_killed_waiter_of_another_user_is_skipped_not_waited_for(user_site, holder, procs,
                                                                   run_cmd):
    """nobody's waiter, first in the queue, is killed with kill -9: its file stays (daemon, who
    holds the lane and waits behind it, may not remove it from the sticky queue directory nobody
    made), and daemon's waiters skip it -- the next takes the lane at the release, and later turns
    take a free lane past it."""
    lock, order = user_site
    first = holder("-b", BACKEND, "-s", "daemon-holder", launcher=launcher("daemon"))
    doomed = user_waiter(procs, order, "nobody", "nobody-doomed", "interactive")
    queue_dir = lock.with_suffix(".queue")
    assert pwd.getpwuid(queue_dir.stat().st_uid).pw_name == "nobody"   # nobody made it
    waiters = {name: user_waiter(procs, order, "daemon", name, klass)
               for name, klass in (("daemon-normal", "normal"), ("daemon-batch", "batch"))}
    # The first in the queue blocks in flock() on the lane's lock itself (the kernel says so).
    wait_for(lambda: is_waiting(lock, doomed.pid), "nobody's waiter to wait for the lane")
    (dead_file,) = [path for path in queue_dir.iterdir()
                    if path.name.split(".")[2] == str(doomed.pid)]

    death = ExitWatch(doomed.pid)
    os.kill(doomed.pid, signal.SIGKILL)
    death.wait()
    # daemon's first waiter was blocked on the dead waiter's file; the kernel lets it go, it finds
    # nobody holds the file and moves up: it now waits for the lane itself.
    wait_for(lambda: is_waiting(lock, waiters["daemon-normal"].pid),
             "daemon's waiter to move up to the lane")
    assert [entry["session"] for entry in flock_queue()] == ["daemon-normal", "daemon-batch"]
    # Only nobody and root may remove it (its owner, the directory's; root's status removes
    # nothing): daemon's waiter skipped it.
    assert dead_file.exists(), "the dead waiter's file went: nobody had to skip it"
    assert first.release() == 0
    assert first.stderr() == ""
    finished(waiters)
    assert served(order) == ["daemon-normal", "daemon-batch"]
    # Still there: a turn that finds the lane free does not count it as a waiter ahead of it (the
    # no-barging check skips a dead entry), whether it may remove the file (root) or not (daemon).
    assert dead_file.exists()
    for user in ("daemon", "root"):
        done = run_cmd([*launcher(user), "run", "--priority", "batch", "-b", BACKEND, "--", "true"])
        assert (done.returncode, done.stderr) == (0, ""), (user, done)
    assert flock_queue() == []


def blocked_in_flock(pid: int) -> bool:
    """Is pid blocked in flock() on any file (a '->' entry of /proc/locks): asleep in the
    kernel, as a waiter should be, whatever it waits on?"""
    with open("/proc/locks") as handle:
        for line in handle:
            words = line.split()
            if words[1:2] == ["->"] and len(words) > 5 and words[2] == "FLOCK" \
                    and words[5] == str(pid):
                return True
    return False


def test_a_waiter_behind_another_users_private_entry_waits_in_the_kernel(user_site, holder,
                                                                        procs):
    """A user whose umask is 077 (a hardened login, a service with UMask=0077) queues first: its
    entry file is made 0644 minus the umask, unless lanelock sets its mode. daemon's waiter behind
    it must still sleep in the kernel until that entry leaves (the lane's other shared files --
    holder record, journal, counts -- are chmodded past the umask for the same reason); then both
    are served in order, with no warning.

    Fails on the code this was written against: store/flock/queue.py Queue.join creates the entry with
    mode 0644 and no fchmod, so under umask 077 it is 0600; daemon's EntryWait open() of it fails
    with EACCES, and FlockStore.wait_lock's `except OSError: continue` looks again at once -- a
    busy loop (ahead(), a listing and /proc/locks each time) until nobody's turn leaves."""
    lock, order = user_site
    first = holder("-b", BACKEND, "-s", "root-holder", launcher=launcher("root"))
    private = procs.start(["sh", "-c", 'umask 077 && exec "$@"', "sh", *launcher("nobody"), "run",
                           "--wait", "120", "--priority", "interactive", "-s", "nobody-private",
                           "-b", BACKEND, "--", "sh", "-c", SERVED, str(order), "nobody-private"],
                          stderr=subprocess.PIPE, text=True)
    wait_queued(flock_queue, private, "nobody-private")
    waiters = {"nobody-private": private,
               "daemon-behind": user_waiter(procs, order, "daemon", "daemon-behind", "normal")}
    behind = waiters["daemon-behind"].pid
    # The kernel says when a process sleeps in flock(); a waiter that cannot open the entry ahead
    # and looks again at once never does (it spins, a core's worth of CPU, until the entry goes).
    try:
        wait_for(lambda: blocked_in_flock(behind), "daemon's waiter to sleep in flock()",
                 timeout=10)
    except AssertionError:
        import psutil

        modes = {path.name: oct(path.stat().st_mode & 0o777)
                 for path in lock.with_suffix(".queue").iterdir()}
        pytest.fail(f"daemon's waiter (pid {behind}) never slept in flock() behind nobody's "
                    f"entry: state {psutil.Process(behind).status()}, cpu "
                    f"{psutil.Process(behind).cpu_times()}; queue files {modes}")
    assert first.release() == 0
    finished(waiters)
    assert served(order) == ["nobody-private", "daemon-behind"]
