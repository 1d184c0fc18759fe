"""A host's waiting turns share one server connection: server connections are one per holder plus
one per host that has waiters, whatever the number of waiters (pgbouncer's rule: client
connections are cheap, server connections are not).

Each PostgreSQL lane has, on every host, a HOST LANE: a flock lane under the lock root every
process of this host computes (LANELOCK_DIR or the default root), named from the store's DSN, the
lane and the host's name (stem HOST_PREFIX + digests: a hidden name, so flock's `status --all`
lists no such lane). A waiting turn first waits there, in the flock store's own queue and kernel
waits (classes, aging, FIFO, no barging, as for any flock lane). Holding the host lane makes it its
host's HEAD: only the head connects and waits in the server's queue (store/order.py with PgLine).

Invariants:
- A turn connects only as head (or for a try while no one of this host is ahead: try_lock holds
  the host lane for that moment), so a host's waiters cost the server one connection.
- The head joins the server's queue with the arrival it had locally: clock_timestamp() minus the
  seconds it has waited here (time.monotonic(), the local queue's clock), so FIFO and aging count
  its whole wait across hosts.
- The head lets the host lane go as soon as it has the server lane (the next waiter here becomes
  head and joins the server's queue), or when its wait ends without it.
- A head waiting in the server that sees a waiter of this host ahead of it in the local order (an
  interactive turn behind a batch head) steps aside: it leaves the server's queue, closes its
  connection, lets the host lane go and waits here again with its original arrival. It looks at
  the local queue (a directory listing) every ASIDE_LOOK; never a server statement on a schedule.
- A holder that lets the lane go while the next head of its host is still connecting waits for
  that head's row in the server's queue (at most NEXT_JOIN): otherwise another host's later
  waiter would take the free lane in the gap (no barging across hosts).
- A head that cannot reach the server keeps the host lane while its turn runs ungated (the gate
  fails it open): this host's turns still go one at a time.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time

from ..flock.line import FlockLine

ASIDE_LOOK = 0.2    # how often a head waiting in the server looks at its host's local queue
NEXT_JOIN = 2.0     # how long a releasing holder waits for its host's next head to join
NEXT_LOOK = 0.01    # how often it looks meanwhile (only while a head of this host connects)
HOST_PREFIX = ".pg-host-"


class HostLane:
    """The lane object the flock store needs (name, stem) for a host lane."""

    __slots__ = ("name", "stem")

    def __init__(self, name: str, stem: str):
        self.name, self.stem = name, stem


class Local:
    """One turn's place on its host lane: a flock handle of its own (flock is per open file
    description, so the threads of one process -- a proxy's requests -- exclude each other)."""

    __slots__ = ("flock", "handle", "head", "since", "ungated", "wake", "ticket")

    def __init__(self, flock, handle):
        self.flock, self.handle = flock, handle
        self.head = False        # this turn holds the host lane
        self.since: float | None = None   # time.monotonic() when the turn began waiting
        self.ungated = False     # kept the host lane for a turn run ungated (server unreachable)
        self.wake = None         # the Event of the wait on the host lane under way (cancel())
        # The head's entry in the local queue, kept until it has joined the server's queue:
        # `status` lists it meanwhile (it connects), and the waiters behind it wait on it.
        self.ticket = None

    def close(self) -> None:
        self.head = False
        joined(self)
        self.flock.release(self.handle)


def lane_prefix(dsn: str, lane: str) -> str:
    """The stem prefix every host's host lane of one store lane shares."""
    from .session import redact

    digest = hashlib.sha256(f"{redact(dsn)}\0{lane}".encode()).hexdigest()[:16]
    return f"{HOST_PREFIX}{digest}-"


def host_stem(dsn: str, lane: str) -> str:
    from ...facts import hostname

    return lane_prefix(dsn, lane) + hashlib.sha256(hostname().encode()).hexdigest()[:8]


def flock_store(root, aging: float):
    from ..flock.store import FlockStore

    return FlockStore(root, priority_aging=aging)


def open_local(flock, dsn: str, lane: str) -> Local | None:
    """This turn's handle on its host lane; None when the lock root cannot be used (the turn then
    waits with a connection of its own, as before host lanes)."""
    from ...errors import GateUnavailable

    stem = host_stem(dsn, lane)
    try:
        return Local(flock, flock.open(HostLane(stem, stem)))
    except (GateUnavailable, OSError):
        return None


# -- the head ---------------------------------------------------------------------------------
def try_head(local: Local, rank: int) -> bool:
    """The host lane now, if no turn of this host is ahead (a head, a waiter of this class or
    higher): False means busy, and no connection is made."""
    from ...errors import GateUnavailable

    try:
        local.head = local.flock.try_lock(local.handle, rank)
    except GateUnavailable:
        return True   # the host lane cannot be used: the server decides alone
    return local.head


def joined(local: Local) -> None:
    """The head is in the server's queue (or is done waiting): its local entry goes."""
    ticket, local.ticket = local.ticket, None
    if ticket is not None:
        ticket.leave()


def let_go(local: Local) -> None:
    joined(local)
    if local.head:
        local.head = False
        try:
            local.flock._hand_on(local.handle)
        except OSError:
            pass


def wait_head(local: Local, timeout: float | None, cancel, rank: int) -> bool:
    """Wait on the host lane in the local order, with the turn's own arrival, until head (True),
    timeout or the caller's cancel (False). The flock wait is given an Event of its own (it sets
    it when the lock comes); the caller's cancel reaches it through cancel() (cancel_wait)."""
    from ...priority import CLASSES
    from .. import order

    flock, handle = local.flock, local.handle
    deadline = None if timeout is None else time.monotonic() + timeout
    while not (cancel is not None and cancel.is_set()):
        found = flock._queue(handle)
        ticket = None
        if found is not None:
            try:
                ticket = found.join(rank, {**(handle.asker or {}), "class": CLASSES[rank],
                                           "pid": os.getpid()}, arrival=int(local.since * 1e9))
            except OSError:
                ticket = None   # the kernel's order on the host lane, unannounced
        local.wake = threading.Event()
        if cancel is not None and cancel.is_set():
            local.wake.set()
        try:
            local.head = order.wait(_HeadLine(flock, handle, ticket), _left(deadline),
                                    local.wake)
        finally:
            local.wake = None
            if local.head:
                local.ticket = ticket   # left once it has joined the server's queue
            elif ticket is not None:
                ticket.leave()
        left = _left(deadline)
        if local.head or (left is not None and left <= 0):
            return local.head
    return False


class _HeadLine(FlockLine):
    """The host lane's walk, whose entry the walk does not leave (wait_head does)."""

    def leave(self) -> None:
        pass


def cancel(local: Local) -> None:
    """Give up the wait on the host lane (store.cancel_wait, from another thread)."""
    wake = local.wake
    if wake is not None:
        wake.set()


def someone_ahead(local: Local, rank: int) -> bool:
    """Does a live waiter of this host stand before this head in the local order (one listing,
    and a lock test only of the entries ahead)?"""
    from ...priority import order_key

    found = local.flock._queue(local.handle)
    if found is None:
        return False
    now = time.monotonic_ns()
    arrival = int(local.since * 1e9)
    mine = order_key(rank, arrival, (now - arrival) / 1e9, found.aging, "~")
    own = local.ticket.entry.name if local.ticket is not None else None
    try:
        before = [entry for entry in found.listed()
                  if entry.key(now, found.aging) < mine and entry.name != own]
        return found.first_alive(before) is not None
    except OSError:
        return False


def wait(store, handle, timeout: float | None, cancel, rank: int) -> bool:
    """store.wait_lock through the host lane: wait here until head, then in the server as the
    host's one connection; stepping aside for a waiter of this host that comes to stand ahead."""
    from ...errors import GateUnavailable, ServerCrowded

    local = handle.local
    local.handle.asker = handle.asker   # who waits, for the host lane's entry (`status`)
    deadline = None if timeout is None else time.monotonic() + timeout
    if local.since is None:
        local.since = time.monotonic()
    while True:
        if not local.head and not try_head(local, rank):
            store.disconnect(handle)   # a waiter that is not its host's head holds no connection
            if not wait_head(local, _left(deadline), cancel, rank):
                return False
        try:
            store.connected(handle)
        except ServerCrowded:
            let_go(local)
            raise
        except GateUnavailable as error:
            raise ungated(local, error) from None
        aside = threading.Event()
        stop = _Either(cancel, aside)
        watch = _AsideWatch(store, handle, rank, cancel, aside, stop)
        watch.start()
        try:
            got = store.wait_in_server(handle, _left(deadline), stop, rank,
                                       time.monotonic() - local.since)
        finally:
            watch.finish()
        if got:
            let_go(local)
            return True
        if not aside.is_set() or (cancel is not None and cancel.is_set()):
            let_go(local)
            return False
        # Stepped aside: out of the server's queue (the session's end takes its ticket lock and
        # any lock it got as it stopped), back in the local queue with its arrival.
        store.disconnect(handle)
        handle.cancelled = False
        let_go(local)
        left = _left(deadline)
        if left is not None and left <= 0:
            return False


class _Either:
    """The walk's cancel (an Event's is_set): the caller's cancel or a step aside."""

    def __init__(self, *events):
        self.events = [event for event in events if event is not None]

    def is_set(self) -> bool:
        return any(event.is_set() for event in self.events)

    def set(self) -> None:
        self.events[-1].set()

    def wait(self, timeout: float | None = None) -> bool:
        end = None if timeout is None else time.monotonic() + timeout
        while not self.is_set():
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                return False
            time.sleep(0.05 if left is None else min(0.05, left))
        return True


class _AsideWatch(threading.Thread):
    """While the head waits in the server: a look at the local queue every ASIDE_LOOK; a waiter
    ahead of it (or the caller's cancel) breaks the server wait through store.cancel_wait."""

    def __init__(self, store, handle, rank, cancel, aside, stop):
        super().__init__(daemon=True, name="lanelock-host-head")
        self.store, self.handle, self.rank = store, handle, rank
        self.cancel, self.aside, self.stop = cancel, aside, stop
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(ASIDE_LOOK):
            if self.cancel is not None and self.cancel.is_set():
                self.store.cancel_wait(self.handle)
                return
            if someone_ahead(self.handle.local, self.rank):
                self.aside.set()
                self.store.cancel_wait(self.handle)
                return

    def finish(self) -> None:
        self.done.set()
        self.join()


def ungated(local: Local, error):
    """The head cannot reach the server: it keeps the host lane while its turn runs ungated
    (store.keeps_place; released at the turn's end), and the one warning says so."""
    from ...errors import GateUnavailable

    local.ungated = True
    return GateUnavailable(f"{error}; ungated across hosts, this host's turns still one at a "
                           "time")


# -- the release: no gap for another host's later waiter ----------------------------------------
def next_head_pending(local: Local) -> bool:
    """Is a turn of this host waiting, or its head connecting (the host lane held by another)?"""
    import fcntl

    found = local.flock._queue(local.handle)
    try:
        if found is not None and found.first_alive(found.listed()) is not None:
            return True
    except OSError:
        return False
    fd = local.handle.fd
    if fd is None:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True   # a head holds it
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def await_next_head(local: Local, joined) -> None:
    """Before a holder lets the lane go: while a turn of this host waits and none of this host is
    in the server's queue yet (joined(): one look), wait for it, at most NEXT_JOIN."""
    end = time.monotonic() + NEXT_JOIN
    while next_head_pending(local) and not joined() and time.monotonic() < end:
        time.sleep(NEXT_LOOK)


# -- status: the local queues under this root -------------------------------------------------
def local_rows(root_path: str, dsn: str, lane: str, aging: float) -> list[dict]:
    """The waiters of every host lane of this store lane under the root (this host's: a root
    is one machine's), as store/flock/queue.py describes them."""
    from ..flock.queue import Queue

    prefix = lane_prefix(dsn, lane)
    try:
        names = os.listdir(root_path)
        root_fd = os.open(root_path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return []
    rows = []
    try:
        for name in names:
            if name.startswith(prefix) and name.endswith(".queue"):
                queue = Queue(root_fd, name[:-len(".queue")], aging)
                try:
                    rows += queue.describe()
                except OSError:
                    pass
                finally:
                    queue.close()
    finally:
        os.close(root_fd)
    return rows


def merged(server: list[dict], local: list[dict]) -> list[dict]:
    """One order of the server's queue and the local queues: effective class, then the longest
    wait (one measure for both: a head's server arrival counts its local wait)."""
    from ...priority import CLASSES

    if not local:
        return server
    rows = sorted(server + local, key=lambda row: (-CLASSES.index(row["effective_class"]),
                                                   -(row.get("waited") or 0.0)))
    return [dict(row, position=position) for position, row in enumerate(rows, 1)]


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else deadline - time.monotonic()
