"""Which process holds the client end of a loopback connection to the proxy.

The socket first: its inode and owner uid, from the kernel in one round trip (sockdiag.py), or,
where the kernel has no sock_diag for TCP, from /proc/net/tcp (tcp6) read up to the line sought.
Then the process holding socket:[inode] among its descriptors: first the few processes that
owned a client socket lately (a client opening a connection per request is found at the first
look, whatever the number of processes on the machine), then -- only for a process not seen
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

_recent: OrderedDict[int, None] = OrderedDict()   # pids, newest last
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
        candidates = list(reversed(_recent))
    pids = []
    for pid in candidates:
        if _holds(pid, target):
            pids.append(pid)
            if not every:
                break
    if not pids and not scan:
        return None
    if not pids or every:
        seen = set(pids)
        pids += [pid for pid in _scan(uid, target) if pid not in seen]
    for pid in pids:
        _remember(pid)
    return sorted(pids)


def _remember(pid: int) -> None:
    with _lock:
        _recent[pid] = None
        _recent.move_to_end(pid)
        while len(_recent) > RECENT:
            _recent.popitem(last=False)


def _holds(pid: int, target: str) -> bool:
    try:
        descriptors = os.listdir(f"/proc/{pid}/fd")
    except OSError:   # gone, or not ours to read
        return False
    for fd in descriptors:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                return True
        except OSError:
            continue
    return False


def _scan(uid: int, target: str) -> list[int]:
    """Every process of uid holding target: the whole of /proc, the costly step."""
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if os.stat(f"/proc/{name}").st_uid != uid:   # the socket's owner: skip the rest
                continue
        except OSError:
            continue
        if _holds(int(name), target):
            pids.append(int(name))
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
