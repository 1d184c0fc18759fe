"""The requests in flight and the -v line: middleware around every handler the proxy routes to.

The middleware makes each request's proxied.Proxied (request[PROXIED]), counts it in flight until
its handler returns, and, with --verbose, says one line for it -- also when its client hung up and
the handler was cancelled -- but for the proxy's own answers (status, health, metrics, the page:
own.py), whose polls would drown the requests. Requests the guard refuses (serve.py: malformed, too large, no token)
never reach it: they are neither counted nor logged.
"""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from .proxied import Proxied

# A typed key from aiohttp 3.14 on (a str key warns there); older releases know only str keys.
PROXIED = web.RequestKey("lanelock_proxied", Proxied) if hasattr(web, "RequestKey") \
    else "lanelock_proxied"


class InFlight:
    """How many routed requests are in flight: the status endpoint says it, and a shutdown
    waits until it is 0 (idle())."""

    __slots__ = ("count", "_idle")

    def __init__(self):
        self.count = 0
        self._idle: asyncio.Event | None = None

    def idle(self) -> asyncio.Event:
        """Set while no request is in flight (made on first use, inside the event loop)."""
        if self._idle is None:
            self._idle = asyncio.Event()
            if not self.count:
                self._idle.set()
        return self._idle

    def entered(self) -> None:
        self.count += 1
        if self._idle is not None:
            self._idle.clear()

    def left(self) -> None:
        self.count -= 1
        if not self.count and self._idle is not None:
            self._idle.set()


def middleware(in_flight: InFlight, say, verbose):
    """The in-flight count and the access log (-v), as one aiohttp middleware. verbose(): whether
    to log, asked per request (a reload may change it); the proxy's own answers never are."""

    @web.middleware
    async def in_flight_and_access_log(request, handler):
        proxied = request[PROXIED] = Proxied(request)
        in_flight.entered()
        started = time.monotonic()
        response = None
        try:
            response = await handler(request)
            return response
        finally:
            in_flight.left()
            if verbose() and not proxied.own:
                say.note(proxied.log_line(response, started))

    return in_flight_and_access_log
