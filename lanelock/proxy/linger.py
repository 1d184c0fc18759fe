"""--linger: a held lane kept for the same session between its requests, so an agent's tool-call
loop keeps the engine's cache of its conversation.

At most one turn lingers per session, on the seat it holds: the session's next request takes it
back instead of asking the lane (take), so it stays on its seat (the engine's slot, with
--pin-slots); a request of another session asks the lane as usual and finds that seat held. On a
lane of N seats up to N sessions' turns linger at once, each on its own. A second turn of a
session that lingers already (its requests overlapped, each on a seat) is released: the session
keeps the seat it had. Released when the seconds run out unused, when the engine did not answer
(nothing runs on it: forget), and on shutdown (close). A nested turn, or one whose lane was
lost, never lingers.
"""

from __future__ import annotations

import asyncio

from .. import asyncturn
from ..gate import HELD


class Lingering:
    """A held turn kept for one session between its requests."""

    __slots__ = ("turn", "session", "timer", "in_use")

    def __init__(self, turn, session: str):
        self.turn, self.session = turn, session
        self.timer = None
        self.in_use = True


class Linger:
    def __init__(self, seconds: float):
        self.seconds = seconds          # 0: no turn lingers
        self.lingering: dict[str, Lingering] = {}   # by session

    @property
    def held(self) -> Lingering | None:
        """A turn lingering (or in use again), any one; None when none is."""
        return next(iter(self.lingering.values()), None)

    def take(self, session: str) -> Lingering | None:
        """The turn lingering for session, now in use again; None when there is none."""
        held = self.lingering.get(session)
        if held is not None and not held.in_use and held.turn.state != HELD:
            self.forget(held)   # its lane is gone: the session takes a new turn, and keeps it
            return None
        if held is None or held.in_use:
            return None
        if held.timer is not None:
            held.timer.cancel()
            held.timer = None
        held.in_use = True
        return held

    def keep(self, turn, session: str, reused: Lingering | None) -> bool:
        """Keep turn (a held one whose request ended) for session's next request: True when
        it lingers, False when the caller releases it."""
        if self.seconds <= 0 or turn.nested or turn.lost:
            self.forget(reused)
            return False
        if reused is None and session in self.lingering:
            return False   # the session's own lingers already, on its seat
        held = reused or Lingering(turn, session)
        held.in_use = False
        self.lingering[session] = held
        held.timer = asyncio.get_running_loop().call_later(
            self.seconds, lambda: asyncio.ensure_future(self._expire(held)))
        return True

    def forget(self, reused: Lingering | None) -> None:
        """The reused turn is released by its request (the engine did not answer, the lane was
        lost): it no longer lingers."""
        if reused is not None and self.lingering.get(reused.session) is reused:
            del self.lingering[reused.session]

    async def _expire(self, held: Lingering) -> None:
        if held.in_use or self.lingering.get(held.session) is not held:
            return
        del self.lingering[held.session]
        await asyncturn.release(held.turn, 0)

    async def close(self) -> None:
        while self.lingering:
            _, held = self.lingering.popitem()
            if held.timer is not None:
                held.timer.cancel()
            await asyncturn.release(held.turn, 0)
