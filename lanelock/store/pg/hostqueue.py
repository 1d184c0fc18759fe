"""A host's waiting turns share two server connections: server connections are one per holder plus
at most two per host that has waiters (its head's and its next waiter's), whatever the number of
waiters (pgbouncer's rule: client connections are cheap, server connections are not).

Each PostgreSQL lane has, on every host, a HOST QUEUE: the queue of a flock lane under the lock
root every process of this host computes (LANELOCK_DIR or the default root), named from the
store's DSN, the lane and the host's name (stem HOST_PREFIX + digests: a hidden name, so flock's
`status --all` lists no such lane). A waiting turn joins it first, with the flock store's own
entries, order (classes, aging, arrival) and kernel waits. The first live waiter of a host (a
stopped one passed over) is its HEAD: only the head waits in the server's queue (store/order.py
with PgLine); the others wait in the kernel on the entry just ahead of them. The waiter just
behind the head is its NEXT: it holds a connection of its own while it waits there, so that when
the head takes the lane it joins the server's queue at once -- a connect (a backend forked, its
settings and first statements) was the whole of a hand-off inside a queue of short turns. A
head rings its entry once it has joined (Ticket.ring: the waiter behind it looks again, and
finds itself next); a next that is pushed back (a higher class arrived ahead) lets its
connection go within STANDBY_LOOK.

Invariants:
- A turn connects only as head or next, or for a try while no turn of this host of its class or
  higher waits (try_lock), so a host's waiters cost the server two connections.
- A turn's entry stays in its host's queue from its first wait until it has the lane or is done
  waiting, whatever it does meanwhile: its arrival is kept, `status` lists it, and the waiters
  behind it wait on it. The head joins the server's queue with that arrival: clock_timestamp()
  minus the seconds it has waited on its host (time.monotonic(), the host queue's clock), so FIFO
  and aging count its whole wait across hosts.
- A head waiting in the server that sees a waiter of its host ahead of it in the local order (an
  interactive turn behind a batch head) steps aside: it leaves the server's queue and closes its
  connection, and waits on its host again. It looks at the host's queue every ASIDE_LOOK (a
  directory listing); never a server statement on a schedule. A head that gets the lane with
  such a waiter ahead of it gives the lane way once that waiter has joined the server's queue.
- A holder that lets the lane go while its host's next head is still connecting waits for that
  head's row in the server's queue (at most NEXT_JOIN): otherwise another host's later waiter
  would take the free lane in the gap (no barging across hosts).
- A head that cannot reach the server takes the host lane's lock and keeps it and its entry while
  its turn runs ungated (the gate fails it open and lets both go at the turn's end): this host's
  turns still go one at a time.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time

from ..flock.line import FlockLine
from .session import ended

ASIDE_LOOK = 0.2    # how often a head waiting in the server looks at its host's local queue
STANDBY_LOOK = 0.2  # how often the host's next waiter, connected, looks whether it still is
NEXT_JOIN = 2.0     # how long a releasing holder waits for its host's next head to join
NEXT_LOOK = 0.01    # how often it looks meanwhile when the head's entry cannot be watched
HOST_PREFIX = ".pg-host-"


class HostLane:
    """The lane object the flock store needs (name, stem) for a host lane."""

    __slots__ = ("name", "stem")

    def __init__(self, name: str, stem: str):
        self.name, self.stem = name, stem


class Local:
    """One turn's place on its host lane: a flock handle of its own (flock is per open file
    description, so the threads of one process -- a proxy's requests -- exclude each other)."""

    __slots__ = ("flock", "handle", "since", "ungated", "wake", "ticket")

    def __init__(self, flock, handle):
        self.flock, self.handle = flock, handle
        self.since: float | None = None   # time.monotonic() when the turn began waiting
        self.ungated = False     # kept the host lane for a turn run ungated (server unreachable)
        self.wake = None         # the Event of the wait on the host lane under way (cancel())
        self.ticket = None       # its entry in the host's queue (place())

    def close(self) -> None:
        leave(self)
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
    waits in the server with a connection of its own)."""
    from ...errors import GateUnavailable

    stem = host_stem(dsn, lane)
    try:
        return Local(flock, flock.open(HostLane(stem, stem)))
    except (GateUnavailable, OSError):
        return None


# -- the head ---------------------------------------------------------------------------------
def ahead_here(local: Local, rank: int) -> bool:
    """Is a live turn of this host queued at this class or higher (a head or a waiter)? Then a
    try is busy, without connecting."""
    found = local.flock.queue_of(local.handle)
    if found is None:
        return False
    try:
        return found.waiting_at_or_above(rank)
    except OSError:
        return False   # the local queue cannot be read: the server decides alone


def place(local: Local, rank: int):
    """This turn's entry in its host's queue: joined once, with the moment it began waiting,
    and kept -- through its time as head, a step aside, a turn run ungated -- until it has the
    lane or is done waiting (leave()). None when the local queue cannot be used."""
    import fcntl

    from ...priority import CLASSES

    if local.ticket is not None:
        return local.ticket
    found = local.flock.queue_of(local.handle)
    if found is None:
        return None
    try:
        found.open(create=True)
        # Arrivals taken and entries shown under one lock (the queue directory's, this
        # descriptor's own): an entry that shows later arrived later, so a turn that finds
        # no one ahead of it is first -- two never both connect as heads.
        fcntl.flock(found.dir_fd, fcntl.LOCK_EX)
        try:
            if local.since is None:
                local.since = time.monotonic()
            local.ticket = found.join(rank, {**(local.handle.asker or {}),
                                             "class": CLASSES[rank], "pid": os.getpid()},
                                      arrival=int(local.since * 1e9))
        finally:
            fcntl.flock(found.dir_fd, fcntl.LOCK_UN)
    except OSError:
        local.ticket = None
    if local.since is None:
        local.since = time.monotonic()
    return local.ticket


def leave(local: Local) -> None:
    ticket, local.ticket = local.ticket, None
    if ticket is not None:
        ticket.leave()


def wait_first(local: Local, timeout: float | None, cancel, rank: int, standby) -> bool:
    """Until this turn is the first live waiter of its host (a stopped one passed over, as the
    flock store's queue does): True; timeout or the caller's cancel: False. The walk is
    store/order.py's (wait_first): each wait the kernel's, on the entry just ahead
    (FlockLine.behind), looked at again at this turn's next aging step and every
    order.STOPPED_LOOK. standby(next_up) runs before each wait: next_up when the entry ahead is
    the host's head (this turn is the next); it says whether this turn now holds a connection
    -- a standby looks again every STANDBY_LOOK, so one pushed back (a higher class arrived)
    lets its connection go within that."""
    from .. import order

    ticket = place(local, rank)
    if ticket is None:
        return True   # no local queue: the server's order alone
    return order.wait_first(_HostLine(local, ticket, standby), timeout, cancel)


class _HostLine(FlockLine):
    """The host queue's medium for the walk: the flock store's, but each wait on an Event of
    its own (the kernel wait sets it when the lock comes; the caller's cancel reaches it through
    cancel(): cancel_wait), after standby() says whether this turn, next or not, is connected."""

    def __init__(self, local: Local, ticket, standby):
        super().__init__(local.flock, local.handle, ticket)
        self.local, self.standby = local, standby

    def behind(self, entry, timeout: float | None, cancel=None) -> None:
        from .. import order

        if self.standby(next_up(self.local, entry)):
            timeout = order.least(timeout, STANDBY_LOOK)
        self.local.wake = threading.Event()
        if cancel is not None and cancel.is_set():
            self.local.wake.set()
        try:
            super().behind(entry, timeout, cancel=self.local.wake)
        finally:
            self.local.wake = None


def next_up(local: Local, ahead) -> bool:
    """Is the entry just ahead of this turn its host's head (no live waiter of this host
    before it: one listing, a lock test of the entries before it, nearest first)?"""
    from .. import order

    found = local.flock.queue_of(local.handle)
    if found is None:
        return False
    now = time.monotonic_ns()
    try:
        return order.just_ahead(ahead.at(now), found.listed(now), found.aging, found) is None
    except OSError:
        return False


def stand_by(store, handle):
    """wait_first's standby for a turn of store: the host's next waiter connects while the head
    waits, so that when the head takes the lane it joins the server's queue at once -- a connect
    (a backend forked, its settings, its first statements: tens of ms on a busy machine, several
    round trips on a far server) was the whole of a hand-off inside a queue. One that is not
    next holds none. The connect is tried once per wait: a server that cannot be reached is
    said when this turn is the head, as before."""
    from ...errors import GateUnavailable, ServerCrowded

    tried = False

    def standby(next_up: bool) -> bool:
        nonlocal tried
        if not next_up:
            store.disconnect(handle)
            return False
        if handle.conn is None and not tried:
            tried = True
            try:
                store.connected(handle)
            except (GateUnavailable, ServerCrowded):
                pass
        return handle.conn is not None

    return standby


def joined(local: Local | None) -> None:
    """This host's head has joined the server's queue (or could not): the waiter now next is
    rung (Ticket.ring), to connect while this one waits -- after the join, which a releasing
    holder of this host waits for, so the next one's connect never delays it."""
    ticket = None if local is None else local.ticket
    if ticket is not None:
        ticket.ring()


def cancel(local: Local) -> None:
    """Give up the wait in the host's queue (store.cancel_wait, from another thread)."""
    wake = local.wake
    if wake is not None:
        wake.set()


def someone_ahead(local: Local, rank: int) -> bool:
    """Does a live waiter of this host stand before this head in the local order (one listing,
    and a lock test only of the entries ahead)?"""
    found = local.flock.queue_of(local.handle)
    ticket = local.ticket
    if found is None or ticket is None:
        return False
    from .. import order

    now = time.monotonic_ns()
    try:
        return order.just_ahead(ticket.entry.at(now), found.listed(now), found.aging,
                                found) is not None
    except OSError:
        return False


def wait(store, handle, timeout: float | None, cancel, rank: int) -> bool:
    """store.wait_lock through the host's queue: wait there until first (connected once next),
    then in the server as the host's head; stepping aside for a waiter of this host that comes to stand
    ahead, and giving the lane way when one stands ahead as it comes."""
    from ...errors import GateUnavailable, ServerCrowded

    local = handle.local
    local.handle.asker = handle.asker   # who waits, for the host queue's entry (`status`)
    deadline = None if timeout is None else time.monotonic() + timeout
    _load_driver_meanwhile()
    while True:
        # a waiter that is neither its host's first nor next holds no connection
        if not wait_first(local, _left(deadline), cancel, rank, stand_by(store, handle)):
            leave(local)
            return False
        if handle.conn is not None and ended(handle.conn):   # a standby's session ended
            store.disconnect(handle)
        try:
            store.connected(handle)
        except ServerCrowded:
            leave(local)
            raise
        except GateUnavailable as error:
            if not host_lock(local, _left(deadline)):
                leave(local)
                return False   # another turn of this host runs ungated past this one's wait
            raise ungated(local, error) from None
        aside = threading.Event()
        stop = _Either(cancel, aside)
        watch = _AsideWatch(store, handle, rank, cancel, aside, stop)
        watch.start()
        if local.ticket is not None:   # `status` lists the head once: its server row
            handle.asker = {**(handle.asker or {}), "entry": local.ticket.entry.name}
        try:
            got = store.wait_in_server(handle, _left(deadline), stop, rank,
                                       time.monotonic() - local.since)
        finally:
            watch.finish()
        if got and not someone_ahead(local, rank):
            leave(local)
            return True
        if got:   # a turn of this host came to stand ahead before this one could step aside
            give_way(store, handle)
        elif not aside.is_set() or (cancel is not None and cancel.is_set()):
            leave(local)
            return False
        else:   # stepped aside: out of the server's queue (its session's end takes its ticket)
            store.disconnect(handle)
        handle.cancelled = False
        left = _left(deadline)
        if left is not None and left <= 0:
            leave(local)
            return False


def host_lock(local: Local, timeout: float | None) -> bool:
    """The host lane's own lock, within timeout (0: now). Held for a try (one try of this host
    at a time: 25 requests arriving at once at a proxy are one connection, not 25), and by a
    turn of this host that runs ungated (the server cannot be reached) until its end, so this
    host's turns still go one at a time whatever the order of their entries' files."""
    from ..flock import waiting

    try:
        return waiting.wait(local.handle, timeout)
    except OSError:
        return True   # the host lane cannot be locked: the server decides alone


def host_unlock(local: Local) -> None:
    import fcntl

    try:
        fcntl.flock(local.handle.fd, fcntl.LOCK_UN)
    except (OSError, TypeError):
        pass


def ungated(local: Local, error):
    """The head cannot reach the server: it keeps its place in its host's queue while its turn
    runs ungated (store.keeps_place; left at the turn's end), so this host's turns still go one
    at a time, and the one warning says so."""
    from ...errors import GateUnavailable

    local.ungated = True
    return GateUnavailable(f"{error}; ungated across hosts, this host's turns still one at a "
                           "time")


def give_way(store, handle) -> None:
    """The lane came to a head that a turn of its host now stands before (it arrived as the
    lane was handed on): the lane is handed on in the server's order once that turn has joined
    the server's queue, and this one waits on its host again, with its arrival."""
    await_next_head(handle.local, lambda: store.host_queued(handle))
    try:
        store.unlock_lane(handle)   # the unlock wakes the server's queue
    except Exception:  # noqa: BLE001 - the session gone takes the lock with it
        pass
    store.disconnect(handle)


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


def _load_driver_meanwhile() -> None:
    """psycopg costs about 140 ms of CPU to import: a waiter loads it while it waits here, so it
    connects at once when it comes first -- inside a queue of short turns that import was the
    whole hand-off. So with handoff.py, which the take after a wait runs (a turn's first try
    may not: a seat's is seats.py's), about 1 ms when it is imported on the hand-off's path.
    (A thread: the wait must not be joined late for it.)"""
    import sys

    if "psycopg" in sys.modules and __package__ + ".handoff" in sys.modules:
        return

    def load() -> None:
        from ...errors import GateUnavailable
        from . import handoff  # noqa: F401 - loaded, not used here
        from .session import driver

        try:
            driver()
        except GateUnavailable:
            pass   # no driver: said when the turn connects

    threading.Thread(target=load, name="lanelock-driver", daemon=True).start()


class _AsideWatch(threading.Thread):
    """While the head waits in the server: a look at the local queue every ASIDE_LOOK; a waiter
    ahead of it (or the caller's cancel) breaks the server wait through store.cancel_wait.
    Each look runs under `acting`, and finish() sets done under it: once finish() returns, the
    watch breaks nothing -- without waiting for its thread to wake and end (on the hand-off's
    path, that wake-up cost a busy machine's scheduler a turn)."""

    def __init__(self, store, handle, rank, cancel, aside, stop):
        super().__init__(daemon=True, name="lanelock-host-head")
        self.store, self.handle, self.rank = store, handle, rank
        self.cancel, self.aside, self.stop = cancel, aside, stop
        self.done = threading.Event()
        self.acting = threading.Lock()

    def run(self) -> None:
        while not self.done.wait(ASIDE_LOOK):
            with self.acting:
                if self.done.is_set():
                    return
                if self.cancel is not None and self.cancel.is_set():
                    self.store.cancel_wait(self.handle)
                    return
                if someone_ahead(self.handle.local, self.rank):
                    self.aside.set()
                    self.store.cancel_wait(self.handle)
                    return

    def finish(self) -> None:
        with self.acting:
            self.done.set()


# -- the release: no gap for another host's later waiter ----------------------------------------
def await_next_head(local: Local, joined) -> None:
    """Before a holder lets the lane go: while a turn of this host waits (its first connecting)
    and none of this host is in the server's queue yet (joined(): one look), wait for it, at
    most NEXT_JOIN. Woken by that turn's ring, which it sends once it has joined (joined()), or
    by its leave: its entry is watched before each look, so a ring between the two is not
    missed, and nothing is asked on a schedule."""
    from ..flock.queue import Rung

    found = local.flock.queue_of(local.handle)
    if found is None:
        return
    end = time.monotonic() + NEXT_JOIN
    while (head := _next_here(local, found)) is not None:
        try:
            rung = Rung(found, head)
        except OSError:
            rung = None   # it left as we looked (or cannot be opened): asked below all the same
        try:
            if joined():
                return
            left = end - time.monotonic()
            if left <= 0:
                return
            if rung is None:
                time.sleep(min(left, NEXT_LOOK))
            else:
                rung.wait(left)
        finally:
            if rung is not None:
                rung.close()   # at once: the waiter behind the head waits on the same file


def _next_here(local: Local, found):
    """The live turn of this host (another than this one) that goes first in its host's queue
    (found) -- the one that joins the server's queue next -- or None."""
    from .. import order

    own = local.ticket.entry.name if local.ticket is not None else None
    now = time.monotonic_ns()
    try:
        return order.first_in_order([entry for entry in found.listed(now) if entry.name != own],
                                    found.aging, found)
    except OSError:
        return None


# -- status: the local queues under this root -------------------------------------------------
def local_rows(root_path: str, dsn: str, lane: str, aging: float, heads=()) -> list[dict]:
    """The waiters of every host queue of this store lane under the root (this host's: a root
    is one machine's), in the order's status rows -- but the heads (their entries'
    names in heads): the server's queue lists those."""
    from .. import order
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
            if not (name.startswith(prefix) and name.endswith(".queue")):
                continue
            queue = Queue(root_fd, name[:-len(".queue")], aging)
            try:
                # positions are order.merged()'s, across the server's queue and these
                rows.extend(order.status_rows([entry for entry in queue.live_for_status()
                                               if entry.name not in heads], aging, queue))
            except OSError:
                pass
            finally:
                queue.close()
    finally:
        os.close(root_fd)
    return rows


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else deadline - time.monotonic()
