"""The lanes one proxy serves: the backend's, and with lanes keyed by model (key_by = "model") one
per model its requests name -- or per shared lane, as the model map (models.py) groups them.

Everything the proxy keeps about a lane lives in its Lane here: the Gate (built once, a sibling of
the proxy's: the same settings, root and store), the turn lingering for a session, the recent
holds Retry-After reads, the fallback chain (whose @HOST:PORT engines are gated for the same
model). A request's lane is the model the engine will run, read where the engine reads it
(request_model.py: the body, a multipart form, ?model=; engine_names.py: llama-swap's
/upstream/MODEL/... path, Ollama's spellings), then the model map. A request whose model cannot be
told (it names none) takes the proxy's own lane -- its model setting's, else the backend's, one
lane for every such request -- said once per proxy, not per request.

The map is read again at most once a second, so `lanelock models` reaches a running proxy without
a restart; a model's Gate is kept once built (at most MAX_LANES, the least recently used without
a lingering turn let go first: a client naming random models must not grow the proxy for ever).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from .. import models
from ..lanes import origin
from ..errors import GateUnavailable
from . import dialects, request_model
from .engine_names import OLLAMA, EngineNames, ollama_name, upstream_segments
from .fallbacks import Chain
from .linger import Linger
from .retry import RetryAfter
from .routes import READS

MAP_FRESH = 1.0    # seconds a read of the model map is used before it is read again
MAX_LANES = 256    # model lanes kept built at once


class Lane:
    """What the proxy keeps for one lane."""

    __slots__ = ("gate", "linger", "retry_after", "chain", "seated")

    def __init__(self, gate, options, say):
        self.gate = gate
        # The lane had seats when a turn last opened it: its requests are not forwarded
        # before they are taken as any (app.py), which would open it twice.
        self.seated = False
        self.linger = Linger(options.linger)
        self.retry_after = RetryAfter(gate)
        self.chain = Chain(gate, options, say)


class Lanes:
    def __init__(self, gate, options, say):
        self.options, self.say = options, say
        self.own = Lane(gate, options, say)
        self.keyed = getattr(gate, "key_by", "backend") == "model"
        self._lanes: OrderedDict = OrderedDict()   # a model lane's name -> Lane
        self._map: tuple = (float("-inf"), {})
        self._said_no_model = False
        self._backend = None
        self.names = EngineNames(origin(gate.lane.given))   # what the engine calls its models

    def __iter__(self):
        yield self.own
        yield from list(self._lanes.values())

    async def model_of(self, upstream, proxied, headers: dict) -> str | None:
        """The model the engine will run for proxied, as it names it (Disagree: a body two
        readers read differently). headers: what the engine is asked its names with."""
        fields = proxied.fields
        if not self.keyed:
            return proxied.dialect.model_of(fields)
        kind = await self.names.find_kind(upstream, headers)
        segments = upstream_segments(proxied.path)
        if segments is not None:   # llama-swap routes it by its path, whatever the body says
            return await self.names.upstream_model(upstream, headers, segments,
                                                   self._mapping())
        if proxied.method in READS and proxied.path in request_model.QUERY_PATHS:
            model = request_model.query_model(proxied.target)
        elif proxied.path in request_model.FORM_PATHS and request_model.is_form(
                proxied.http.headers.get("Content-Type", "")):
            model = request_model.form_model(proxied.body, proxied.http.headers["Content-Type"]) \
                or request_model.query_model(proxied.target)
        else:
            model = proxied.dialect.model_of(fields)
        if kind == OLLAMA or proxied.dialect is dialects.OLLAMA:
            # Go's encoding/json matches `Model` too (one spelling only: request_model.py).
            model = model or next((value for name, value in fields.items()
                                   if name.lower() == "model" and isinstance(value, str)), None)
            model = model and ollama_name(model)
        return model

    def of(self, model: str | None) -> Lane:
        """The lane of a request whose model is model (None: it names none)."""
        if not self.keyed:
            return self.own
        model = (model or "").strip()[:models.MAX_NAME]
        if not model:
            if not self._said_no_model:
                self._said_no_model = True
                self.say.warn(f"lanes keyed by model: a request naming no model takes the "
                              f"lane {self.own.gate.lane.name} (said once)")
            return self.own
        mapping = self._mapping()
        if self.names.kind == OLLAMA:   # the map's name of the model, in whatever spelling
            model = next((name for name in mapping if ollama_name(name) == model), model)
        name = models.lane_model(mapping, model)
        lane = self._lanes.get(name)
        if lane is not None:
            self._lanes.move_to_end(name)
            return lane
        own = self.own.gate
        if own.lane.model == name:
            return self.own
        lane = Lane(own.sibling(own.lane.given, model=model, no_model_said=True),
                    self.options, self.say)
        self._lanes[name] = lane
        self._trim()
        return lane

    def _mapping(self) -> dict:
        """The model map, read at most once a MAP_FRESH; one that cannot be read is {} (each
        model on its own lane; the Gate built for it says why, once)."""
        read_at, mapping = self._map
        now = time.monotonic()
        if now - read_at < MAP_FRESH:
            return mapping
        gate = self.own.gate
        if self._backend is None:
            from ..lanes import Lane as Key

            lane = gate.lane
            self._backend = Key(lane.host, lane.port, lane.scope, None, lane.given, lane.machine)
        try:
            mapping = models.valid(gate.store.kept(models.key(self._backend)))
        except (GateUnavailable, ValueError):
            mapping = {}
        self._map = (now, mapping)
        return mapping

    def _trim(self) -> None:
        for name in list(self._lanes):
            if len(self._lanes) <= MAX_LANES:
                return
            if self._lanes[name].linger.held is None:
                del self._lanes[name]

    async def close(self) -> None:
        for lane in self:
            await lane.linger.close()
