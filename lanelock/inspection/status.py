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

# `status --all` looks at the engine of a lane it was not asked about only when that engine is on
# this machine (localhost or a loopback address: no name to resolve, no other host reached), and
# at most this many of them. Anyone may make a lane in the shared root (a lock file, a witness's
# URL in its counts), and 3,000 lanes named for hosts far away made it take minutes; the engine
# of any lane is looked at when that lane is asked for (-b).
ALL_ENGINE_LOOKS = 8
# `status --all` and `metrics --all` judge at most this many lanes: the ones whose records
# changed last (store.survey_all), and say in one line how many more there are. 3,000 lanes
# another user made took 25.6 s and 218 MB for metrics --all; a lane is asked for with -b.
ALL_LANES = 100


def left_out_note(store) -> list[str]:
    """The one line on the lanes the last listing left out, or none."""
    if not store.left_out:
        return []
    return [f"{store.left_out} more lane{'s' if store.left_out != 1 else ''} not listed: --all "
            f"lists the {ALL_LANES} whose records changed last (anyone may make a lane in a "
            "shared root); ask for one with -b"]


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
    from ..estimate import holders_medians, journal_typical, until_lane
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
    # A lane of seats: how long each other seat's holder has held, for the seat freed first.
    seated = [seat.get("holder") or {} for seat in status.get("by_seat") or ()
              if seat.get("state") == "held"]
    others = tuple(one.get("held_for") or 0.0 for one in seated)[1:]
    # Never less than each holder's own session's median hold (the proxy's Retry-After's rule).
    medians = holders_medians(store, lane, [holder, *seated[1:]]) \
        if lane is not None and held_for is not None else ()
    rows, going_first = [], 0
    for row in status["queue"]:
        row = dict(row)
        row["estimate"] = None
        if not row.get("stopped"):
            if typical is not None:
                row["estimate"] = until_lane(typical, held_for, going_first,
                                             status.get("seats") or 1, others, medians)
            going_first += 1
        rows.append(row)
    status["queue"] = rows


def judged(store, lane=None, engine: bool = False) -> list[tuple]:
    """[(status, the facts it was judged from)] (metrics reads the counts beside the facts)."""
    found = [(judge(facts, _gate_problem(store, lane, facts)), facts)
             for facts in (store.survey(lane) if lane is not None
                           else store.survey_all(ALL_LANES))]
    if engine:
        looks = [ALL_ENGINE_LOOKS if lane is None else None]   # None: no bound (one lane asked)
        for status, facts in found:
            add_engine(status, facts, store.counts(facts), lane, looks)
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


def add_engine(status: dict, facts, counts: dict, lane=None, looks: list | None = None) -> None:
    """status["engine"] (engine_status) for a gated lane; counts: the lane's, read once by the
    caller (metrics reads them for its counters too). looks: [how many more engines a listing
    may look at] (ALL_ENGINE_LOOKS), or None / [None] for no bound."""
    if lane is None or lane.gated:
        status["engine"] = engine_status(facts, counts, lane, looks)


def engine_status(facts, counts: dict, lane=None, looks: list | None = None) -> dict:
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
    listing = looks is not None and looks[0] is not None
    host = _name_host(facts.lane) if url is None and listing else None
    if host is not None and not _on_this_machine(f"http://{host}"):
        url, unasked = None, NOT_HERE   # not even named (a name's scope may read /etc/hosts)
    else:
        if url is None:   # the backend as the user spelled it, else as the store names the lane
            try:
                url = engine_url(lane if lane is not None and lane.name == facts.lane
                                 else lane_named(facts.lane))
            except (BackendError, ValueError):
                url = None
        unasked = _unasked(url, looks) if listing else None
    if unasked is not None:
        found = {"url": url, "kind": None, "generating": None, "slots": None,
                 "problem": f"not looked at: {unasked}", "answers": None}
    elif url is None:
        found = {"url": None, "kind": None, "generating": None, "slots": None,
                 "problem": "on another machine: its witness reports here", "answers": None}
    else:   # named by the endpoint its witness read, should it not answer
        found = engine.look(url, known=watched.get("source") if watched.get("url") == url
                            else None)
    witness = counts.get("witness") or {}
    found.update(unseen=witness.get("unseen"), unseen_seconds=witness.get("unseen_seconds"),
                 held_idle_seconds=witness.get("held_idle_seconds"),
                 last_unseen=counts.get("last_unseen"), witness=watched or None)
    return found


def _unasked(url: str | None, looks: list) -> str | None:
    """Why a listing does not look at this engine (None: it does, and one look is spent)."""
    if url is None:
        return None
    if not _on_this_machine(url):
        return NOT_HERE
    if looks[0] <= 0:
        return (f"status --all looks at {ALL_ENGINE_LOOKS} engines at most "
                "(ask for this lane with -b)")
    looks[0] -= 1
    return None


NOT_HERE = "status --all looks only at engines on this machine (ask for this lane with -b)"


def _name_host(name: str) -> str | None:
    """The host of a lane name (HOST:PORT[@MACHINE][#MODEL]), brackets kept for IPv6."""
    from ..facts import hostname

    base, _, machine = name.partition("#")[0].partition("@")
    if machine and machine != hostname():
        return None   # another machine's lane: its witness reports here
    return base.rpartition(":")[0]


def _on_this_machine(url: str) -> bool:
    """localhost, NAME.localhost or a loopback address, read from the URL alone (no lookup)."""
    import ipaddress
    from urllib.parse import urlsplit

    try:
        host = (urlsplit(url).hostname or "").rstrip(".")
    except ValueError:
        return False
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _gate_problem(store, lane, facts) -> str | None:
    if lane is not None:   # the turn's own first step, asked without taking (a public lane
        return gate_problem(store, lane) if lane.gated else None   # has no gate to take)
    # Every lane of a listing exists (a lock file, a holder row): what could stop a turn there is
    # the lock itself, which the facts already say. A root that cannot be listed has no lanes; the
    # caller reports the store's problems() for those. A file planted at a lock's name is not one:
    # turns deflect there (the verdict bad-lock-file says why), none runs ungated.
    problem = facts.error
    if facts.problem_lock and "symlink" in facts.problem_lock:   # judge.planted_outcome
        problem = facts.problem_lock
    return f"{problem}: {UNGATED}" if problem else None
