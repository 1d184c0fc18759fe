"""Which process holds the client end of a loopback connection to the proxy.

The socket first: its inode and owner uid, from the kernel in one round trip (sockdiag.py), or,
where the kernel has no sock_diag for TCP, from /proc/net/tcp (tcp6) read up to the line sought.
Then the process holding socket:[inode] among its descriptors: first the few processes that
owned a client socket lately, each at the descriptor it was last found on first (a client
opening a connection per request is found at the first look, mostly with one readlink,
whatever the number of processes on the machine), then -- only for a process not seen
before -- that uid's processes in /proc (a /proc/PID of another uid is skipped with one stat).
The recent owners are a bounded list (RECENT), never a list that grows with the connections
served; a remembered pid is only a place to look first (whoever holds the socket owns it).
"""

from __future__ import annotations

import ipaddress
import os
import sys
import threading
from collections import OrderedDict

from . import sockdiag

RECENT = 32   # processes remembered as lately owning a client socket

# pids, newest last, each with the descriptor its client socket was last found on: a process
# that opens a connection per request gets the lowest free descriptor each time, mostly the same
# one, so it is looked at first (one readlink instead of the whole descriptor table).
_recent: OrderedDict[int, str | None] = OrderedDict()
_lock = threading.Lock()   # owners() runs in the event loop's thread pool


def owners(peer, local, *, every: bool = True, scan: bool = True) -> list[int] | None:
    """Pids holding the client end of the connection peer -> local. every=False: the first
    found is enough (naming the client); True: all of them (a forked child shares its parent's
    socket: the gate's askers are each one). scan=False: only the recent owners are looked at,
    None when none of them holds it (then only a scan can tell)."""
    found = client_socket(peer, local)
    if found is None:
        return []
    inode, uid = found
    target = f"socket:[{inode}]"
    with _lock:
        candidates = list(reversed(_recent.items()))
    found = {}   # pid -> the descriptor holding the socket
    for pid, hint in candidates:
        fd = _holds(pid, target, hint)
        if fd is not None:
            found[pid] = fd
            if not every:
                break
    if not found and not scan:
        return None
    if not found or every:
        for pid, fd in _scan(uid, target):
            found.setdefault(pid, fd)
    for pid, fd in found.items():
        _remember(pid, fd)
    return sorted(found)


def _remember(pid: int, fd: str) -> None:
    with _lock:
        _recent[pid] = fd
        _recent.move_to_end(pid)
        while len(_recent) > RECENT:
            _recent.popitem(last=False)


def _holds(pid: int, target: str, hint: str | None = None) -> str | None:
    """The descriptor of pid's on target (socket:[INODE]), None when it has none; hint: the
    descriptor to look at first."""
    if hint is not None:
        try:
            if os.readlink(f"/proc/{pid}/fd/{hint}") == target:
                return hint
        except OSError:
            pass
    try:
        descriptors = os.listdir(f"/proc/{pid}/fd")
    except OSError:   # gone, or not ours to read
        return None
    for fd in descriptors:
        try:
            if fd != hint and os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                return fd
        except OSError:
            continue
    return None


def _scan(uid: int, target: str) -> list[tuple[int, str]]:
    """(pid, descriptor) of every process of uid holding target: the whole of /proc, the costly
    step."""
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if os.stat(f"/proc/{name}").st_uid != uid:   # the socket's owner: skip the rest
                continue
        except OSError:
            continue
        fd = _holds(int(name), target)
        if fd is not None:
            pids.append((int(name), fd))
    return pids


def client_socket(peer, local) -> tuple[int, int] | None:
    """(inode, uid) of the socket whose local address is peer and remote address is local."""
    try:
        return sockdiag.socket_of(peer, local)
    except sockdiag.Unavailable:
        return _table_socket(peer, local)
    except (TypeError, ValueError, IndexError):
        return None


def _table_socket(peer, local) -> tuple[int, int] | None:
    """client_socket() from /proc/net/tcp (tcp6): a kernel without sock_diag for TCP.

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
