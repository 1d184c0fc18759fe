"""The model map: which models of one backend share a lane, with lanes keyed by model.

A lane stands for what cannot run twice at once: with lanes keyed by model that is a GPU, not a
model name. Models that swap on one GPU (llama-swap loading one at a time) must share a lane;
models on two GPUs must not. The map says so: {MODEL: LANE} for the models that share, every
model it does not name on a lane of its own (the lane lane_for gives it, HOST:PORT#MODEL); a
shared lane is named the same way, HOST:PORT#LANE.

It is one value every process reads -- kept with the lanes (store.kept, "models/" + the
backend's lane name), never a per-user setting: a cron turn under `env -i`, every HOME and the
proxy must find the same lane for the same model, or there would be two gates on one GPU. A map
that cannot be read (not to be believed, not a map) leaves each model on its own lane, said once:
a setting never stops a turn.
"""

from __future__ import annotations

PREFIX = "models/"
MAX_NAME = 200   # a model or lane name in the map, as the proxy cuts a request's model


def key(backend_lane) -> str:
    """The kept value's name: "models/" + the backend's lane (its name without a model)."""
    return PREFIX + backend_lane.name


def valid(value) -> dict:
    """The map from a kept value; ValueError when it is not one ({MODEL: LANE}, names of text)."""
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(
            isinstance(name, str) and isinstance(lane, str) and name and lane
            for name, lane in value.items()):
        raise ValueError("the model map is not a table of model names to lane names")
    return value


def read(store, backend_lane) -> dict:
    """The map kept for a backend ({} when none). GateUnavailable when it cannot be read,
    ValueError when what is kept is not a map."""
    return valid(store.kept(key(backend_lane)))


def lane_model(mapping: dict, model: str) -> str:
    """The name that keys a model's lane: its shared lane's, else its own."""
    return mapping.get(model, model)


def check_name(what: str, name: str) -> str:
    """A model or lane name as a command takes it: ValueError for an empty or unprintable one."""
    name = name.strip()
    if not name or len(name) > MAX_NAME or not name.isprintable():
        raise ValueError(f"{what} {name!r}: expected a name of 1 to {MAX_NAME} printable "
                         "characters")
    return name


def shared(mapping: dict, lane: str, models) -> dict:
    """The map with models on one lane (moved there from any other). A lane named after a model
    the map puts elsewhere is refused: that model's turns would land on two lanes' names."""
    lane = check_name("lane", lane)
    models = [check_name("model", model) for model in models]
    if lane in mapping and mapping[lane] != lane and lane not in models:
        raise ValueError(f"{lane!r} is a model on lane {mapping[lane]!r}: name the shared lane "
                         "otherwise, or unshare that model first")
    result = dict(mapping)
    result.update({model: lane for model in models})
    return result


def aliased(mapping: dict, alias: str, model: str) -> dict:
    """The map with alias on model's lane (its shared lane, else its own): an engine's other name
    for one model (llama-swap's aliases) is one lane, not two."""
    model = check_name("model", model)
    lane = lane_model(mapping, model)
    return shared(mapping, lane, [alias] + ([model] if model not in mapping else []))


def unshared(mapping: dict, models) -> dict:
    """The map without models (each back on a lane of its own); ValueError for one it lacks."""
    models = [check_name("model", model) for model in models]
    missing = [model for model in models if model not in mapping]
    if missing:
        raise ValueError(f"not in the map: {', '.join(missing)} (each model is on a lane of "
                         "its own already)")
    return {model: lane for model, lane in mapping.items() if model not in models}


def lanes_of(mapping: dict) -> dict:
    """{LANE: [MODEL, ...]}, sorted: the map as people read it."""
    found: dict = {}
    for model, lane in sorted(mapping.items()):
        found.setdefault(lane, []).append(model)
    return dict(sorted(found.items()))
