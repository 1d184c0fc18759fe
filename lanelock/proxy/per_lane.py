"""The lanes one proxy serves: the backend's, and with lanes keyed by model (key_by = "model") one
per model its requests name -- or per shared lane, as the model map (models.py) groups them.

Everything the proxy keeps about a lane lives in its Lane here: the Gate (built once, a sibling of
the proxy's: the same settings, root and store), the turn lingering for a session, the recent
holds Retry-After reads, the fallback chain (whose @HOST:PORT engines are gated for the same
model). A request's lane is read from what it names: the model in its body (every family that has
one, dialects.py), or llama-swap's /upstream/MODEL/... path (which routes it, whatever its body
says). A request that names no model takes
the proxy's own lane (its model setting's, else the backend's), said once per proxy, not per
request.

The map is read again at most once a second, so `lanelock models` reaches a running proxy without
a restart; a model's Gate is kept once built (at most MAX_LANES, the least recently used without
a lingering turn let go first: a client naming random models must not grow the proxy for ever).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from urllib.parse import unquote

from .. import models
from ..errors import GateUnavailable
from .fallbacks import Chain
from .linger import Linger
from .retry import RetryAfter

MAP_FRESH = 1.0    # seconds a read of the model map is used before it is read again
MAX_LANES = 256    # model lanes kept built at once
UPSTREAM = "/upstream/"   # llama-swap: /upstream/MODEL/... goes straight to MODEL's server


class Lane:
    """What the proxy keeps for one lane."""

    __slots__ = ("gate", "linger", "retry_after", "chain")

    def __init__(self, gate, options, say):
        self.gate = gate
        self.linger = Linger(options.linger)
        self.retry_after = RetryAfter(gate)
        self.chain = Chain(gate, options, say)


def model_of_path(path: str) -> str | None:
    """The model of llama-swap's /upstream/MODEL/... (percent-decoded), else None."""
    if not path.startswith(UPSTREAM):
        return None
    name = unquote(path[len(UPSTREAM):].partition("/")[0])
    return name or None


class Lanes:
    def __init__(self, gate, options, say):
        self.options, self.say = options, say
        self.own = Lane(gate, options, say)
        self.keyed = getattr(gate, "key_by", "backend") == "model"
        self._lanes: OrderedDict = OrderedDict()   # a model lane's name -> Lane
        self._map: tuple = (float("-inf"), {})
        self._said_no_model = False
        self._backend = None

    def __iter__(self):
        yield self.own
        yield from list(self._lanes.values())

    def of(self, model: str | None, path: str) -> Lane:
        """The lane of a request naming model in its body (None: none) at path."""
        if not self.keyed:
            return self.own
        # llama-swap routes /upstream/MODEL/... by its path, whatever the body names.
        model = (model_of_path(path) or model or "").strip()[:models.MAX_NAME]
        if not model:
            if not self._said_no_model:
                self._said_no_model = True
                self.say.warn(f"lanes keyed by model: a request naming no model takes the "
                              f"lane {self.own.gate.lane.name} (said once)")
            return self.own
        name = models.lane_model(self._mapping(), model)
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
