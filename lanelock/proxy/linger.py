"""--linger: a held lane kept for the same session between its requests, so an agent's tool-call
loop keeps the engine's cache of its conversation.

At most one turn lingers (one lane, one proxy process): the session's next request takes it back
instead of asking the lane (take), a request of another session asks the lane as usual and finds
it held. Released when the seconds run out unused, when the engine did not answer (nothing runs on
it: forget), and on shutdown (close). A nested turn, or one whose lane was lost, never lingers.
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
        self.held: Lingering | None = None

    def take(self, session: str) -> Lingering | None:
        """The turn lingering for session, now in use again; None when there is none."""
        held = self.held
        if held is None or held.in_use or held.session != session or held.turn.state != HELD:
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
            return False
        held = reused or Lingering(turn, session)
        held.in_use = False
        self.held = held
        held.timer = asyncio.get_running_loop().call_later(
            self.seconds, lambda: asyncio.ensure_future(self._expire(held)))
        return True

    def forget(self, reused: Lingering | None) -> None:
        """The reused turn is released by its request (the engine did not answer): it no
        longer lingers."""
        if reused is not None and self.held is reused:
            self.held = None

    async def _expire(self, held: Lingering) -> None:
        if held.in_use or self.held is not held:
            return
        self.held = None
        await asyncturn.release(held.turn, 0)

    async def close(self) -> None:
        if self.held is not None:
            held, self.held = self.held, None
            if held.timer is not None:
                held.timer.cancel()
            await asyncturn.release(held.turn, 0)
