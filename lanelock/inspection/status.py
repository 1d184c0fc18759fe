"""`lanelock status`: the truth about a lane, even when the holder record lies.

The store gathers the facts (store.survey: the lock's own view of holders and waiters, and the
holder record); judge.py turns them into one verdict per lane, the same way for every store.
"""

from __future__ import annotations

from .judge import judge


def statuses(store, lane=None) -> list[dict]:
    """The status of the lane, or of every lane the store knows when lane is None."""
    return [judge(facts) for facts in store.survey(lane)]
