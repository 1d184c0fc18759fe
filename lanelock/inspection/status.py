"""`lanelock status`: the truth about a lane, even when the holder record lies.

The store gathers the facts (store.survey: the lock's own view of holders and waiters, and the
holder record); judge.py turns them into one verdict per lane, the same way for every store. Each
lane also says whether a turn could take its gate (store/availability.py): a lane on a root no
turn can lock is not "free", its turns run ungated.
"""

from __future__ import annotations

from ..paths import UNGATED
from ..store.availability import gate_problem
from .judge import judge


def statuses(store, lane=None) -> list[dict]:
    """The status of the lane, or of every lane the store knows when lane is None."""
    return [status for status, _ in judged(store, lane)]


def judged(store, lane=None) -> list[tuple]:
    """[(status, the facts it was judged from)] (metrics reads the counts beside the facts)."""
    return [(judge(facts, _gate_problem(store, lane, facts)), facts)
            for facts in store.survey(lane)]


def _gate_problem(store, lane, facts) -> str | None:
    if lane is not None:   # the turn's own first step, asked without taking (a public lane
        return gate_problem(store, lane) if lane.gated else None   # has no gate to take)
    # Every lane of a listing exists (a lock file, a holder row): what could stop a turn there is
    # the lock itself, which the facts already say. A root that cannot be listed has no lanes; the
    # caller reports the store's problems() for those.
    problem = facts.problem_lock or facts.error
    return f"{problem}: {UNGATED}" if problem else None
