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


def statuses(store, lane=None, engine: bool = False) -> list[dict]:
    """The status of the lane, or of every lane the store knows when lane is None. engine: look
    at each lane's engine once too ("engine", see engine_status). Each waiter of a queue gets
    its estimate (add_estimates)."""
    found = [status for status, _ in judged(store, lane, engine)]
    for status in found:
        if status.get("queue"):
            add_estimates(status, store, lane)
    return found


def add_estimates(status: dict, store, lane=None) -> None:
    """Beside each waiter, "estimate": about how many seconds until the lane comes to it
    (estimate.py's rule, the proxy's Retry-After's: the rest of the holder's typical hold, then
    one per waiter going first; a stopped waiter is passed over, and has none: null), and on the
    lane "typical_hold" (null when the journal knows no hold of the last hour: then no waiter
    has an estimate)."""
    from ..estimate import journal_typical, until_lane
    from ..lanes import BackendError, lane_named

    if lane is None or lane.name != status["lane"]:
        try:
            lane = lane_named(status["lane"])
        except (BackendError, ValueError):
            lane = None
    typical = journal_typical(store, lane) if lane is not None else None
    status["typical_hold"] = None if typical is None else round(typical, 3)
    holder = status.get("holder") or {}
    held_for = (holder.get("held_for") or 0.0) if status["state"] == "held" else None
    rows, going_first = [], 0
    for row in status["queue"]:
        row = dict(row)
        row["estimate"] = None
        if not row.get("stopped"):
            if typical is not None:
                row["estimate"] = until_lane(typical, held_for, going_first)
            going_first += 1
        rows.append(row)
    status["queue"] = rows


def judged(store, lane=None, engine: bool = False) -> list[tuple]:
    """[(status, the facts it was judged from)] (metrics reads the counts beside the facts)."""
    found = [(judge(facts, _gate_problem(store, lane, facts)), facts)
             for facts in store.survey(lane)]
    if engine:
        for status, facts in found:
            add_engine(status, facts, store.counts(facts), lane)
    return found


def no_lanes(place) -> str:
    """What `status --all` says when the store knows no lane yet, and where it looked."""
    path = place.root.path if place.store.kind == "flock" else None
    if path is None:
        return f"no lanes yet in the {place.store.kind} store"
    import os

    if not os.path.isdir(path):
        return f"no lanes yet: the lock root {path} does not exist yet (the first turn makes it)"
    return f"no lanes yet under the lock root {path}"


def add_engine(status: dict, facts, counts: dict, lane=None) -> None:
    """status["engine"] (engine_status) for a gated lane; counts: the lane's, read once by the
    caller (metrics reads them for its counters too)."""
    if lane is None or lane.gated:
        status["engine"] = engine_status(facts, counts, lane)


def engine_status(facts, counts: dict, lane=None) -> dict:
    """The engine behind a lane, looked at once (engine.look: url, kind, generating, slots,
    problem), with what witnesses counted on the lane (counts: store.counts): unseen
    (generations no turn covered), unseen_seconds, held_idle_seconds, last_unseen, and the
    witness that last said which engine it watches ({url, kind, witness, pid}) -- its URL is
    the one looked at."""
    from .. import engine
    from ..lanes import BackendError, lane_named
    from ..witness import engine_url

    watched = counts.get("engine") or {}
    url = watched.get("url") if isinstance(watched.get("url"), str) else None
    if url is None:   # the backend as the user spelled it, else as the store names the lane
        try:
            url = engine_url(lane if lane is not None and lane.name == facts.lane
                             else lane_named(facts.lane))
        except (BackendError, ValueError):
            url = None
    if url is None:
        found = {"url": None, "kind": None, "generating": None, "slots": None,
                 "problem": "on another machine: its witness reports here"}
    else:
        found = engine.look(url)
    witness = counts.get("witness") or {}
    found.update(unseen=witness.get("unseen"), unseen_seconds=witness.get("unseen_seconds"),
                 held_idle_seconds=witness.get("held_idle_seconds"),
                 last_unseen=counts.get("last_unseen"), witness=watched or None)
    return found


def _gate_problem(store, lane, facts) -> str | None:
    if lane is not None:   # the turn's own first step, asked without taking (a public lane
        return gate_problem(store, lane) if lane.gated else None   # has no gate to take)
    # Every lane of a listing exists (a lock file, a holder row): what could stop a turn there is
    # the lock itself, which the facts already say. A root that cannot be listed has no lanes; the
    # caller reports the store's problems() for those.
    problem = facts.problem_lock or facts.error
    return f"{problem}: {UNGATED}" if problem else None
