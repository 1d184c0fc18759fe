"""Where a lane lives: its key, its store and its lock root, resolved from the settings table --
and nothing that takes a turn. The read commands (status, history, metrics, where) stand on a
Place; a Gate (gate.py) is a Place that also takes turns.

A malformed backend or store URL is the caller's mistake (BackendError, UsageProblem: exit 2);
only a well-formed gate that cannot be taken fails open, and that is the Gate's business.
"""

from __future__ import annotations

from . import lanes, say
from .errors import GateUnavailable, UsageProblem
from .paths import Root, resolve_root
from .settings import Settings, store_problem
from .store import for_settings


def _priority_problem(name: str, value, source: str) -> str | None:
    from .settings import validate

    if name == "priority_aging" and isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    problem = validate(name, value)
    return f"{'--priority' if source == 'flag' else source}: {problem}" if problem else None


class Place:
    def __init__(self, backend: str | None = None, *, model: str | None = None,
                 key_by: str | None = None, lock_dir: str | None = None, gate: bool | None = None,
                 grace: float | None = None, store: str | None = None, warn=say.warn,
                 settings: Settings | None = None, lane_store=None):
        self.warn = warn
        if settings is None:
            settings = Settings({
                "backend": backend, "model": model or None, "key_by": key_by,
                "lock_dir": lock_dir or None, "grace": grace, "store": store,
                "gate": None if gate is None else ("always" if gate else "never")})
        self.settings = settings
        self.config, self.config_error = settings.config, settings.config_error
        self.model = settings.get("model")
        self.lane = lanes.lane_for(settings.get("backend"), model=self.model,
                                 key_by=settings.get("key_by"))
        dsn, source = settings.lookup("store")
        if dsn and store_problem(dsn):
            raise UsageProblem(f"{'--store' if source == 'flag' else source}: {store_problem(dsn)}")
        for name in ("priority", "priority_aging"):   # the environment's text is checked here
            problem = _priority_problem(name, *settings.lookup(name))
            if problem:
                raise UsageProblem(problem)
        mode = settings.get("gate")
        self.gated = self.lane.gated if mode == "auto" else mode == "always"
        self.root: Root = resolve_root(settings)
        self._own_store = lane_store
        self.store = lane_store if lane_store is not None else for_settings(settings, self.root)
        self.store.warn = warn   # what a store says but never decides on (a count not added)
        self.lane = self.store.qualify(self.lane)
        self.paths = self.store.where(self.lane)
        self._store_detail = self.paths.pop("detail")

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
