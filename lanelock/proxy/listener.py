"""The proxy's listening socket: its own accept loop, so that a flood of connections can never
take the descriptors the gate needs.

- Raises the soft RLIMIT_NOFILE to the hard one at start (a waiting request costs about
  FDS_PER_CONNECTION descriptors: its socket, the lock root, the lock file, the queue and its
  entry; the engine's connection once it holds the lane).
- At most `cap` connections at once: --max-connections, lowered to what the descriptor limit
  allows. Beyond it a new connection is not accepted: it waits in the kernel's listen backlog,
  its request unread, until a connection closes. A request that asked to wait is still waiting,
  as it would be in the lane's queue; a 503 would need a descriptor to say it, which is the
  thing that ran out, and would refuse a client that asked to wait.
- Idle connections make room: at the cap, the oldest connection with no request in progress (one
  that has sent no complete header yet, or a keep-alive one between requests) for at least
  EVICT_AFTER seconds is closed for the new one -- so connections that send nothing cannot shut
  out a client that has a request, and a client just accepted has time to send its own.
- A connection that has not sent a complete request header within `header_timeout` seconds of
  being accepted is closed (idle keep-alive connections: aiohttp's keepalive_timeout); a request
  whose body is not complete within as long again after its header is answered 408 and closed
  (app.py). A connection waiting for its body counts toward the cap, and is idle while no byte of
  it comes: at the cap it is closed for a new connection like one that has sent nothing -- so
  connections that hold their bodies back cannot shut out the proxy's own /lanelock/ answers.
- accept() failing for want of descriptors or memory (EMFILE, ENFILE, ENOBUFS, ENOMEM) is
  crowded, not broken: said once per incident, and accepting resumes when a connection closes.
"""

from __future__ import annotations

import asyncio
import errno
import resource
import socket

MAX_CONNECTIONS = 1024     # --max-connections
HEADER_TIMEOUT = 10.0      # --header-timeout: seconds from connecting to a complete header
IDLE_TIMEOUT = 15.0        # --idle-timeout: seconds an idle keep-alive connection is kept
FDS_PER_CONNECTION = 6
RESERVED_FDS = 32      # the event loop, stdio, the witness, the thread pool's files, fallbacks
EVICT_AFTER = 0.25     # seconds a connection must have been idle to be closed for a new one
BACKLOG = 4096         # the kernel caps it at net.core.somaxconn
# accept() errors of a connection that went away before it was accepted: try the next one.
GONE = frozenset({errno.ECONNABORTED, errno.EPROTO, errno.EPERM, errno.EINTR})


def raise_fd_limit() -> int:
    """Soft RLIMIT_NOFILE up to the hard limit; the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):   # an infinite hard limit the kernel refuses as soft
            pass
    return soft


def connection_cap(wanted: int, soft: int) -> int:
    """wanted, lowered to what soft descriptors allow (at least 1)."""
    return max(1, min(wanted, (soft - RESERVED_FDS) // FDS_PER_CONNECTION))


class Connection(asyncio.Protocol):
    """One accepted connection: aiohttp's handler inside, our bookkeeping around it."""

    __slots__ = ("listener", "inner", "transport", "busy", "since", "header_timer", "served",
                 "reading")

    def __init__(self, listener: "Listener", inner):
        self.listener, self.inner = listener, inner
        self.transport = None
        self.busy = 0            # requests in progress (the proxy's handler is running)
        self.served = 0          # requests started on it
        self.since = 0.0         # when it was last active (accepted, bytes came, a request ended)
        self.header_timer = None
        self.reading = False     # its request's handler waits for the body (nothing taken yet)

    def connection_made(self, transport) -> None:
        loop = asyncio.get_running_loop()
        self.transport, self.since = transport, loop.time()
        self.listener.connections[self.inner] = self
        if self.listener.header_timeout:
            self.header_timer = loop.call_later(self.listener.header_timeout, self._header_late)
        self.inner.connection_made(transport)

    def _header_late(self) -> None:
        self.header_timer = None
        if not self.served and self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None
        self.transport = None
        self.listener.forget(self)
        self.inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        # Bytes of a request on their way: not idle (a header parsed just now has not reached
        # the proxy's handler yet). A trickle is still bounded by the header and idle timeouts.
        self.since = asyncio.get_running_loop().time()
        self.inner.data_received(data)

    def eof_received(self):
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class Listener:
    def __init__(self, factory, host: str, port: int, *, cap: int, header_timeout: float,
                 incidents):
        self.factory, self.host, self.port = factory, host, port
        self.cap, self.header_timeout = cap, header_timeout
        self.incidents = incidents   # logs.Incidents: one line per incident
        self.connections: dict = {}  # aiohttp's handler -> Connection
        self.sock: socket.socket | None = None
        self._task: asyncio.Task | None = None
        self._room: asyncio.Event | None = None
        self._closing = False

    @property
    def address(self) -> tuple:
        return self.sock.getsockname()[:2]

    async def start(self) -> None:
        """Bind and listen (OSError: the caller says why), then accept in a task."""
        family = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM,
                                    flags=socket.AI_PASSIVE)[0][0]
        self.sock = socket.create_server((self.host, self.port), family=family, backlog=BACKLOG)
        self.sock.setblocking(False)
        self._room = asyncio.Event()
        self._task = asyncio.ensure_future(self._accept())

    async def stop(self) -> None:
        """Stop accepting (connections already made go on until the runner closes them)."""
        self._closing = True
        if self._task is not None:
            # Cancelled until it ends: Python 3.11's wait_for can swallow a cancellation that
            # lands as its inner wait finishes (then the loop went on to accept again).
            while not self._task.done():
                self._task.cancel()
                await asyncio.wait([self._task], timeout=0.1)
            self._task = None
        if self.sock is not None:
            self.sock.close()

    # -- what the proxy's handler tells ---------------------------------------------------------
    def started(self, handler) -> None:
        connection = self.connections.get(handler)
        if connection is not None:
            connection.busy += 1
            connection.served += 1

    def ended(self, handler) -> None:
        connection = self.connections.get(handler)
        if connection is not None:
            connection.busy -= 1
            if not connection.busy:
                connection.since = asyncio.get_running_loop().time()
                self._room.set()   # an idle connection can make room now

    def reading(self, handler, waiting: bool) -> None:
        """A request's handler waits for its body (True), or has it (False)."""
        connection = self.connections.get(handler)
        if connection is not None:
            connection.reading = waiting
            if waiting:
                self._room.set()   # it may be idle soon: the accept loop looks again

    def forget(self, connection: Connection) -> None:
        if self.connections.get(connection.inner) is connection:
            del self.connections[connection.inner]
        if self._room is not None:
            self._room.set()

    # -- accepting ----------------------------------------------------------------------------
    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._closing:
            await self._make_room()
            try:
                conn, _ = await loop.sock_accept(self.sock)
            except OSError as error:
                if error.errno in GONE:
                    continue
                self.incidents(f"accept-{error.errno}", "proxy: cannot accept connections "
                               f"({_words(error)}): new ones wait in the listen backlog")
                if not self._evict_idle():
                    await self._wait_room(EVICT_AFTER)
                continue
            try:
                conn.setblocking(False)
                await loop.connect_accepted_socket(lambda: Connection(self, self.factory()),
                                                   conn)
            except OSError as error:
                conn.close()
                self.incidents(f"accept-{error.errno}", f"proxy: a connection was dropped "
                               f"({_words(error)})")

    async def _make_room(self) -> None:
        """Return once a connection may be accepted: under the cap, or at it with an idle one
        closed for the new one; else wait for a request to end or a connection to close."""
        while len(self.connections) >= self.cap:
            if self._evict_idle():
                return   # it is forgotten once its close is done; accepting now is in bound
            await self._wait_room(self._next_evictable())

    def _idle(self) -> list:
        return [connection for connection in self.connections.values()
                if (not connection.busy or connection.reading and connection.busy == 1)
                and connection.transport is not None
                and not connection.transport.is_closing()]

    def _evict_idle(self) -> bool:
        """Close the oldest connection idle for EVICT_AFTER or more; False when there is none."""
        idle = self._idle()
        if not idle:
            return False
        oldest = min(idle, key=lambda connection: connection.since)
        if asyncio.get_running_loop().time() - oldest.since < EVICT_AFTER:
            return False
        oldest.close()
        return True

    def _next_evictable(self) -> float | None:
        """Seconds until an idle connection may be closed for a new one (None: none is idle)."""
        idle = self._idle()
        if not idle:
            return None
        since = min(connection.since for connection in idle)
        return max(0.01, since + EVICT_AFTER - asyncio.get_running_loop().time())

    async def _wait_room(self, timeout: float | None) -> None:
        self._room.clear()
        try:
            await asyncio.wait_for(self._room.wait(), timeout)
        except asyncio.TimeoutError:
            pass


def _words(error: OSError) -> str:
    import os

    return os.strerror(error.errno).lower() if error.errno else str(error)
