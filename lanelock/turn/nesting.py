"""Same-process nesting: a thread (or asyncio task) taking a turn on a lane it already holds runs
through, as part of the turn it holds. flock conflicts between two open file descriptions even
inside one process, so the same owner must never lock again. Across processes a turn is joined
only by hand-over (handover.py).

Invariant: a lane ident is here exactly while a turn of this process holds it (from the held
decision recorded to the release), with the owner that may nest in it.
"""

from __future__ import annotations

import _thread

# store ident -> (the thread or task holding it, its turn)
_HELD_HERE: dict[tuple, tuple] = {}


def this_thread():
    """The owner of a turn taken by a thread (an asyncio turn is owned by its task instead)."""
    return _thread.get_ident()


def outer(ident: tuple, owner):
    """The turn owner already holds on the lane ident, else None."""
    held = _HELD_HERE.get(ident)
    return held[1] if held is not None and held[0] == owner else None


def hold(ident: tuple, owner, turn) -> None:
    _HELD_HERE[ident] = (owner, turn)


def let_go(ident: tuple | None) -> None:
    _HELD_HERE.pop(ident, None)
