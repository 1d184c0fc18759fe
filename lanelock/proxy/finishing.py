"""A session's answers that are ending: its next request waits until their turns let go.

A held request's answer reaches the client before its turn is over: the relay writes the last
bytes, then the turn is released (or kept for --linger) in a thread. An agent that sends its next
request the moment the terminal event arrives would find its own seat still held -- and take
another seat (another engine slot: its cache is in the first), or, lingering, a second turn. So
the relay says, just before it writes the bytes that end the answer, that the turn is ending
(relay.py's `ending`); a request of the same session on the same lane that comes meanwhile waits
for that turn's end -- a release is a few system calls, bounded by WAIT all the same -- and then
takes its turn as usual: its seat free again, or its lingering turn back.

Requests of the session in flight whose answers are not ending are not waited for: an agent's
requests at once each take a seat of their own.
"""

from __future__ import annotations

import asyncio

WAIT = 1.0   # seconds a request waits at most for its session's ending turns


class Finishing:
    def __init__(self):
        self._ending: dict[tuple, list] = {}   # (lane name, session) -> events, one per turn

    def begin(self, key: tuple) -> asyncio.Event:
        """A turn of key's session is ending: its event, set by done()."""
        event = asyncio.Event()
        self._ending.setdefault(key, []).append(event)
        return event

    def done(self, key: tuple, event: asyncio.Event) -> None:
        """The turn ended (released, or kept for its session): its waiters go on."""
        event.set()
        events = self._ending.get(key)
        if events is not None and event in events:
            events.remove(event)
            if not events:
                del self._ending[key]

    async def wait(self, key: tuple) -> None:
        """Until every turn of key's session that is ending now has ended (at most WAIT)."""
        events = list(self._ending.get(key, ()))
        if not events:
            return
        try:
            await asyncio.wait_for(asyncio.gather(*(event.wait() for event in events)), WAIT)
        except asyncio.TimeoutError:
            pass
