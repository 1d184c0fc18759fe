"""Can a turn take this lane's gate? The question `probe`, `status` and `metrics` answer before
they say "free": a root no turn can lock is not free, every turn there runs ungated.

The answer is the turn's own first step, without creating or locking anything: open the lane's
lock as a turn opens it (store.open: what exists must open -- a trusted root, no symlink, a
regular lock file; a PostgreSQL store must answer), and where nothing exists yet, the store's
problems() say whether a turn could create it. No second check to drift from the first.
"""

from __future__ import annotations

from ..errors import GateUnavailable
from ..paths import consequence


def gate_problem(store, lane) -> str | None:
    """Why a turn on the lane could not take the gate, and what it does then (fail open, or
    deflect on a crowded or untrusted gate), as a sentence; None when it could take it."""
    try:
        handle = store.open(lane, create=False)
    except GateUnavailable as error:
        return f"{error}: {consequence(error)}"
    try:
        if not handle.exists:   # nothing to lock yet: the first turn would create it -- can it?
            problems = store.problems()
            return problems[0] if problems else None
        return None
    finally:
        store.release(handle)
