"""`lanelock seats`: a lane's seat count -- how many turns may hold it at once -- read or set.

The count is the lane's, kept with it by its store (store.keep: the flock store's
ROOT/kept.json, the PostgreSQL store's table), never a flag of one turn or a setting of one
user: a cron turn under `env -i`, every HOME and every host read the same value, or there would
be two gates. A smaller count evicts nobody: new turns wait until fewer hold.
"""

from __future__ import annotations

from .errors import GateUnavailable, UsageProblem
from .store.seating import MOST, key, reckon


def parse(text: str) -> int | str:
    """A count from the command line: 1..MOST, or 'auto' (the engine's own slot count).
    UsageProblem for anything else."""
    spelled = text.strip().lower()
    if spelled == "auto":
        return "auto"
    # Digits only, and few of them: int() of a hundred thousand digits is an error of its own.
    if spelled.isascii() and spelled.isdigit() and len(spelled) <= 4 \
            and 1 <= int(spelled) <= MOST:
        return int(spelled)
    shown = text if len(text) <= 40 else f"{text[:40]}... ({len(text)} characters)"
    raise UsageProblem(f"seats must be a whole number from 1 to {MOST} or 'auto', not {shown!r}")


def read(place) -> int:
    """The lane's count as every turn reads it (GateUnavailable when the store cannot say)."""
    count, problem = reckon(place.store.kept(key(place.lane.name)), place.lane.name)
    if problem:   # as every turn takes it (store/seating.py), said here with the mend
        raise GateUnavailable(f"the kept seat count: {problem}; set it again")
    return count


def set_count(place, count: int) -> dict:
    """Keep the lane's count: {lane, seats, was}. GateUnavailable when it cannot be kept."""
    try:
        was = read(place)
    except GateUnavailable:
        was = None
    place.store.make_seats(place.lane, count)   # the seats first: no count without its seats
    place.store.keep(key(place.lane.name), None if count == 1 else count)
    place.store.forget_seats(place.lane, count)   # after the count: see store.forget_seats
    return {"lane": place.lane.name, "seats": count, "was": was}


def words(result: dict) -> str:
    count, was = result["seats"], result.get("was")
    said = f"{result['lane']}: {count} seat{'s' if count != 1 else ''}"
    if was is not None and was != count:
        said += f" (was {was})"
        if count < was:
            said += "; turns holding now keep their seats, new turns wait until fewer hold"
    return said
