"""Where a lane lives: its key, its store and its lock root, resolved from the settings table --
and nothing that takes a turn. The read commands (status, history, metrics, where) stand on a
Place; a Gate (gate.py) is a Place that also takes turns.

A malformed backend or store URL is the caller's mistake (BackendError, UsageProblem: exit 2);
only a well-formed gate that cannot be taken fails open, and that is the Gate's business.
"""

from __future__ import annotations

import os

from . import lanes, say
from .errors import GateUnavailable, UsageProblem
from .paths import Root, resolve_root
from .settings import Settings, store_problem
from .store import for_settings


_SAID: set = set()   # the settings' warnings already said by this process: each is said once


def check_arguments(arguments: dict) -> None:
    """The API's arguments, checked at the call (Gate(8080) must not fail later as an
    AttributeError): TypeError for the wrong type, ValueError for a bad value. None: not given."""
    for name, value in arguments.items():
        if value is None:
            continue
        if name in ("backend", "model", "key_by", "store", "priority", "session"):
            if not isinstance(value, str):
                example = {"backend": " such as '127.0.0.1:8080'",
                           "priority": " (interactive, normal or batch)"}.get(name, "")
                raise TypeError(f"{name} must be a string{example}, not "
                                f"{type(value).__name__} {value!r}")
        elif name == "lock_dir":
            if not isinstance(value, (str, os.PathLike)):
                raise TypeError(f"lock_dir must be a path, not {type(value).__name__} {value!r}")
        elif name == "gate":
            if not isinstance(value, bool):
                raise TypeError(f"gate must be True, False or None, not {value!r}")
        elif name in ("grace", "wait"):
            check_seconds(name, value)
    if arguments.get("key_by") not in (None, "backend", "model"):
        raise ValueError(f"key_by must be 'backend' or 'model', not {arguments['key_by']!r}")
    if arguments.get("priority") is not None:
        from .priority import CLASSES, class_named

        if class_named(arguments["priority"]) is None:
            raise ValueError(f"priority must be one of {', '.join(CLASSES)}, not "
                             f"{arguments['priority']!r}")


def check_seconds(name: str, value) -> None:
    """A number of seconds given to the API: a real number, 0 or more, finite (but wait's inf,
    which is None: no bound)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, not {type(value).__name__} "
                        f"{value!r}")
    if value != value or value < 0 or (value == float("inf") and name != "wait"):
        raise ValueError(f"{name} must be a number of seconds, 0 or more, not {value!r}")


class Place:
    def __init__(self, backend: str | None = None, *, model: str | None = None,
                 key_by: str | None = None, lock_dir: str | None = None, gate: bool | None = None,
                 grace: float | None = None, store: str | None = None, warn=say.warn,
                 settings: Settings | None = None, lane_store=None,
                 no_model_said: bool = False):
        self.warn = warn
        if settings is None:
            check_arguments({"backend": backend, "model": model, "key_by": key_by,
                             "lock_dir": lock_dir, "gate": gate, "grace": grace, "store": store})
            settings = Settings({
                "backend": backend, "model": model or None, "key_by": key_by,
                "lock_dir": os.fspath(lock_dir) if lock_dir else None, "grace": grace,
                "store": store,
                "gate": None if gate is None else ("always" if gate else "never")})
        self.settings = settings
        self.config, self.config_error = settings.config, settings.config_error
        self.model = settings.get("model")
        backend, source = settings.lookup("backend")
        # Lanes keyed by model (key_by), and whether this place's lane is a model's: a turn
        # that names no model takes the backend's lane -- a setting never stops a command.
        self.key_by = settings.get("key_by")
        by_model = self.key_by == "model" and bool((self.model or "").strip())
        try:
            self.lane = lanes.lane_for(backend, model=self.model,
                                       key_by="model" if by_model else "backend")
        except lanes.BackendError as error:   # say where a backend nobody typed came from
            if source in ("flag", "default"):
                raise
            raise lanes.BackendError(f"{source}: {error}") from None
        dsn, source = settings.lookup("store")
        if dsn and store_problem(dsn):
            raise UsageProblem(f"{'--store' if source == 'flag' else source}: {store_problem(dsn)}")
        messages = settings.warnings()
        if self.key_by == "model" and not by_model and not no_model_said:
            source = settings.lookup("key_by")[1]
            messages.append(f"{'--key-by model' if source == 'flag' else source}: lanes keyed "
                            "by model, but no model is named (--model NAME or LANELOCK_MODEL): "
                            f"the backend's lane {self.lane.name} is used")
        for message in messages:   # a bad value passed over: said once, not per gate
            if message not in _SAID:
                _SAID.add(message)
                warn(message)
        mode = settings.get("gate")
        self.gated = self.lane.gated if mode == "auto" else mode == "always"
        self.root: Root = resolve_root(settings)
        self._own_store = lane_store
        self.store = lane_store if lane_store is not None else for_settings(settings, self.root)
        self.store.warn = warn   # what a store says but never decides on (a count not added)
        if by_model:
            self.lane = self._mapped(self.lane)
        self.lane = self.store.qualify(self.lane)
        self.paths = self.store.where(self.lane)
        self._store_detail = self.paths.pop("detail")

    def _mapped(self, lane):
        """A model's lane as the model map (models.py) keys it: a shared lane's, else its own.
        Read here, where every turn's lane is computed, so `run` and the proxy agree; a map
        that cannot be read leaves the model on its own lane, said once."""
        from . import models

        backend = lanes.Lane(lane.host, lane.port, lane.scope, None, lane.given)
        try:
            mapping = models.read(self.store, self.store.qualify(backend))
        except (GateUnavailable, ValueError) as error:
            message = f"the model map of {backend.name} is not used: {error}"
            if message not in _SAID:
                _SAID.add(message)
                self.warn(message)
            return lane
        named = models.lane_model(mapping, lane.model)
        if named == lane.model:
            return lane
        return lanes.Lane(lane.host, lane.port, lane.scope, named, lane.given)

    def warn_with(self, warn) -> None:
        """Say this gate's warnings with warn from now on, and those of the sibling gates made
        after (fallback engines' lanes): for a caller that lives for many turns and says them
        its own way (the proxy says a failing gate's once per incident, not once a request).
        The store keeps the warn it was given (a count not added is said as it comes)."""
        self.warn = warn

    @property
    def lock_path(self) -> str:
        return self.paths["lock_path"]

    @property
    def sidecar_path(self) -> str | None:
        return self.paths["sidecar_path"]

    @property
    def journal_path(self) -> str | None:
        return self.paths["journal_path"]

    def where(self) -> dict:
        return {
            "lane": self.lane.name, "backend": self.lane.given, "scope": self.lane.scope,
            "gated": self.gated, "store": self.store.kind, "store_detail": self._store_detail,
            "root": self.root.path, "root_source": self.root.source,
            "root_detail": self.root.detail, **self.paths,
            "config_files": list(self.config.files),
            "warnings": list(self.config.ignored) + ([self.config_error] if self.config_error
                                                     else []) + self.store.problems(),
        }

    def busy(self) -> bool:
        """Is the lane held right now -- by a turn, or by the command of a killed one that still
        runs (store/outlived.py)? Asks the lock's own truth (/proc/locks, pg_locks) through the
        store's survey and never takes the lock, so asking can never make a turn deflect."""
        if not self.gated:
            return False
        try:
            facts = self.store.survey(self.lane)[0]
        except GateUnavailable:
            return False
        return bool(facts.held) or facts.ending is not None
