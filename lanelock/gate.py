"""The gate: one turn holds a lane; everyone else deflects, waits, or runs ungated.

    with Gate("127.0.0.1:8080").turn(session="chat", model="qwen") as turn:
        if turn.held: ...generate locally...
        else: ...use the fallback; turn.reason says why...

Fail open: the gate is a performance guard, so if it cannot be taken (root missing and not creatable,
a symlink where the lock should be, ENOSPC, a broken config) the turn proceeds ungated with ONE
warning. Once the lock is held, sidecar and journal trouble is only a warning: it never releases or
skips the lock.
"""

from __future__ import annotations

import _thread
import os
import sys
import time

from . import config as config_module
from . import holders, key
from .store import journal, sidecar
from .facts import argv_text, boot_id, default_session, holder_words, hostname, own_start_ticks
from .facts import sanitize, user_name, utc_now
from .paths import GateUnavailable, Root, resolve_root
from .store.flock import FlockStore, Handle

__all__ = ["Gate", "Turn", "holder_words", "sanitize", "describe_holder"]

HELD, DEFLECTED, UNGATED, FAIL_OPEN = "held", "deflected", "ungated", "fail-open"
REASON_BUSY = "local_backend_busy"
BUSY_WORDS = "local model in use by another session"
DEFAULT_GRACE = 0.05   # seconds: long enough to ride out a probe, short enough to be invisible

# In-process reentrancy: store ident -> [thread ident, depth]. flock conflicts between two open
# file descriptions even inside one process, so the same thread nesting turns must not re-lock.
_HELD_HERE: dict[tuple, list[int]] = {}


def _stderr_warning(message: str) -> None:
    sys.stderr.write(f"lanelock: warning: {message}\n")


class Gate:
    """One lane's gate. Arguments left as None come from the environment, then config, then defaults."""

    def __init__(self, backend: str | None = None, *, model: str | None = None,
                 key_by: str | None = None, lock_dir: str | None = None, gate: bool | None = None,
                 grace: float | None = None, store: str | None = None, warn=_stderr_warning):
        self.warn = warn
        self.config_error: str | None = None
        try:
            self.config = config_module.load()
        except config_module.ConfigError as error:
            self.config, self.config_error = config_module.Config(), str(error)
        settings = self.config
        if backend is None:   # an explicit empty --backend is a usage error, not "unset"
            backend = os.environ.get("LANELOCK_BACKEND") or settings.get("backend") \
                or key.DEFAULT_BACKEND
        self.model = model or os.environ.get("LANELOCK_MODEL") or settings.get("model")
        key_by = key_by or settings.get("key_by") or "backend"
        self.lane = key.lane_for(backend, model=self.model, key_by=key_by)  # BackendError: usage
        if gate is None:
            gate = {"always": True, "never": False}.get(settings.get("gate", "auto"))
        self.gated = self.lane.gated if gate is None else gate
        self.grace = DEFAULT_GRACE if grace is None else grace
        if grace is None and settings.get("grace") is not None:
            self.grace = float(settings.get("grace"))
        self.journal_max_bytes = settings.get("journal_max_bytes", journal.DEFAULT_MAX_BYTES)
        system = None
        if "lock_dir" in settings.values:
            system = (settings.values["lock_dir"], settings.origins["lock_dir"])
        self.root: Root = resolve_root(lock_dir, system)
        dsn = store or os.environ.get("LANELOCK_STORE") or settings.get("store")
        if dsn:
            from .store.postgres import PgStore

            self.store = PgStore(dsn)
            if self.lane.scope == "local":
                # "localhost" is a different machine on every host sharing the store.
                self.lane = key.qualified(self.lane, hostname())
        else:
            self.store = FlockStore(self.root)
        self.names = self.store.names(self.lane.stem)

    @property
    def lock_path(self) -> str:
        return self.store.locator(self.lane)

    @property
    def sidecar_path(self) -> str | None:
        return self.store.path(self.names["sidecar"]) if self.names else None

    @property
    def journal_path(self) -> str | None:
        return self.store.path(self.names["journal"]) if self.names else None

    def where(self) -> dict:
        return {
            "lane": self.lane.name, "backend": self.lane.given, "scope": self.lane.scope,
            "gated": self.gated, "store": self.store.kind, "root": self.root.path,
            "root_source": self.root.source, "root_detail": self.root.detail,
            "lock_path": self.lock_path, "sidecar_path": self.sidecar_path,
            "journal_path": self.journal_path, "config_files": list(self.config.files),
            "warnings": list(self.config.ignored) + ([self.config_error] if self.config_error else []),
        }

    def turn(self, *, session: str | None = None, model: str | None = None,
             argv: list[str] | None = None, wait: float | None = 0.0) -> "Turn":
        """A turn on this lane; the lock is taken on __enter__ (or acquire()). wait: seconds to
        block for the lane (None: forever); 0 deflects after the short grace period."""
        return Turn(self, session=session, model=model or self.model, argv=argv, wait=wait)

    def busy(self) -> bool:
        """Is the lane held right now? Asks the kernel (/proc/locks) and never takes the lock, so
        asking can never make a turn deflect. Without /proc/locks it falls back to a probe."""
        if not self.gated:
            return False
        try:
            handle = self.store.open(self.lane, create=False)
        except GateUnavailable:
            return False
        try:
            if handle.fd is None:
                return False
            view = self.store.kernel(handle)
            if view is not None:
                return bool(view.holders)
            got = self.store.try_lock(handle)
            return not got
        finally:
            self.store.release(handle)

    def probe(self) -> dict:
        """Take the lock without blocking and let go at once: 'free' or 'busy' (with the holder)."""
        result = {"lane": self.lane.name, "lock_path": self.lock_path, "gated": self.gated}
        if not self.gated:
            return {**result, "state": "ungated"}
        handle = self.store.open(self.lane, create=False)  # GateUnavailable: caller's error
        try:
            if handle.fd is None:
                return {**result, "state": "free", "note": "no lock file yet"}
            if self.store.try_lock(handle):
                return {**result, "state": "free"}
            return {**result, "state": "busy", "holder": describe_holder(self, handle)}
        finally:
            self.store.release(handle)


class Turn:
    def __init__(self, gate: Gate, *, session, model, argv, wait):
        self.gate = gate
        self.session = session or os.environ.get("LANELOCK_SESSION") \
            or gate.config.get("session") or default_session()
        self.model = model
        self.argv = list(argv or [])
        self.wait = wait
        self.state: str | None = None
        self.reason: str | None = None
        self.holder: dict | None = None
        self.nested = False
        self.lost = False      # the store took the lane away mid-turn (PostgreSQL session ended)
        self.waited = 0.0
        self._handle: Handle | None = None
        self._key: tuple | None = None
        self._started = 0.0
        self._acquired_at = ""

    @property
    def held(self) -> bool:
        return self.state == HELD

    @property
    def proceed(self) -> bool:
        """Use the primary backend? True when held, ungated or fail-open; False when deflected."""
        return self.state in (HELD, UNGATED, FAIL_OPEN)

    @property
    def lane(self) -> str:
        return self.gate.lane.name

    @property
    def lock_path(self) -> str:
        return self.gate.lock_path

    @property
    def handle(self):
        return self._handle

    def __enter__(self) -> "Turn":
        return self.acquire()

    def __exit__(self, kind, value, traceback) -> None:
        self.release(None if kind else 0)

    # -- acquiring -------------------------------------------------------------------------------
    def acquire(self) -> "Turn":
        gate = self.gate
        if gate.config_error:
            return self._fail_open(gate.config_error, None)
        if not gate.gated:
            self.state = UNGATED
            return self
        try:
            return self._acquire_gated()
        except GateUnavailable as error:
            return self._fail_open(str(error), self._handle)

    def _acquire_gated(self) -> "Turn":
        gate, store = self.gate, self.gate.store
        # Facts the holder record needs, read (once per process) before the lock: after it, they
        # would delay the hand-off.
        own_start_ticks(), boot_id(), user_name(), hostname()
        for _ in range(3):
            self._handle = None
            handle = self._handle = store.open(gate.lane)
            if handle.caveat:
                gate.warn(handle.caveat)
            ident = store.ident(handle)
            owner = _HELD_HERE.get(ident)
            if owner and owner[0] == _thread.get_ident():
                return self._nested(handle, ident)
            started = time.monotonic()
            _debug_pause("before-acquire")
            got = store.try_lock(handle)
            if not got:
                if self._ancestor_holds(store.holder_pids_here(handle, store.kernel(handle))):
                    return self._nested(handle, None)
                timeout = None if self.wait is None else max(self.wait, gate.grace)
                got = store.wait_lock(handle, timeout)
            self.waited = time.monotonic() - started
            if not got:
                return self._deflect(handle)
            if store.still_current(handle):
                orphan = store.orphan_holder(handle)
                if orphan is not None:   # a live turn holds a removed/replaced lock file
                    return self._deflect(handle, orphan)
                return self._held(handle, ident)
            store.release(handle)   # the file was replaced while we waited: lock the new one
        raise GateUnavailable(f"lock file {gate.lock_path} keeps being replaced")

    def _ancestor_holds(self, pids: set[int]) -> bool:
        """True when a process up our own tree holds the lane: we are part of its turn."""
        if not pids:  # no kernel view: trust the holder named in our environment, if an ancestor
            if os.environ.get("LANELOCK_HELD") != self.gate.lock_path:
                return False
            try:
                pids = {int(os.environ.get("LANELOCK_HOLDER_PID", ""))}
            except ValueError:
                return False
        return bool(pids & set(holders.ancestors()))

    def _nested(self, handle: Handle, ident) -> "Turn":
        self.gate.store.release(handle)
        self._handle = None
        if ident is not None:
            _HELD_HERE[ident][1] += 1
            self._key = ident
        self.state, self.nested = HELD, True
        return self

    def _held(self, handle: Handle, ident) -> "Turn":
        self.state, self._key = HELD, ident
        _HELD_HERE[ident] = [_thread.get_ident(), 1]
        self._started = time.monotonic()
        now = time.time()
        self._acquired_at = utc_now(now)
        _debug_pause("after-acquire")
        # The record is written before the caller runs anything: whoever sees the command
        # running must also find who runs it.
        self.gate.store.rotate(self._handle, self.gate.journal_max_bytes)
        self._write_sidecar(self._record())
        events = [self._event("acquired", at=(now, self._acquired_at))]
        if self.waited >= 0.001 and self.wait != 0:
            events.insert(0, self._event("waited", at=(now, self._acquired_at),
                                         waited=round(self.waited, 6)))
        self._log(*events)
        return self

    def _deflect(self, handle: Handle, holder: dict | None = None) -> "Turn":
        self.state, self.reason = DEFLECTED, REASON_BUSY
        self.holder = holder or describe_holder(self.gate, handle)
        self._log(self._event("deflected", reason=REASON_BUSY, holder=self.holder))
        self.gate.store.release(handle)
        self._handle = None
        return self

    def _fail_open(self, why: str, handle: Handle | None) -> "Turn":
        self.state, self.reason = FAIL_OPEN, why
        self.gate.warn(f"gate unavailable ({why}); running without it")
        if handle is None and not self.gate.config_error:
            handle = self.gate.store.event_handle(self.gate.lane)
        if handle is not None:
            try:
                self.gate.store.append_event(handle, self._event("fail-open", reason=why))
            except Exception:  # noqa: BLE001 - the one warning above is all a failing gate may say
                pass
            self.gate.store.release(handle)
        self._handle = None
        return self

    # -- releasing -------------------------------------------------------------------------------
    def release(self, exit_status: int | None = None) -> None:
        """Let the lane go (idempotent). exit_status is recorded in the sidecar and journal."""
        if self.state != HELD:
            return
        if self.nested:
            if self._key is not None and self._key in _HELD_HERE:
                _HELD_HERE[self._key][1] -= 1
            self.state = "released"
            return
        handle = self._handle
        duration = round(time.monotonic() - self._started, 6)
        if not self.lost:   # a lost lane already belongs to someone else: leave its record alone
            # Update the record while still holding the lock: after unlock it is the next turn's.
            now = time.time()
            fields = {"released_at": utc_now(now), "exit_status": exit_status,
                      "held_seconds": duration}
            try:
                self.gate.store.write_release(self._handle, self._record, fields)
            except OSError as error:
                self.gate.warn(f"the sidecar's release was not written: {error.strerror or error}")
            self._log(self._event("released", at=(now, fields["released_at"]),
                                  duration=duration, exit_status=exit_status))
        _debug_pause("during-release")
        _HELD_HERE.pop(self._key, None)
        self.gate.store.release(handle)
        self._handle = None
        self.state = "released"

    # -- records ---------------------------------------------------------------------------------
    def _record(self) -> dict:
        record = {
            "schema": sidecar.SCHEMA, "lane": self.gate.lane.name, "backend": self.gate.lane.given,
            "pid": os.getpid(), "start_ticks": own_start_ticks(), "boot_id": boot_id(),
            "session": self.session, "model": self.model, "argv": self.argv,
            "user": user_name(), "uid": os.getuid(), "hostname": hostname(),
            "acquired_at": self._acquired_at, "acquired_monotonic": self._started,
        }
        if self._handle is not None:
            record.update(self.gate.store.record_extra(self._handle))
        return record

    def _event(self, event: str, at: tuple[float, str] | None = None, **extra) -> dict:
        # "monotonic" is one system-wide clock: durations between turns survive wall-clock jumps.
        # at: (time.time(), its utc_now() text) when the caller has both already.
        now, text = at if at is not None else (time.time(), None)
        return {"event": event, "time": text or utc_now(now), "ts": round(now, 6),
                "monotonic": round(time.monotonic(), 6),
                "lane": self.gate.lane.name, "pid": os.getpid(), "session": self.session,
                "model": self.model, **extra}

    def _write_sidecar(self, record: dict) -> None:
        try:
            self.gate.store.write_holder(self._handle, record)
        except OSError as error:
            self.gate.warn(f"lane held, but the sidecar was not written: {error.strerror or error}")

    def _log(self, *events: dict) -> None:
        """Events as one append (one write() on a flock store's journal)."""
        try:
            self.gate.store.append_event(self._handle, *events)
        except OSError as error:
            if self.state == HELD or events[-1]["event"] == "released":
                self.gate.warn(f"journal not written: {error.strerror or error}")


def _debug_pause(step: str) -> None:
    """Fault-test hook: LANELOCK_DEBUG_PAUSE=STEP stops this process (SIGSTOP) at STEP, so a test
    can SIGKILL it exactly there. Steps: before-acquire, after-acquire, during-release."""
    if os.environ.get("LANELOCK_DEBUG_PAUSE") == step:
        import signal

        os.kill(os.getpid(), signal.SIGSTOP)


def describe_holder(gate: Gate, handle) -> dict:
    """Who holds the lane: the kernel's (or server's) holder, labelled from the holder record when
    the record agrees with it."""
    store = gate.store
    view = store.kernel(handle)
    record, problem = store.read_holder(handle)
    if record is not None and "released_at" not in record and store.holder_agrees(record, view):
        here = record.get("hostname") == hostname()
        since = sidecar.field(record, "acquired_monotonic", float)
        same_clock = here and since and record.get("boot_id") == boot_id()
        held_for = time.monotonic() - since if same_clock else None
        return {"pid": sidecar.field(record, "pid", int), "host": None if here else
                sidecar.field(record, "hostname", str),
                "session": sidecar.field(record, "session", str),
                "model": sidecar.field(record, "model", str),
                "held_for": round(held_for, 3) if held_for is not None else None,
                "lanelock": True, "command": argv_text(sidecar.field(record, "argv", list, []))}
    pid, command = store.unlabelled(view)
    if problem and store.is_collision(problem):   # another lane's turn holds the same key
        return {"pid": pid, "session": None, "model": None, "held_for": None, "lanelock": True,
                "command": command, "note": problem}
    return {"pid": pid, "session": None, "model": None, "held_for": None, "lanelock": False,
            "command": command, "note": problem or "the holder record does not match the holder"}
