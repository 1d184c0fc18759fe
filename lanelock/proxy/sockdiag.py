"""The client end of a loopback connection, asked of the kernel: its socket's inode and owner uid.

One sock_diag request (NETLINK_SOCK_DIAG, SOCK_DIAG_BY_FAMILY without NLM_F_DUMP) names the
socket by its four-tuple and the kernel finds it in its hash table: one round trip, whatever the
number of sockets on the machine. Reading /proc/net/tcp (tcp6) instead walks every socket of the
namespace, TIME_WAIT ones included -- thousands on a proxy that opens a connection to the engine
per request -- for milliseconds a request. That table is still read when the kernel has no
sock_diag for TCP (the tcp_diag module absent): client_process.py.
"""

from __future__ import annotations

import socket
import struct

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 1
NLMSG_ERROR = 2
INET_DIAG_NOCOOKIE = 0xFFFFFFFF
ALL_STATES = 0xFFFFFFFF
_HEADER = struct.Struct("=IHHII")             # nlmsghdr
_REQUEST = struct.Struct("=BBBBI")            # inet_diag_req_v2 up to its inet_diag_sockid
_SOCKID = struct.Struct(">HH16s16s")           # sport, dport, src, dst (network order)
_TAIL = struct.Struct("=III")                 # the sockid's interface and cookie
_MESSAGE = struct.Struct("=BBBB48sIIIII")     # inet_diag_msg


class Unavailable(Exception):
    """The kernel cannot answer (no sock_diag for TCP here): read the /proc tables instead."""


def socket_of(peer, local) -> tuple[int, int] | None:
    """(inode, uid) of the socket whose own address is peer and whose remote address is local
    (a client's end of its connection to the proxy), None when there is no such socket.
    Raises Unavailable when the kernel cannot be asked."""
    family, source, destination = _addresses(peer[0], local[0])
    query = (_REQUEST.pack(family, socket.IPPROTO_TCP, 0, 0, ALL_STATES)
             + _SOCKID.pack(int(peer[1]), int(local[1]), source, destination)
             + _TAIL.pack(0, INET_DIAG_NOCOOKIE, INET_DIAG_NOCOOKIE))
    message = _HEADER.pack(_HEADER.size + len(query), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, 1, 0)
    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC,
                           NETLINK_SOCK_DIAG) as link:
            link.sendto(message + query, (0, 0))
            answer = link.recv(8192)
    except (OSError, AttributeError) as error:   # no netlink here (another kernel, a sandbox)
        raise Unavailable(str(error)) from None
    if len(answer) < _HEADER.size:
        raise Unavailable("a short answer")
    kind = _HEADER.unpack_from(answer)[1]
    if kind == NLMSG_ERROR:
        code = -struct.unpack_from("=i", answer, _HEADER.size)[0]
        if code == 2:   # ENOENT: no such socket (the client is gone, or not on this machine)
            return None
        raise Unavailable(f"errno {code}")
    if kind != SOCK_DIAG_BY_FAMILY or len(answer) < _HEADER.size + _MESSAGE.size:
        raise Unavailable(f"an answer of type {kind}")
    fields = _MESSAGE.unpack_from(answer, _HEADER.size)
    uid, inode = fields[8], fields[9]
    return (inode, uid) if inode else None


def _addresses(client: str, server: str) -> tuple[int, bytes, bytes]:
    """(family, client address, server address), 16 bytes each as inet_diag_sockid holds them.
    An IPv4 client seen by a dual-stack listener as ::ffff:a.b.c.d is asked as IPv4: its own
    socket is one."""
    one, other = _packed(client), _packed(server)
    if len(one) != len(other):
        raise Unavailable("mixed address families")
    family = socket.AF_INET if len(one) == 4 else socket.AF_INET6
    return family, one.ljust(16, b"\0"), other.ljust(16, b"\0")


def _packed(text: str) -> bytes:
    """The address's bytes (4 for IPv4 and IPv4-mapped IPv6, else 16): inet_pton, not
    ipaddress's parser in Python, on every new connection's path."""
    text = str(text).split("%")[0]
    if text.startswith("::ffff:") and "." in text:
        text = text[7:]
    try:
        return socket.inet_pton(socket.AF_INET6 if ":" in text else socket.AF_INET, text)
    except OSError:
        raise ValueError(f"not an address: {text!r}") from None
