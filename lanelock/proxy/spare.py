"""One connection to the engine opened ahead of the request that will use it.

A request the proxy forwards goes on a new connection (serve.py: a reused keep-alive connection
meets the client's delayed ACK and the engine's Nagle, ~40 ms on the first streamed event). Opening
it is a connect() and a turn of the event loop after the lane is taken -- about 0.2 ms of the
first byte's wait on loopback. So once an engine connection closes (its answer relayed), the next
one is opened at once, unused: a fresh connection, never a reused one, only opened early. The next
request to the engine takes it instead of connecting.

Kept briefly (SPARE_SECONDS: below the shortest idle timeout of the engines in front of which the
proxy runs -- cpp-httplib's 5 s in llama-server, uvicorn's 5 s in vLLM), and checked before use:
a spare the engine closed (or wrote to) is dropped and the request connects as before, so a
stopped or restarted engine is found as it would be without one. At most one spare, for the engine
only (never a fallback's host), and none made while the proxy stops.
"""

from __future__ import annotations

import asyncio
import socket

from aiohttp import TCPConnector

SPARE_SECONDS = 2.0


class SpareConnector(TCPConnector):
    """aiohttp's TCP connector, with the spare connection to (host, port) (the engine's)."""

    def __init__(self, engine: tuple[str, int] | None, **kwargs):
        super().__init__(**kwargs)
        self._engine = engine        # (host as in the URL, port)
        self._address = None         # (family, sockaddr) the engine was last reached at
        self._spare = None           # (socket, transport, protocol), connected, unused
        self._expiry = None          # the timer that drops an unused spare
        self._opening = None         # the task opening one
        self._stopped = False

    async def _wrap_create_connection(self, *args, req, **kwargs):
        ours = self._engine is not None and (req.url.raw_host, req.port) == self._engine \
            and not req.is_ssl()
        taken = self._take() if ours else None
        if taken is not None:
            self._refill_after(taken[1])
            return taken
        transport, protocol = await super()._wrap_create_connection(*args, req=req, **kwargs)
        if ours:
            peer = transport.get_extra_info("socket")
            if peer is not None:
                self._address = (peer.family, transport.get_extra_info("peername"))
            self._refill_after(protocol)
        return transport, protocol

    def _take(self) -> tuple | None:
        """The spare's (transport, protocol), if it is still open and the engine has said
        nothing on it (its transport reads nothing until it is taken)."""
        spare, self._spare = self._spare, None
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        if spare is None:
            return None
        sock, transport, protocol = spare
        try:
            # b"": closed by the engine; bytes: it spoke first -- not a fresh connection
            sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:   # open, nothing to read: as fresh as a new one
            if protocol.is_connected():
                transport.resume_reading()
                return transport, protocol
        except OSError:   # reset
            pass
        transport.close()
        return None

    def _refill_after(self, protocol) -> None:
        """Open the next spare once this engine connection has closed (its answer relayed)."""
        closed = getattr(protocol, "closed", None)
        if isinstance(closed, asyncio.Future):
            closed.add_done_callback(lambda _: self._refill())

    def _refill(self) -> None:
        if self._stopped or self._address is None or self._spare is not None or \
                self._opening is not None:
            return
        self._opening = asyncio.ensure_future(self._open())

    async def _open(self) -> None:
        family, address = self._address
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            await self._loop.sock_connect(sock, address)
            transport, protocol = await self._loop.create_connection(self._factory, sock=sock)
        except (OSError, asyncio.CancelledError):
            sock.close()
            return
        finally:
            self._opening = None
        if self._stopped or self._spare is not None:
            transport.close()
            return
        transport.pause_reading()   # whatever the engine says before a request stays unread
        self._spare = (sock, transport, protocol)
        self._expiry = self._loop.call_later(SPARE_SECONDS, self._drop)

    def _drop(self) -> None:
        self._expiry = None
        spare, self._spare = self._spare, None
        if spare is not None:
            spare[1].close()

    def close(self, *args, **kwargs):
        self._stopped = True
        if self._opening is not None:
            self._opening.cancel()
        if self._expiry is not None:
            self._expiry.cancel()
        self._drop()
        return super().close(*args, **kwargs)
