"""`lanelock models`: the model map of a backend (models.py), shown and set; and what `status`
says of it.

    lanelock models -b B                          the map
    lanelock models -b B share LANE MODEL...      these models on one lane, LANE
    lanelock models -b B unshare MODEL...         these models back on lanes of their own
    lanelock models -b B alias ALIAS MODEL        ALIAS (the engine's other name for MODEL) on
                                                  MODEL's lane

The map is kept with the lanes (the store), so setting it is the root's or its owner's business
(store/flock/kept.py); a store that cannot keep it says so in one line (exit 69).
"""

from __future__ import annotations

import sys

from . import exitcodes, models, say
from .errors import GateUnavailable, UsageProblem

USAGE = "expected nothing, 'share LANE MODEL...', 'unshare MODEL...' or 'alias ALIAS MODEL'"


def backend_lane(place):
    """The place's lane without a model: the backend's, which names the map."""
    from .lanes import Lane

    lane = place.lane
    return Lane(lane.host, lane.port, lane.scope, None, lane.given, lane.machine)


def changed(mapping: dict, words: list) -> dict | None:
    """The map the words ask for (None: only show it); UsageProblem for words that ask
    nothing known."""
    if not words:
        return None
    action, rest = words[0], list(words[1:])
    try:
        if action == "share" and len(rest) >= 2:
            return models.shared(mapping, rest[0], rest[1:])
        if action == "unshare" and rest:
            return models.unshared(mapping, rest)
        if action == "alias" and len(rest) == 2:
            return models.aliased(mapping, rest[0], rest[1])
    except ValueError as error:
        raise UsageProblem(str(error)) from None
    raise UsageProblem(f"models {' '.join(words)[:200]!r}: {USAGE}")


def facts(place, mapping: dict) -> dict:
    backend = backend_lane(place)
    return {"backend_lane": backend.name, "key": models.key(backend), "map": mapping,
            "lanes": {f"{backend.name}#{lane}": names
                      for lane, names in models.lanes_of(mapping).items()},
            "key_by": place.key_by}


def lines(found: dict) -> list[str]:
    """The plain view: one line per shared lane, or that every model has its own."""
    if not found["map"]:
        return [f"{found['backend_lane']}: no models share a lane (each model has a lane of its "
                "own with lanes keyed by model)"]
    return [f"{lane}: {', '.join(names)}" for lane, names in found["lanes"].items()]


def command(place, words: list, as_json: bool) -> int:
    """Show the map, or set it and show what it is now. UsageProblem for bad words."""
    from .inspection.render import emit_json

    backend = backend_lane(place)
    if not place.gated:
        raise UsageProblem(f"{backend.name} is not a local lane: no turn ever holds it, so no "
                           "model shares it")
    try:
        mapping = models.read(place.store, backend)
    except ValueError as error:   # a value someone else wrote: replaced by the next change
        if not words:
            raise GateUnavailable(f"{models.key(backend)}: {error}") from None
        mapping = {}
    wanted = changed(mapping, words)
    if wanted is not None:
        place.store.keep(models.key(backend), wanted or None)
        mapping = wanted
    found = facts(place, mapping)
    if wanted is not None and found["key_by"] != "model":
        say.line("lanes are keyed by backend here (key_by): the map is used with lanes keyed "
                 "by model (--key-by model, LANELOCK_KEY_BY=model, key_by = \"model\")")
    if as_json:
        emit_json(found)
    else:
        sys.stdout.write("".join(say.sanitize(line, 4000) + "\n" for line in lines(found)))
    return exitcodes.OK


def for_status(store, results: list) -> dict:
    """{backend lane: {LANE: [MODEL...]}} of the backends of the lanes status shows whose map
    names any model; a map that cannot be read is left out (status says the lane's own facts)."""
    from .lanes import lane_named

    shown = {}
    for result in results:
        base = result["lane"].partition("#")[0]
        if base in shown:
            continue
        try:
            mapping = models.read(store, lane_named(base))
        except (GateUnavailable, ValueError, OSError):
            mapping = {}
        shown[base] = {f"{base}#{lane}": names
                       for lane, names in models.lanes_of(mapping).items()}
    return {base: lanes for base, lanes in shown.items() if lanes}


def add_to_status(store, results: list) -> dict:
    """Each lane status of a backend with a map gets "models" ({LANE: [MODEL...]}, the whole
    map of its backend); returns what was added, by backend, for the plain view's lines."""
    shown = for_status(store, results)
    for result in results:
        lanes = shown.get(result["lane"].partition("#")[0])
        if lanes:
            result["models"] = lanes
    return shown


def status_lines(shown: dict) -> str:
    """The plain view's lines after the lanes: which models share which lane."""
    return "".join(say.sanitize(f"models sharing {lane}: {', '.join(names)}", 4000) + "\n"
                   for lanes in shown.values() for lane, names in lanes.items())
