"""A forward-first turn's record: the proxy forwards a request on a free lane of one seat as
soon as the lane is taken (app.py), and writes the turn's holder record and journal -- named
first after the client's process when the request named no session -- once the request has
gone to the engine, while the engine works. Whatever ends the turn (its release, the engine not
answering) waits for them first: the record and journal say who held the lane before they say it
was let go.
"""

from __future__ import annotations

import asyncio

from .. import asyncturn
from .client_process import LATER


class Recording:
    """A forward-first turn's holder record and journal (and first its name, when the request
    named no session: its client's process), written on the loop once its request has gone to
    the engine (the relay's `sent`): while the engine works, not before the request leaves. At
    once when the turn must be recorded before that (wait(): the engine did not answer)."""

    __slots__ = ("turn", "proxied", "client", "task")

    def __init__(self, turn, proxied, client=None):
        self.turn, self.proxied, self.client = turn, proxied, client
        self.task = None

    def start(self) -> None:
        if self.task is None:
            self.task = asyncio.ensure_future(self._written())

    def done(self) -> bool:
        return self.task is not None and self.task.done()

    async def wait(self) -> None:
        """Until the turn is recorded (also when cancelled meanwhile; then CancelledError)."""
        self.start()
        await asyncturn.finished(self.task)

    async def _written(self) -> None:
        proxied, turn = self.proxied, self.turn
        if self.client is not None:   # named after its client's process, else its address
            session = await client_session(self.client) or proxied.remote
            proxied.session = session
            turn.session = turn.record.session = session[:200]
        turn.acquisition.record()


async def recorded(proxied) -> None:
    """A forward-first turn's naming and record, finished: before its turn is let go (the
    record and journal say who held it before they say it was released)."""
    if proxied.recording is not None:
        await proxied.recording.wait()


async def client_session(client) -> str | None:
    """The session of the client's process (client_process.py): on the event loop when it is
    a few system calls (the connection's name kept, or a recent client's process holding the
    socket: a thread's start and wake-up would cost more), else off it; None when no thread
    can be had (out of descriptors, even to import the pool: the gate then says crowded) --
    the request is named by its address."""
    session = client.session(scan=False)
    if session is not LATER:
        return session
    try:
        return await asyncio.to_thread(client.session)
    except (OSError, RuntimeError):
        return None
