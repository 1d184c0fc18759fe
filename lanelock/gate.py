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
from . import holders, journal, key, sidecar
from .paths import GateUnavailable, Root, resolve_root
from .store import FlockStore, Handle

HELD, DEFLECTED, UNGATED, FAIL_OPEN = "held", "deflected", "ungated", "fail-open"
REASON_BUSY = "local_backend_busy"
BUSY_WORDS = "local model in use by another session"
DEFAULT_GRACE = 0.05   # seconds: long enough to ride out a probe, short enough to be invisible

# In-process reentrancy: (dev, ino) -> [thread ident, depth]. flock conflicts between two open
# file descriptions even inside one process, so the same thread nesting turns must not re-lock.
_HELD_HERE: dict[tuple[int, int], list[int]] = {}


def _stderr_warning(message: str) -> None:
    sys.stderr.write(f"lanelock: warning: {message}\n")


class Gate:
    """One lane's gate. Arguments left as None come from the environment, then config, then defaults."""

    def __init__(self, backend: str | None = None, *, model: str | None = None,
                 key_by: str | None = None, lock_dir: str | None = None, gate: bool | None = None,
                 grace: float | None = None, warn=_stderr_warning):
        self.warn = warn
        self.config_error: str | None = None
        try:
            self.config = config_module.load()
        except config_module.ConfigError as error:
            self.config, self.config_error = config_module.Config(), str(error)
        settings = self.config
        backend = backend or os.environ.get("LANELOCK_BACKEND") or settings.get("backend") \
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
        self.store = FlockStore(self.root)
        self.names = self.store.names(self.lane.stem)

    @property
    def lock_path(self) -> str:
        return self.store.path(self.names["lock"])

    @property
    def sidecar_path(self) -> str:
        return self.store.path(self.names["sidecar"])

    @property
    def journal_path(self) -> str:
        return self.store.path(self.names["journal"])

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
            handle = self.store.open(self.lane.stem, create=False)
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
        handle = self.store.open(self.lane.stem, create=False)  # GateUnavailable: caller's error
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
        self.waited = 0.0
        self._handle: Handle | None = None
        self._key: tuple[int, int] | None = None
        self._started = 0.0
        self._acquired_at = ""

    @property
    def held(self) -> bool:
        return self.state == HELD

    @property
    def lane(self) -> str:
        return self.gate.lane.name

    @property
    def lock_path(self) -> str:
        return self.gate.lock_path

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
        for _ in range(3):
            self._handle = None
            handle = self._handle = store.open(gate.lane.stem)
            if handle.caveat:
                gate.warn(handle.caveat)
            ident = (handle.st.st_dev, handle.st.st_ino)
            owner = _HELD_HERE.get(ident)
            if owner and owner[0] == _thread.get_ident():
                return self._nested(handle, ident)
            started = time.monotonic()
            _debug_pause("before-acquire")
            got = store.try_lock(handle)
            if not got:
                if self._ancestor_holds(store.kernel(handle)):
                    return self._nested(handle, None)
                timeout = None if self.wait is None else max(self.wait, gate.grace)
                got = store.wait_lock(handle, timeout)
            self.waited = time.monotonic() - started
            if not got:
                return self._deflect(handle)
            if store.still_current(handle):
                orphan = self._orphan_holder(handle)
                if orphan is not None:   # a live turn holds a removed/replaced lock file
                    return self._deflect(handle, orphan)
                return self._held(handle, ident)
            store.release(handle)   # the file was replaced while we waited: lock the new one
        raise GateUnavailable(f"lock file {gate.lock_path} keeps being replaced")

    def _ancestor_holds(self, view: holders.KernelView | None) -> bool:
        """True when a process up our own tree holds the lane: we are part of its turn."""
        if view is not None:
            pids = set(view.holders)
        else:  # no /proc/locks: trust the holder named in our environment, if it is an ancestor
            if os.environ.get("LANELOCK_HELD") != self.gate.lock_path:
                return False
            try:
                pids = {int(os.environ.get("LANELOCK_HOLDER_PID", ""))}
            except ValueError:
                return False
        return bool(pids) and bool(pids & set(holders.ancestors()))

    def _orphan_holder(self, handle: Handle) -> dict | None:
        """The holder of a lock file that was removed or replaced while it held it, if still alive.

        Its lock is on the old inode, ours on the new one: taking the lane now would make two
        gates. The sidecar names it (pid, start time, lock_inode); the kernel confirms it."""
        record, _ = sidecar.read(self.gate.names["sidecar"], dir_fd=handle.dir_fd)
        inode = sidecar.field(record, "lock_inode", int)
        pid = sidecar.field(record, "pid", int)
        if record is None or "released_at" in record or inode is None or pid is None \
                or inode == handle.st.st_ino or pid == os.getpid():
            return None
        if holders.start_ticks(pid) != sidecar.field(record, "start_ticks", int):
            return None
        if holders.holds_other_inode(pid, handle.st, inode) is None:
            return None
        return {"pid": pid, "session": sidecar.field(record, "session", str),
                "model": sidecar.field(record, "model", str), "held_for": None, "lanelock": True,
                "command": _argv_text(sidecar.field(record, "argv", list, [])),
                "note": f"holds a removed or replaced lock file (inode {inode})"}

    def _nested(self, handle: Handle, ident) -> "Turn":
        self.gate.store.release(handle)
        self._handle = None
        if ident is not None:
            _HELD_HERE[ident][1] += 1
            self._key = ident
        self.state, self.nested = HELD, True
        return self

    def _held(self, handle: Handle, ident) -> "Turn":
        gate = self.gate
        self.state, self._key = HELD, ident
        _HELD_HERE[ident] = [_thread.get_ident(), 1]
        self._started = time.monotonic()
        self._acquired_at = _utc_now()
        _debug_pause("after-acquire")
        journal.rotate_if_needed(handle.dir_fd, gate.names["journal"], gate.journal_max_bytes)
        self._write_sidecar(self._record())
        if self.waited >= 0.001 and self.wait != 0:
            self._log("waited", waited=round(self.waited, 6))
        self._log("acquired")
        return self

    def _deflect(self, handle: Handle, holder: dict | None = None) -> "Turn":
        self.state, self.reason = DEFLECTED, REASON_BUSY
        self.holder = holder or describe_holder(self.gate, handle)
        self._log("deflected", reason=REASON_BUSY, holder=self.holder)
        self.gate.store.release(handle)
        self._handle = None
        return self

    def _fail_open(self, why: str, handle: Handle | None) -> "Turn":
        self.state, self.reason = FAIL_OPEN, why
        self.gate.warn(f"gate unavailable ({why}); running without it")
        if handle is not None and handle.dir_fd is not None and handle.dir_fd >= 0:
            try:
                journal.append(handle.dir_fd, self.gate.names["journal"],
                               self._event("fail-open", reason=why))
            except OSError:
                pass  # the one warning above is all a failing gate may say
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
        # Update the record while still holding the lock: after unlock it belongs to the next turn.
        record = self._record()
        record.update(released_at=_utc_now(), exit_status=exit_status, held_seconds=duration)
        self._write_sidecar(record)
        self._log("released", duration=duration, exit_status=exit_status)
        _debug_pause("during-release")
        _HELD_HERE.pop(self._key, None)
        self.gate.store.release(handle)
        self._handle = None
        self.state = "released"

    # -- records ---------------------------------------------------------------------------------
    def _record(self) -> dict:
        pid = os.getpid()
        return {
            "schema": sidecar.SCHEMA, "lane": self.gate.lane.name, "backend": self.gate.lane.given,
            "pid": pid, "start_ticks": holders.start_ticks(pid), "boot_id": boot_id(),
            "session": self.session, "model": self.model, "argv": self.argv,
            "user": user_name(), "uid": os.getuid(), "hostname": os.uname().nodename,
            "acquired_at": self._acquired_at, "acquired_monotonic": self._started,
            # status compares it with the file at the path: a replaced lock file is two gates.
            "lock_inode": self._handle.st.st_ino if self._handle and self._handle.st else None,
        }

    def _event(self, event: str, **extra) -> dict:
        # "monotonic" is one system-wide clock: durations between turns survive wall-clock jumps.
        return {"event": event, "time": _utc_now(), "ts": round(time.time(), 6),
                "monotonic": round(time.monotonic(), 6),
                "lane": self.gate.lane.name, "pid": os.getpid(), "session": self.session,
                "model": self.model, **extra}

    def _write_sidecar(self, record: dict) -> None:
        try:
            sidecar.write(self._handle.dir_fd, self.gate.names["sidecar"], record)
        except OSError as error:
            self.gate.warn(f"lane held, but the sidecar was not written: {error.strerror or error}")

    def _log(self, event: str, **extra) -> None:
        try:
            journal.append(self._handle.dir_fd, self.gate.names["journal"], self._event(event, **extra))
        except OSError as error:
            if self.state == HELD or event == "released":
                self.gate.warn(f"journal not written: {error.strerror or error}")


def _debug_pause(step: str) -> None:
    """Fault-test hook: LANELOCK_DEBUG_PAUSE=STEP stops this process (SIGSTOP) at STEP, so a test
    can SIGKILL it exactly there. Steps: before-acquire, after-acquire, during-release."""
    if os.environ.get("LANELOCK_DEBUG_PAUSE") == step:
        import signal

        os.kill(os.getpid(), signal.SIGSTOP)


def describe_holder(gate: Gate, handle: Handle) -> dict:
    """Who holds the lane: the kernel's pid, labelled from the sidecar when the sidecar agrees."""
    view = gate.store.kernel(handle)
    record, problem = sidecar.read(gate.names["sidecar"], dir_fd=handle.dir_fd)
    kernel_pids = list(view.holders) if view else []
    pid = sidecar.field(record, "pid", int)
    agrees = (record is not None and "released_at" not in record
              and (view is None or pid in kernel_pids)
              and sidecar.field(record, "start_ticks", int) in (None, holders.start_ticks(pid or -1)))
    if agrees:
        since = sidecar.field(record, "acquired_monotonic", float)
        held_for = time.monotonic() - since if since and record.get("boot_id") == boot_id() else None
        return {"pid": pid, "session": sidecar.field(record, "session", str),
                "model": sidecar.field(record, "model", str),
                "held_for": round(held_for, 3) if held_for is not None else None,
                "lanelock": True, "command": _argv_text(sidecar.field(record, "argv", list, []))}
    holder = kernel_pids[0] if kernel_pids else None
    return {"pid": holder, "session": None, "model": None, "held_for": None, "lanelock": False,
            "command": holders.command_line(holder) if holder else None,
            "note": problem or "sidecar does not match the kernel's holder"}


def holder_words(holder: dict | None) -> str:
    """'pid 42, session alice@pts/1, model qwen, held 12.3s' for one stderr line."""
    if not holder:
        return "holder unknown"
    parts = [f"pid {holder['pid']}" if holder.get("pid") else "pid ?"]
    if holder.get("session"):
        parts.append(f"session {holder['session']}")
    if holder.get("model"):
        parts.append(f"model {holder['model']}")
    if holder.get("held_for") is not None:
        parts.append(f"held {holder['held_for']:.1f}s")
    if not holder.get("lanelock") and holder.get("command"):
        parts.append(f"not a lanelock turn: {holder['command']}")
    elif holder.get("lanelock") and holder.get("note"):
        parts.append(holder["note"])
    return sanitize(", ".join(parts))


def sanitize(text: str, limit: int = 300) -> str:
    """One printable line: labels may carry newlines or ANSI escapes."""
    clean = "".join(ch if ch.isprintable() else "?" for ch in str(text))
    return clean if len(clean) <= limit else clean[:limit] + "…"


def _argv_text(argv: list) -> str:
    import shlex

    return shlex.join(str(word) for word in argv)[:500]


def _utc_now() -> str:
    # time.strftime, not datetime: the run path pays for every import.
    now = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1000):03d}Z"


_BOOT_ID: list[str] = []


def boot_id() -> str | None:
    if not _BOOT_ID:
        try:
            with open("/proc/sys/kernel/random/boot_id") as handle:
                _BOOT_ID.append(handle.read().strip())
        except OSError:
            _BOOT_ID.append("")
    return _BOOT_ID[0] or None


def user_name() -> str:
    try:
        import pwd

        return pwd.getpwuid(os.getuid()).pw_name
    except (KeyError, ImportError):
        return str(os.getuid())


def default_session() -> str:
    """user@tty for a person at a terminal; user@cron when there is no controlling terminal."""
    for fd in (0, 1, 2):
        try:
            return f"{user_name()}@{os.ttyname(fd).removeprefix('/dev/')}"
        except OSError:
            continue
    try:
        os.close(os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY | os.O_CLOEXEC))
        return f"{user_name()}@tty"
    except OSError:
        return f"{user_name()}@cron"
