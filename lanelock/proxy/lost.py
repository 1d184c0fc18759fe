"""A held request whose lane the store takes away: the proxy's side of the lane watch
(lanewatch.py).

A restart is an outage: the lane is taken back and the request goes on (one line). A lane lost for
good (the server ended the session itself, or the link to it timed out: another host may hold the
lane now) cuts the request, which is safe to stop: the engine's connection is closed, so the engine
stops generating for it; a streamed answer stops where it was, without its last chunk (the client
sees it cut, never a short answer that looks whole); an answer not yet started gets the dialect's
error (503, lane_lost). One line says it, once per request.
"""

from __future__ import annotations

import asyncio

from ..lanewatch import ENDED, Words
from .proxied import CUT

REASON_LOST = "lane_lost"
CUT_WORDS = CUT["lost"]


class LaneLost(OSError):
    """The relay was cut: the request's lane is lost for good. An OSError, so the relay's
    stream ends as for a failed side (relay.py), with these words."""


class ProxyWords(Words):
    """One line per incident, in the proxy's words; nothing while the store does not answer
    (the request ends, or the lane comes back, or is lost: then one line)."""

    SAY_AGAIN = None

    def __init__(self, method: str, path: str):
        super().__init__()
        self.what = f"{method} {path[:200]}"

    def lost(self, lane: str, why: str = ENDED) -> str | None:
        return (f"proxy: lane {lane} lost mid-request ({self.what}): {why}; the request is cut "
                "(the engine's connection closed)")

    def pending(self, lane: str, seconds: float) -> str | None:
        return None

    def regained(self, lane: str, seconds: float) -> str | None:
        return (f"proxy: lane {lane} taken back after {seconds:.1f} s ungated: the lane store "
                f"restarted under a request ({self.what})")

    def unfinished(self, lane: str, seconds: float) -> str | None:
        return (f"proxy: lane {lane} lost for the last {seconds:.1f} s of a request "
                f"({self.what}): the lane store did not answer again before it ended")


class Cut:
    """The cut of one held request's relay, fired from the watch's thread (threadsafe) and
    carried out on the loop: before the answer's headers the upstream request is cancelled
    (aiohttp closes its connection); after them the answer's stream raises LaneLost at its next
    read, and the connection is closed."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.fired = False
        self.entering: asyncio.Future | None = None   # the request, until its headers are in
        self.upstream = None                           # the engine's answer, once they are

    def threadsafe(self) -> None:
        try:
            self.loop.call_soon_threadsafe(self.fire)
        except RuntimeError:   # the loop is closed: nothing left to cut
            pass

    def fire(self) -> None:
        if self.fired:
            return
        self.fired = True
        if self.entering is not None and not self.entering.done():
            self.entering.cancel()
        if self.upstream is not None:
            self.upstream.content.set_exception(LaneLost(CUT_WORDS))
            self.upstream.close()

    def entered(self, entering: asyncio.Future) -> asyncio.Future:
        self.entering = entering
        if self.fired:
            entering.cancel()
        return entering

    def cut_while_entering(self) -> bool:
        """A CancelledError while the headers were awaited: this cut's (True), or the
        handler's own (the client went away)?"""
        task = asyncio.current_task()
        return self.fired and not (task is not None and task.cancelling())


async def unwatch(watch) -> None:
    """Stop a request's watch off the loop (its thread may be in a round trip to the server),
    and wait for it even if the task is cancelled meanwhile: the turn's release must not run
    beside it. Idempotent; None: nothing to stop."""
    if watch is None or watch.thread is None:
        return
    stopping = asyncio.ensure_future(asyncio.to_thread(watch.stop))
    cancelled = False
    while not stopping.done():
        try:
            await asyncio.shield(stopping)
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
