"""The process behind a proxy's client connection, read from /proc.

A request from inside a turn is part of it, through the proxy too: a `lanelock run` job whose
client points at the proxy is never refused by its own lane. The proxy asks only when a
gated request finds the lane busy: the client's end of the connection is a socket whose local
address is the request's peer and whose remote address is the proxy's; the kernel gives its
inode, and the process holding socket:[inode] among its descriptors is the client
(socket_owner.py: the processes that were clients lately first, then the socket's uid's).

A request that names no session (no session header, no `user` field) is named after its client
process (session()): the LANELOCK_SESSION of its environment when it runs inside a turn (a turn
hands its command its session with its tokens, gate.py), else user@NAME/PID -- so two agents on
one machine are two sessions (linger keeps the lane for one, not for both; status, history and -v
tell them apart). That lookup is made once per connection (Names: a keep-alive client's later
requests reuse it while its process runs); a client that is not on loopback, or cannot be found,
is named by its address.

Where the client cannot be read -- another user's process, for a proxy that is not root -- no
owner is found and the request is outside every turn. A request that sent turn.headers is judged
by those tokens, and may come from the holder itself (handover.py).
"""

from __future__ import annotations

import ipaddress
import os
import threading
import weakref
from collections import OrderedDict

from ..handover import HEADER, Asker, process
from ..proc import start_ticks
from .socket_owner import owners

CONNECTIONS = 1024   # connections whose client's name is kept (the proxy's --max-connections)
LATER = object()     # session(scan=False): only a pass over /proc can tell
_LOOPBACK = frozenset({"127.0.0.1", "::1", "::ffff:127.0.0.1"})


class Names:
    """Each open connection's client (pid, start time, session), so that a keep-alive client is
    looked up once, not per request. Bounded: at most CONNECTIONS, the least recently used
    going first, and an entry whose connection is gone is never answered (its transport is
    held weakly); an entry whose process no longer runs with its start time is looked up
    again."""

    def __init__(self, size: int = CONNECTIONS):
        self.size = size
        self._kept: OrderedDict[int, tuple] = OrderedDict()
        self._lock = threading.Lock()   # asked from the event loop's thread pool

    def get(self, transport) -> tuple | None:
        with self._lock:
            kept = self._kept.get(id(transport))
            if kept is None or kept[0]() is not transport:
                return None
            self._kept.move_to_end(id(transport))
        if start_ticks(kept[1][0]) != kept[1][1]:   # gone, or another process with its pid
            return None
        return kept[1]

    def put(self, transport, named: tuple) -> None:
        with self._lock:
            self._kept[id(transport)] = (weakref.ref(transport), named)
            self._kept.move_to_end(id(transport))
            while len(self._kept) > self.size:
                self._kept.popitem(last=False)

    def __len__(self) -> int:
        return len(self._kept)


NAMES = Names()


class Bounded:
    """A dict of at most size entries, the least recently used going first."""

    def __init__(self, size: int):
        self.size = size
        self._kept: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key):
        with self._lock:
            if key in self._kept:
                self._kept.move_to_end(key)
            return self._kept.get(key)

    def put(self, key, value) -> None:
        with self._lock:
            self._kept[key] = value
            self._kept.move_to_end(key)
            while len(self._kept) > self.size:
                self._kept.popitem(last=False)


# Each recent client process's session by (pid, start time): a client opening a connection per
# request is named by its environment once, not per connection (the environment a process was
# started with does not change; a new process with its pid has another start time).
PROCESSES = Bounded(64)


class ClientProcess:
    """The process behind a request's connection, looked up only when asked: its name
    (session(), program()) once per connection, the gate's askers (handover.py) only when the
    gate asks (a held lane), with the tokens the request sent in turn.headers' header if it
    sent any, else those of the process's environment."""

    __slots__ = ("peer", "local", "sent", "lock_path", "pids", "_looked", "_transport")

    def __init__(self, request, lock_path: str):
        transport = self._transport = request.transport
        self.peer = transport.get_extra_info("peername") if transport is not None else None
        self.local = transport.get_extra_info("sockname") if transport is not None else None
        self.sent = request.headers.get(HEADER)
        self.lock_path = lock_path
        self.pids: list[int] = []   # found by session() or askers(), whichever came first
        self._looked = False        # every owner looked up (askers())

    def _owners(self) -> list[int]:
        if not self._looked:
            self.pids, self._looked = owners(self.peer, self.local), True
        return self.pids

    def _named(self, scan: bool = True):
        """(pid, session) of the client's process: the connection's, when an earlier request
        on it named it and that process still runs (its start time unchanged); else looked up
        (socket_owner.py) and kept for the connection's next requests. scan=False: LATER when
        only a pass over /proc could find it (the caller does that off the event loop)."""
        if self._transport is None:
            return None
        kept = NAMES.get(self._transport)
        if kept is not None:
            self.pids = self.pids or [kept[0]]
            return kept[0], kept[2]
        pids = self.pids or owners(self.peer, self.local, every=False, scan=scan)
        if pids is None:
            return LATER
        if not pids:
            return None
        self.pids = pids
        pid = min(pids)
        started = start_ticks(pid)
        session = PROCESSES.get((pid, started)) if started is not None else None
        if session is None:
            session = session_of(pid)
            if started is not None and session is not None:
                PROCESSES.put((pid, started), session)
        if started is not None and session is not None:
            NAMES.put(self._transport, (pid, started, session))
        return pid, session

    def session(self, scan: bool = True):
        """The session of a loopback client's process (module doc), None when there is none to
        find (not loopback, gone, unreadable). scan=False: a few system calls at most (the
        connection's name kept, or a recent client's process holding the socket), LATER when
        the answer needs a pass over /proc."""
        try:
            if not _loopback(self.peer) or not isinstance(self.local, tuple):
                return None
            named = self._named(scan)
            return named if named is LATER else named[1] if named else None
        except OSError:   # /proc unreadable now (out of descriptors): named by its address
            return None

    def program(self) -> str | None:
        """The name of a loopback client's process, as ps shows it (/proc/PID/comm), None when
        there is none to find (a per-client rule names it: clients.py)."""
        from ..proc import name

        try:
            if not _loopback(self.peer) or not isinstance(self.local, tuple):
                return None
            named = self._named()
        except OSError:
            return None
        return name(named[0]) if named else None

    def askers(self) -> list[Asker | None]:
        try:
            return self._askers()
        except OSError:   # /proc unreadable now (out of descriptors): outside every turn
            return []

    def _askers(self) -> list[Asker | None]:
        if not isinstance(self.peer, tuple) or not isinstance(self.local, tuple):
            return []   # not a TCP client (a Unix socket): outside every turn
        found = [process(pid, self.sent) for pid in self._owners()]
        # Asking the store reads /proc/locks, milliseconds during which every flock() on the
        # machine waits: not for a client that was handed no turn and has not even opened the
        # lane's lock -- it can be neither part of the holding turn nor its holder, and is
        # outside every turn.
        lock = _identity(self.lock_path)
        if lock is not None and all(asker is not None and not asker.turns
                                    and not opens(asker.pid, lock) for asker in found):
            return []
        return found

    def holds(self, holder: dict | None) -> bool:
        """Is the client the process that holds the lane (as the gate's deflection found it:
        on a lane of seats, any seat's holder)?"""
        if not isinstance(holder, dict):
            return False
        seated = holder.get("holders")
        every = seated if isinstance(seated, list) else [holder]
        return any(isinstance(one, dict) and one.get("pid") in self.pids for one in every)


def session_of(pid: int) -> str | None:
    """LANELOCK_SESSION from pid's environment (as it was at exec), else user@NAME/PID; None
    when the process is gone."""
    from ..proc import environ, files_uid, name

    try:
        raw = environ(pid)
    except OSError:
        raw = b""   # another user's, for a proxy that is not root: its name and pid still
    for entry in raw.split(b"\0"):
        if entry.startswith(b"LANELOCK_SESSION="):
            value = entry[len(b"LANELOCK_SESSION="):].decode("utf-8", "replace").strip()
            if value:
                return value
    called, uid = name(pid), files_uid(pid)
    if called is None or uid is None:
        return None
    return f"{_user(uid)}@{called}/{pid}"


def _user(uid: int) -> str:
    try:
        import pwd

        return pwd.getpwuid(uid).pw_name
    except (KeyError, ImportError):
        return str(uid)


def _loopback(peer) -> bool:
    if not isinstance(peer, tuple):
        return False
    if peer and peer[0] in _LOOPBACK:   # the usual spellings, without parsing them per request
        return True
    try:
        address = ipaddress.ip_address(str(peer[0]).split("%")[0])
    except (ValueError, IndexError):
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def opens(pid: int, target: tuple[int, int]) -> bool:
    """Has pid a descriptor on the file whose (st_dev, st_ino) is target? True when its
    descriptors cannot be read (then the store is asked)."""
    try:
        descriptors = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return True
    for fd in descriptors:
        try:
            found = os.stat(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if (found.st_dev, found.st_ino) == target:
            return True
    return False


def _identity(path: str) -> tuple[int, int] | None:
    """(st_dev, st_ino) of a lane's lock file; None when it is no file here (another store)."""
    try:
        found = os.stat(path)
    except (OSError, TypeError, ValueError):
        return None
    return found.st_dev, found.st_ino
