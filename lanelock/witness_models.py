"""The witness of an engine of many models (llama-swap) when lanes are keyed by model: each running
model's generations are held against ITS lane -- the lane its turns take (the model map's shared
lane, else its own, as place.py computes it) -- never the backend's, which no model's turn holds.

One witness claims the engine (the backend's lane, as ever: two would count each generation
twice) and reads it once a look: /running, then each ready model's /slots (engine.py; never a
model that is not running: asking one would load it). Each model's account goes to the witness of
its lane, a plain Witness (witness.py) fed that account instead of reading the engine itself, so
its verdicts, lines, journal and counts are the lane's own: "unseen generation on
localhost:8080#gpu0". A lane none of whose models generates gets an empty account, so what it saw
ends. An engine of one model (llama.cpp, vLLM, SGLang) is witnessed against the place's lane, as
without models.
"""

from __future__ import annotations

import time

from . import engine as engines
from .errors import GateUnavailable, UsageProblem
from .witness import Witness

LANE_FRESH = 5.0   # seconds a model's lane is used before the model map is read for it again


def witness_for(place, url: str, **options) -> Witness:
    """The witness for a place: by model when its lanes are keyed by model and it names none
    (the proxy of every model, `watch --key-by model`), else the place's own lane's."""
    if getattr(place, "key_by", "backend") == "model" and not place.lane.model:
        return ModelWitness(place, url, **options)
    return Witness(place, url, **options)


class Given:
    """What a lane's witness reads of the engine: the account of its models in this look."""

    def __init__(self, engine):
        self._engine = engine
        self.account = engines.Account(0)
        self.known = None

    @property
    def kind(self):
        return self._engine.kind

    @property
    def source(self):
        return self._engine.source

    def detect(self):
        return self._engine.kind

    def sample(self):
        return self.account


def merged(accounts: list) -> "engines.Account":
    """One lane's account: the sum of its models'."""
    total = engines.Account(0, 0)
    for account in accounts:
        total.generating += account.generating
        total.slots += account.slots or 0
        total.tasks.update(account.tasks)
        total.named.update(account.named)
    return total


class ModelWitness(Witness):
    def __init__(self, place, url: str, **options):
        super().__init__(place, url, **options)
        self._options = options
        self.lanes: dict = {}        # lane name -> its Witness
        self._lane_of: dict = {}     # model -> (lane name, when it was read)

    def sample_once(self) -> None:
        if self.engine.kind != engines.LLAMA_SWAP:
            return super().sample_once()
        try:
            account = self.engine.sample()
        except engines.Unreadable as error:
            self._failing(str(error))
            return
        self._recovered()
        self.samples += 1
        if not self._remembered:   # which engine this backend's witness watches, for `status`
            self._remembered = True
            self._count()
        found: dict = {}
        for model, own in account.by_model.items():
            lane = self._lane(model)
            if lane is not None:
                found.setdefault(lane, []).append(own)
        for name, witness in list(self.lanes.items()):
            witness.engine.account = merged(found.get(name, []))
            witness.sample_once()

    def _lane(self, model: str) -> str | None:
        """The name of model's lane, its witness made when first seen; None when no lane can
        be had for it (its generations are then nobody's to judge here)."""
        now = time.monotonic()
        known = self._lane_of.get(model)
        if known is not None and now - known[1] < LANE_FRESH:
            return known[0]
        from .lanes import BackendError
        from .place import Place

        place = self.place
        flags = place.settings.flags
        try:
            lane_place = Place(settings=place.settings.derive(
                backend=place.lane.given, model=model, key_by="model",
                lock_dir=flags.get("lock_dir"), store=flags.get("store")),
                warn=place.warn, lane_store=place._own_store, no_model_said=True)
        except (BackendError, UsageProblem, GateUnavailable, OSError):
            return None
        name = lane_place.lane.name
        self._lane_of[model] = (name, now)
        if name not in self.lanes:
            witness = Witness(lane_place, self.url, **self._options)
            witness.engine = Given(self.engine)
            self.lanes[name] = witness
        return name

    def finish(self) -> None:
        for witness in self.lanes.values():
            witness.finish()
        super().finish()
