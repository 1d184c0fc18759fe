"""Test hosts for the PostgreSQL store: a network namespace joined to this one by a veth pair, and
a PostgreSQL server the namespaces can reach. test_pg_edges.py imports these
(`from support.netns import namespace, reachable_server  # noqa: F401` for the fixtures); test_pg_proxy.py
and test_priority_hosts.py build their site of two hosts from them (two_hosts, Host).

Root and iproute2 make a namespace; without them (or where the kernel refuses one) the fixtures
skip, and without Debian's postgresql package so does reachable_server.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import uuid

import pytest

from support.cli import LANELOCK, TIMEOUT
from support import pg_server
from support.engine import Engine



def _claim_net() -> str:
    """One /24 per test process on this machine, held by a flock for the process's life: two
    processes' namespaces on one address (two xdist workers, or two checkouts' suites at once)
    would send each other's packets to the wrong link. The kernel lets the claim go at exit."""
    for third in range(77, 255):
        path = f"/tmp/lanelock-tests-net-10.213.{third}.lock"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue
        _CLAIMS.append(fd)   # kept open: the claim lasts as long as this process
        return f"10.213.{third}"
    raise RuntimeError("no free 10.213.X.0/24 for test namespaces")


_CLAIMS: list[int] = []
NET = _claim_net()
ENGINE_IP = f"{NET}.1"   # the engine box's address on the first host's link


class Namespace:
    """A test host: a network namespace joined to this one by a veth pair, the /30 numbered
    `subnet` in NET's /24 (0: NET.1 on this side, NET.2 inside; 1: .5 and .6)."""

    def __init__(self, subnet: int = 0):
        tag = uuid.uuid4().hex[:6]
        self.name, self.outer, self.inner = f"ll{tag}", f"llh{tag}", f"lln{tag}"
        self.host_ip, self.ns_ip = f"{NET}.{4 * subnet + 1}", f"{NET}.{4 * subnet + 2}"

    def up(self) -> "Namespace":
        for argv in (["ip", "netns", "add", self.name],
                     ["ip", "link", "add", self.outer, "type", "veth", "peer", "name", self.inner],
                     ["ip", "link", "set", self.inner, "netns", self.name],
                     ["ip", "addr", "add", f"{self.host_ip}/30", "dev", self.outer],
                     ["ip", "link", "set", self.outer, "up"],
                     ["ip", "netns", "exec", self.name, "ip", "addr", "add", f"{self.ns_ip}/30",
                      "dev", self.inner],
                     ["ip", "netns", "exec", self.name, "ip", "link", "set", self.inner, "up"],
                     ["ip", "netns", "exec", self.name, "ip", "link", "set", "lo", "up"]):
            subprocess.run(argv, check=True, capture_output=True, timeout=TIMEOUT)
        return self

    def route_everything_here(self) -> None:
        """A default route through this side of the link: the namespace reaches every address of
        this host (another namespace's link address too), not only its own /30."""
        subprocess.run(["ip", "netns", "exec", self.name, "ip", "route", "add", "default", "via",
                        self.host_ip], check=True, capture_output=True, timeout=TIMEOUT)

    def prefix(self, hostname: str | None = None) -> list[str]:
        """Words before a command that runs it on this host: inside the namespace and, given a
        hostname, in its own UTS namespace under that name (exec all the way down: the pid a
        Popen gets is the command's own)."""
        words = ["ip", "netns", "exec", self.name]
        if hostname is not None:
            words += ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', hostname]
        return words

    def cut(self) -> None:
        subprocess.run(["ip", "link", "set", self.outer, "down"], check=True, timeout=TIMEOUT)

    def down(self) -> None:
        subprocess.run(["ip", "link", "del", self.outer], capture_output=True, timeout=TIMEOUT)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, timeout=TIMEOUT)


def make_namespace(subnet: int = 0) -> Namespace:
    """A namespace that is up, or a skip saying why there can be none here."""
    if shutil.which("ip") is None or os.geteuid() != 0:
        pytest.skip("needs root and iproute2 for a network namespace")
    ns = Namespace(subnet)
    try:
        ns.up()
    except subprocess.CalledProcessError as error:
        ns.down()
        pytest.skip(f"cannot make a network namespace here: {error.stderr!r}")
    return ns


@pytest.fixture
def namespace():
    ns = make_namespace()
    yield ns
    ns.down()


def reachable_postgres(lock_roots, listen: str, trust: str) -> pg_server.Server:
    """A server that also listens on `listen` (addresses of this side of the links), trusting the
    client network `trust`; its lanes are watched by the teardown check, and it is stopped after
    the check has seen them free."""
    if pg_server.binaries() is None:
        pytest.skip("no PostgreSQL server")
    running = pg_server.Server()
    running.listen = f"127.0.0.1,{listen}"
    running.trust = trust
    lock_roots.after(running.stop)
    running.start()
    lock_roots.watch_store(running.dsn)
    return running


@pytest.fixture
def reachable_server(namespace, lock_roots):
    """A server that also listens on the veth address, trusting the namespace's address; stopped
    after the teardown check has seen its lanes free."""
    return reachable_postgres(lock_roots, namespace.host_ip, f"{namespace.ns_ip}/32")


def lan_engine(procs, *, tokens: int, interval: float) -> Engine:
    """The strict stand-in on the engine box's LAN address (ENGINE_IP), where both hosts reach it;
    a plain answer takes as long as a stream (tokens * interval)."""
    return Engine(procs, delay=tokens * interval, tokens=tokens, interval=interval, strict=True,
                  address=ENGINE_IP)


class Host:
    """One host of the site: a network namespace with its own hostname, reaching the store (and
    the engine) at the engine box's LAN address."""

    def __init__(self, namespace: Namespace, hostname: str, store: str):
        self.namespace, self.hostname, self.store = namespace, hostname, store
        self.prefix = namespace.prefix(hostname)

    def lanelock(self, run_cmd, *args):
        """`lanelock ARGS` run on this host, to completion."""
        return run_cmd([*self.prefix, *LANELOCK, *args])


def two_hosts(lock_roots, hostnames: tuple[str, str], host=Host) -> list:
    """[host(namespace, hostname, store) for each hostname]: two hosts linked to this namespace,
    the engine box, where a PostgreSQL server listens on ENGINE_IP and trusts both hosts'
    addresses (the store). The namespaces go down after the teardown check, so procs kills the
    processes on them while their links are up and the server sees their sessions end at once (a
    link taken down first would leave a lane held for the vanished-host bound)."""
    if shutil.which("unshare") is None:
        pytest.skip("needs util-linux's unshare for a host's own hostname")
    namespaces = []
    for subnet in (0, 1):
        namespace = make_namespace(subnet)
        lock_roots.after(namespace.down)
        namespace.route_everything_here()
        namespaces.append(namespace)
    assert namespaces[0].host_ip == ENGINE_IP
    server = reachable_postgres(lock_roots, ENGINE_IP, f"{NET}.0/29")   # .2 and .6
    store = f"postgresql://postgres@{ENGINE_IP}:{server.port}/postgres"
    return [host(namespace, name, store) for namespace, name in zip(namespaces, hostnames)]
