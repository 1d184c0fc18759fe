"""The process behind a proxy's client connection, read from /proc.

A request from inside a turn is part of it, through the proxy too: a `lanelock run` job whose
client points at the proxy is never refused by its own lane. The proxy asks only when a
gated request finds the lane busy: the client's end of the connection is a socket whose local
address is the request's peer and whose remote address is the proxy's; /proc/net/tcp (tcp6) gives
its inode, and the process holding socket:[inode] among its descriptors is the client. Both files
list this network namespace's sockets, which is where a loopback client lives.

A request that names no session (no session header, no `user` field) is named after its client
process (session()): the LANELOCK_SESSION of its environment when it runs inside a turn (a turn
hands its command its session with its tokens, gate.py), else user@NAME/PID -- so two agents on
one machine are two sessions (linger keeps the lane for one, not for both; status, history and -v
tell them apart). That lookup is made for every such request; a client that is not on loopback,
or cannot be found, is named by its address.

Where the client cannot be read -- another user's process, for a proxy that is not root -- no
owner is found and the request is outside every turn. A request that sent turn.headers is judged
by those tokens, and may come from the holder itself (handover.py).
"""

from __future__ import annotations

import ipaddress
import os
import sys

from ..handover import HEADER, Asker, process


class ClientProcess:
    """The process behind a request's connection, looked up only when the gate asks (a busy
    lane): the gate's askers (handover.py), with the tokens the request sent in turn.headers'
    header if it sent any, else those of the process's environment."""

    __slots__ = ("peer", "local", "sent", "lock_path", "pids", "_looked")

    def __init__(self, request, lock_path: str):
        transport = request.transport
        self.peer = transport.get_extra_info("peername") if transport is not None else None
        self.local = transport.get_extra_info("sockname") if transport is not None else None
        self.sent = request.headers.get(HEADER)
        self.lock_path = lock_path
        self.pids: list[int] = []   # found by session() or askers(), whichever came first
        self._looked = False

    def _owners(self) -> list[int]:
        if not self._looked:
            self.pids, self._looked = owners(self.peer, self.local), True
        return self.pids

    def session(self) -> str | None:
        """The session of a loopback client's process (module doc), None when there is none to
        find (not loopback, gone, unreadable)."""
        try:
            if not _loopback(self.peer) or not isinstance(self.local, tuple):
                return None
            pids = self._owners()
            return session_of(min(pids)) if pids else None
        except OSError:   # /proc unreadable now (out of descriptors): named by its address
            return None

    def program(self) -> str | None:
        """The name of a loopback client's process, as ps shows it (/proc/PID/comm), None when
        there is none to find (a per-client rule names it: clients.py)."""
        from ..proc import name

        try:
            if not _loopback(self.peer) or not isinstance(self.local, tuple):
                return None
            pids = self._owners()
        except OSError:
            return None
        return name(min(pids)) if pids else None

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
    try:
        address = ipaddress.ip_address(str(peer[0]).split("%")[0])
    except (ValueError, IndexError):
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def owners(peer, local) -> list[int]:
    """Pids holding the client end of the connection peer -> local."""
    found = _socket(peer, local)
    if found is None:
        return []
    inode, uid = found
    target = f"socket:[{inode}]"
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if os.stat(f"/proc/{name}").st_uid != uid:   # the socket's owner: skip the rest
                continue
            descriptors = os.listdir(f"/proc/{name}/fd")
        except OSError:   # gone, or not ours to read
            continue
        for fd in descriptors:
            try:
                if os.readlink(f"/proc/{name}/fd/{fd}") == target:
                    pids.append(int(name))
                    break
            except OSError:
                continue
    return pids


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


def _socket(peer, local) -> tuple[int, int] | None:
    """(inode, uid) of the socket whose local address is peer and remote address is local.

    The tables are read a line at a time, up to the socket sought: they list every socket of the
    namespace, TIME_WAIT ones included -- thousands under load, the proxy's own connections to
    the engine among them (a new one per request) -- and a table read whole was a buffer of up
    to megabytes per busy request, grown by reallocation in a pool thread, whose malloc arena
    kept the holes (the proxy's RSS rose with the table's size, tests/test_proxy_memory.py)."""
    try:
        wanted = {(mine.encode(), theirs.encode()) for mine in _spellings(peer[0], peer[1])
                  for theirs in _spellings(local[0], local[1])}
    except (TypeError, ValueError, IndexError):
        return None
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table, "rb") as handle:
                next(handle, None)   # the column names
                for line in handle:
                    words = line.split()
                    if len(words) > 9 and (words[1], words[2]) in wanted:
                        try:
                            inode, uid = int(words[9]), int(words[7])
                        except ValueError:
                            continue
                        if inode:
                            return inode, uid
        except OSError:
            continue
    return None


def _spellings(host: str, port: int) -> list[str]:
    """How the kernel writes host:port in /proc/net/tcp (tcp6): each 32-bit word of the address
    as the host's byte order reads it, in hex, then the port. An IPv4-mapped address is listed
    both ways (a dual-stack listener sees an IPv4 client as ::ffff:a.b.c.d)."""
    address = ipaddress.ip_address(str(host).split("%")[0])
    packed = [address.packed]
    if address.version == 6 and address.ipv4_mapped is not None:
        packed.append(address.ipv4_mapped.packed)
    elif address.version == 4:
        packed.append(ipaddress.IPv6Address(f"::ffff:{address}").packed)
    return ["".join(f"{int.from_bytes(raw[i:i + 4], sys.byteorder):08X}"
                    for i in range(0, len(raw), 4)) + f":{int(port):04X}" for raw in packed]
