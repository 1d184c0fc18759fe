"""The gate: one turn holds a lane; everyone else deflects, waits, or runs ungated.

    with Gate("127.0.0.1:8080").turn(session="chat", model="qwen") as turn:
        if turn.proceed: ...generate locally (held, ungated or fail-open)...
        else: ...use the fallback; turn.reason says why...

Fail open: the gate is a performance guard, so if it cannot be taken (root missing and not creatable,
a symlink where the lock should be, ENOSPC, a broken config) the turn proceeds ungated with ONE
warning. Once the lock is held, holder-record and journal trouble is only a warning: it never
releases or skips the lock.
"""

from __future__ import annotations

import _thread
import os
import time

from . import holder as holder_facts
from . import handover, say
from .duration import backoff
from .errors import GateCrowded, GateUnavailable, RecordNotWritten, ServerCrowded, WouldBlock
from .facts import boot_id, default_session, hostname, own_start_ticks, user_name, utc_now
from .place import Place, check_arguments
from .priority import CLASSES, class_named
from .settings import Settings

__all__ = ["Gate", "Turn", "describe_holder", "HELD", "DEFLECTED", "UNGATED", "FAIL_OPEN",
           "RELEASED", "REASON_BUSY", "BUSY_WORDS", "busy_sentence"]

# A turn's states (LANELOCK_STATE, turn.state, the proxy's X-Lanelock-State).
HELD, DEFLECTED, UNGATED, FAIL_OPEN, RELEASED = "held", "deflected", "ungated", "fail-open", "released"
CANCELLED = "cancelled"   # an asyncio turn whose task was cancelled while it waited
REASON_BUSY = "local_backend_busy"
# How long a lost turn's release asks a server that does not answer to journal its overlap.
LOST_JOURNAL_WITHIN = 4.0
BUSY_WORDS = "local model in use by another session"


def busy_sentence(who: str, then: str | None = None) -> str:
    """The one line every deflection prints (run and proxy alike), and its reason's words:
    'local_backend_busy: local model in use by another session (WHO); THEN'."""
    return f"{REASON_BUSY}: {BUSY_WORDS} ({who})" + (f"; {then}" if then else "")

# In-process reentrancy: store ident -> (the thread or task holding it, its turn). flock conflicts
# between two open file descriptions even inside one process, so the same thread nesting turns must
# not re-lock.
_HELD_HERE: dict[tuple, tuple] = {}


class Gate(Place):
    """One lane's gate: its Place (place.py: the lane, its store, its root) and the turns taken
    on it. Arguments left as None come from the settings table (environment, then config files,
    then defaults); settings= gives a resolved table instead. lane_store: a store object (a
    LaneStore of your own, store/base.py) instead of the one the settings name. priority: the
    class of this gate's turns (interactive, normal or batch) unless turn(priority=) says.
    A wrong type is a TypeError and a bad value a ValueError, at the call."""

    def __init__(self, backend: str | None = None, *, model: str | None = None,
                 key_by: str | None = None, lock_dir: str | None = None, gate: bool | None = None,
                 grace: float | None = None, store: str | None = None, warn=say.warn,
                 settings: Settings | None = None, lane_store=None, priority: str | None = None):
        check_arguments({"priority": priority})
        super().__init__(backend, model=model, key_by=key_by, lock_dir=lock_dir, gate=gate,
                         grace=grace, store=store, warn=warn, settings=settings,
                         lane_store=lane_store)
        self.grace = float(self.settings.get("grace"))
        self.priority = class_named(priority) or self.settings.get("priority")
        self.journal_max_bytes = self.settings.get("journal_max_bytes")

    def sibling(self, backend: str, model: str | None = None) -> "Gate":
        """The gate of another backend's lane (a fallback engine), read with this gate's settings:
        the same files, lock root and store, so both lanes live side by side. BackendError or
        UsageProblem for a malformed backend."""
        flags = self.settings.flags
        return Gate(settings=self.settings.derive(
            backend=backend, model=model, lock_dir=flags.get("lock_dir"), store=flags.get("store")),
            warn=self.warn, lane_store=self._own_store, priority=self.priority)

    def turn(self, *, session: str | None = None, model: str | None = None,
             argv: list[str] | None = None, wait: float | None = 0.0,
             labels: dict | None = None, askers=None, priority: str | None = None,
             command_pid: int | None = None, fallback: bool | None = None) -> "Turn":
        """A turn on this lane; the lock is taken on entering it (`with`, or `async with` in
        asyncio code, which never blocks the event loop), or by acquire(). wait: seconds to block
        for the lane (None: forever); 0 deflects after the short grace period. labels: more
        facts for the holder record and the journal (the proxy's client and path). askers: who
        asks for the turn when not this process (the proxy's client): a callable returning
        handover.Asker values, called only when the lane is busy. priority: interactive, normal
        or batch -- who goes first among the turns that wait (default: the priority setting).
        command_pid: a process already started that the turn runs (`lanelock run`'s child): if
        this process is killed first, the next turn waits for that one to end -- for its whole
        process group when it leads one (store/outlived.py), as `run`'s command does. A killed
        turn's process is believed when it carries the turn's LANELOCK_HELD (start it with
        turn.env and name it with turn.command_started(pid)). fallback: False
        when nothing runs if the turn deflects (`run` with no fallback, a proxy with none for the
        request): the journal and the metrics count it busy, not deflected."""
        check_arguments({"wait": wait, "priority": priority, "session": session, "model": model})
        wait = None if wait == float("inf") else wait
        return Turn(self, session=session, model=model or self.model, argv=argv, wait=wait,
                    labels=labels, askers=askers, priority=priority, command_pid=command_pid,
                    fallback=fallback)

    def probe(self) -> dict:
        """Take the lock without blocking and let go at once: 'free' or 'busy' (with the holder)."""
        result = {"lane": self.lane.name, "lock_path": self.lock_path, "gated": self.gated}
        if not self.gated:
            return {**result, "state": "ungated"}
        from .store.availability import gate_problem

        problem = gate_problem(self.store, self.lane)   # what a turn would meet here (issue 23)
        if problem:
            raise GateUnavailable(problem)   # the caller's error: never "free"
        handle = self.store.open(self.lane, create=False)  # GateUnavailable: caller's error
        try:
            if not handle.exists:
                return {**result, "state": "free", "note": "no lock file yet"}
            if self.store.try_lock(handle):
                return {**result, "state": "free"}
            return {**result, "state": "busy", "holder": describe_holder(self, handle)}
        finally:
            self.store.release(handle)


class Turn:
    def __init__(self, gate: Gate, *, session, model, argv, wait, labels=None, askers=None,
                 priority=None, command_pid=None, fallback=None):
        self.gate = gate
        # What a deflection leads to, when known before it: "busy" (nothing runs) or None (the
        # caller says at settle()); the deflected event carries it, so history tells them apart.
        self._outcome = None if fallback is None or fallback else "busy"
        self._deflected_ts: float | None = None
        self.session = session or gate.settings.get("session") or default_session()
        self.priority = class_named(priority or gate.priority)
        if self.priority is None:
            raise ValueError(f"priority must be one of {', '.join(CLASSES)}, not {priority!r}")
        self.rank = CLASSES.index(self.priority)
        self.model = model
        self.argv = list(argv or [])
        self.labels = dict(labels or {})
        self._argv_cache: dict | None = None
        self.command_pid = command_pid
        self._command: tuple[int, int] | None = None   # (pid, start ticks), read before the lock
        self._settled = False   # its outcome was counted (metrics)
        self._owner = None    # who may nest in this turn: the thread, or an asyncio task
        self._cancel = None   # threading.Event: an asyncio turn's wait was cancelled
        self._askers = askers   # who asks, when not this process (handover.py)
        self._pending: tuple | None = None   # what _take() decided and _record_decision() records
        self.token: str | None = None   # names this held turn (or the one it nests in)
        self._started_wait = 0.0
        self._crowded_since: float | None = None   # first refusal of a crowded server (its wait)
        self.wait = wait
        self.state: str | None = None
        self.reason: str | None = None
        self.holder: dict | None = None
        self.nested = False
        self.lost = False      # the store took the lane away mid-turn (PostgreSQL session ended)
        self.ungated = 0.0     # seconds this held turn's lane was lost before it took it back
        self.fence: int | None = None   # the store's generation of this turn (store.write_holder)
        self._lost_at: float | None = None   # time.time() the lane was lost, while not back
        self._lost_for_good = False   # the store ended the session itself: never taken back
        self._took_over: dict | None = None   # the turn before, which never released (_taken_from)
        self.waited = 0.0
        # True once the turn blocked in the store's wait: 'waited' is that fact, not a duration
        # (a hand-off can take less than a millisecond, and it was still a wait).
        self._blocked = False
        self._handle = None
        self._ungated_place = None   # a fail-open turn's handle the store keeps (keeps_place)
        self._key: tuple | None = None
        self._started = 0.0
        self._acquired_at = ""
        self._stopped_at: str | None = None
        self._unjournaled: tuple = ()   # a held turn's events the journal had no room for
        self.crowded: str | None = None   # why a crowded gate could not be taken (deflected)

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

    @property
    def env(self) -> dict[str, str]:
        """The environment that hands this turn to a subprocess:
        `subprocess.run(cmd, env={**os.environ, **turn.env})`. Only a process started with it
        (and its descendants) is part of the turn (handover.py); it also tells the process its
        lane and state (LANELOCK_STATE, LANELOCK_LANE, ...). Empty before the turn is taken."""
        if self.state is None:
            return {}
        env = {"LANELOCK_STATE": self.state, "LANELOCK_LANE": self.lane,
               "LANELOCK_LOCK_PATH": self.lock_path, "LANELOCK_SESSION": self.session}
        if self.model:
            env["LANELOCK_MODEL"] = self.model
        if self.state == DEFLECTED:
            env["LANELOCK_FAILOVER_REASON"] = self.reason or REASON_BUSY
        inherited = os.environ.get(handover.VARIABLE)
        if self.state == HELD and self.token is not None:
            env[handover.VARIABLE] = handover.with_token(inherited, self.token)
            env["LANELOCK_HELD"] = self.lock_path   # which lock, for the command's own use
            if self.fence is not None:   # for a tool that refuses a stale holder's requests
                env["LANELOCK_FENCE"] = str(self.fence)
        elif inherited:
            env[handover.VARIABLE] = inherited
        return env

    @property
    def headers(self) -> dict[str, str]:
        """The HTTP headers that hand this turn to a request sent through `lanelock proxy`:
        `OpenAI(default_headers=turn.headers)`, or `extra_headers=turn.headers` per request. The
        proxy lets such a request through as part of the turn when it comes from this process or
        a descendant (handover.py); without them, this process's requests find the lane busy --
        at once, never waiting for their own turn. Empty unless the turn holds the lane."""
        turns = self.env.get(handover.VARIABLE) if self.state == HELD else None
        return {handover.HEADER: turns} if turns else {}

    def __enter__(self) -> "Turn":
        return self.acquire()

    def __exit__(self, kind, value, traceback) -> None:
        self.release(None if kind else 0)
        self.settle()

    async def __aenter__(self) -> "Turn":
        from .asyncturn import acquire

        return await acquire(self)

    async def __aexit__(self, kind, value, traceback) -> None:
        from .asyncturn import release, settle

        await release(self, None if kind else 0)
        await settle(self)

    # -- acquiring -------------------------------------------------------------------------------
    # A turn is taken in two steps: _take() gets the lock (or learns the lane is busy) and
    # records nothing; _record_decision() writes the holder record and the journal. An asyncio
    # turn takes in a thread and records only once its task resumes, so a wait cancelled as the
    # lane frees leaves no trace (issue 23: cancelled waiters were journaled as turns whose block
    # never ran). The steps are the asyncio driver's (asyncturn.py), not public API: a caller
    # uses `with`/`async with`, or acquire() and release().
    def acquire(self) -> "Turn":
        return self._take()._record_decision()

    def _take(self, try_only: bool = False) -> "Turn":
        """Take the lane, or learn what the turn will be. try_only: raise WouldBlock instead of
        waiting (an asyncio turn's first try, on the event loop)."""
        gate = self.gate
        if gate.config_error:
            return self._fail_open(gate.config_error, None)
        if not gate.gated:
            self.state = UNGATED
            return self
        tries = 0
        while True:
            try:
                self._take_gated(try_only)
                return self
            except ServerCrowded as error:
                pause = self._crowded_pause(tries, try_only)
                if pause is None:
                    return self.cannot_take(error)
            except GateUnavailable as error:
                return self.cannot_take(error)
            tries += 1
            time.sleep(pause)

    def _crowded_pause(self, tries: int, try_only: bool) -> float | None:
        """How long to pause before asking a crowded server again, or None: the turn's wait
        does not reach past the pause (or it has none), so it deflects (gate_crowded) now."""
        now = time.monotonic()
        if self._crowded_since is None:
            self._crowded_since = now
        if self._handle is not None:   # refused after it opened: nothing of it is kept
            self.gate.store.release(self._handle)
            self._handle = None
        pause = backoff(tries)   # a crowded server's connections free as other turns end
        if try_only or self.wait is not None and self._crowded_since + self.wait - now <= pause:
            return None
        return pause

    def _record_decision(self) -> "Turn":
        """Record what _take() decided: the holder record and 'acquired', or 'deflected'."""
        pending, self._pending = self._pending, None
        if pending is None:
            return self
        state, detail = pending
        if state == HELD:
            return self._held(self._handle, detail)
        return self._deflect(self._handle, detail)

    def _give_back(self) -> None:
        """An asyncio turn cancelled before its decision was recorded: let go of whatever it
        took (a lock its wait got as it was cancelled, a decision not yet recorded), record
        nothing."""
        if self.state is not None and self._pending is None:
            return   # decided and recorded, or nothing taken (ungated, nested, fail-open)
        self._pending = None
        if self._handle is not None:
            self.gate.store.release(self._handle)
            self._handle = None
        self.state = CANCELLED

    def _own_by(self, owner) -> None:
        """Who may nest in this turn (an asyncio task's token instead of the thread); a fresh
        cancellation event for its wait."""
        import threading

        self._owner, self._cancel = owner, threading.Event()

    def _cancel_wait(self) -> None:
        """Make a wait blocked in another thread give up (the asyncio turn's cancellation)."""
        if self._cancel is not None:
            self._cancel.set()
        handle = self._handle
        if handle is not None:
            self.gate.store.cancel_wait(handle)

    def _take_gated(self, try_only: bool) -> None:
        waiting = self._try_first(try_only)
        if waiting is not None:
            handle, timeout = waiting
            self._decide(handle, self.gate.store.wait_lock(handle, timeout, self._cancel,
                                                            rank=self.rank))

    # _try_first() and _decide() are _take()'s steps before and after the wait, for a caller that
    # waits its own way (asyncturn.py: an asyncio task waits without a thread).
    def _try_first(self, try_only: bool = False):
        """Open the lane's lock and try it: None when the turn is decided (nested, or the lock
        taken: _record_decision() records it), else (handle, timeout) to wait on."""
        gate, store = self.gate, self.gate.store
        # Facts the holder record needs, read (once per process) before the lock: after it, they
        # would delay the hand-off.
        own_start_ticks(), boot_id(), user_name(), hostname()
        if self.command_pid is not None and self._command is None:
            self._command = holder_facts.command_facts(self.command_pid)
        self._handle = None
        handle = self._handle = store.open(gate.lane)
        handle.asker = {"session": self.session, "hostname": hostname()}
        if handle.caveat:
            gate.warn(handle.caveat)
        if self._owner is None:
            self._owner = _thread.get_ident()
        outer = _HELD_HERE.get(handle.ident)
        if outer is not None and outer[0] == self._owner:
            self._nested(handle, outer[1])
            return None
        # A turn a crowded server kept out has waited since its first refusal: that counts.
        self._started_wait = self._crowded_since or time.monotonic()
        _debug_pause("before-acquire")
        if store.try_lock(handle, rank=self.rank):
            self._decide(handle, True)
            return None
        if try_only:
            store.release(handle)
            self._handle = None
            raise WouldBlock
        handed = self._handed_over(handle)
        if handed == handover.NESTED:
            self._nested(handle)
            return None
        if handed == handover.ITSELF:   # the holder's own request (the proxy's client)
            self._outcome = "busy"   # told so, nothing runs
            self._decide(handle, False)   # deflects at once: waiting would wait for itself
            return None
        self._blocked = True
        if self.wait is None:
            return handle, None
        left = self.wait if self._crowded_since is None else \
            self.wait - (time.monotonic() - self._crowded_since)
        return handle, max(left, gate.grace)

    def _decide(self, handle, got: bool) -> None:
        """After the lock was tried or waited for: decide what _record_decision() records."""
        self.waited = time.monotonic() - self._started_wait
        if not got and self._cancel is not None and self._cancel.is_set():
            self.gate.store.release(handle)   # abandoned, not deflected: nothing to record
            self._handle, self.state = None, CANCELLED
        elif not got:
            self._pending = (DEFLECTED, describe_holder(self.gate, handle))
        else:
            self._pending = (HELD, handle.ident)

    def _handed_over(self, handle) -> str | None:
        """Is the process asking part of the holding turn, or the holder itself (handover.py's
        verdict)? Only a busy lane asks, so a free lane never pays for the lookup."""
        askers = self._askers() if self._askers is not None else [handover.this_process()]
        if not askers or None in askers:
            return None
        try:
            facts = self.gate.store.survey(self.gate.lane, handle)[0]
        except GateUnavailable:
            return None
        return handover.verdict(facts.record, askers, holder_facts.live_pids_here(facts))

    def _nested(self, handle, outer: "Turn | None" = None) -> None:
        """Part of a turn this thread already holds, or one handed over to this process: run
        through. outer: the same thread's turn (its token goes on in env)."""
        self.gate.store.release(handle)
        self._handle = None
        self.state, self.nested = HELD, True
        if outer is not None:
            self.token, self.fence = outer.token, outer.fence

    def _held(self, handle, ident) -> "Turn":
        self.state, self._key = HELD, ident
        self.token = handover.new_token()
        _HELD_HERE[ident] = (self._owner, self)
        self._started = time.monotonic()
        now = time.time()
        self._acquired_at = utc_now(now)
        _debug_pause("after-acquire")
        self._took_over = _taken_from(getattr(handle, "unreleased", None), self.token)
        # The record is written before the caller runs anything: whoever sees the command
        # running must also find who runs it.
        self._write_record(self._record())
        self.fence = getattr(handle, "fence", None)
        # Who holds, precisely enough for `history` to tell a live turn from a killed one.
        events = [self._event("acquired", at=(now, self._acquired_at),
                              start_ticks=own_start_ticks(), boot_id=boot_id(),
                              hostname=hostname(), priority=self.priority,
                              **({"fence": self.fence} if self.fence is not None else {}),
                              **holder_facts.command_fields(self._command))]
        if self._had_to_wait:
            events.insert(0, self._event("waited", at=(now, self._acquired_at),
                                         waited=round(self.waited, 6), priority=self.priority))
        if self._took_over is not None:   # it may still run: history says the overlap
            events.append(self._event("took-over", at=(now, self._acquired_at),
                                      fence=self.fence, **{"from": self._took_over}))
        self._log(*events)
        return self

    def _deflect(self, handle, holder: dict | None = None) -> "Turn":
        self.state, self.reason = DEFLECTED, REASON_BUSY
        self.holder = holder or describe_holder(self.gate, handle)
        # What history needs to tell a turn that timed out waiting from one that never waited
        # (wait: the seconds it asked for, None for ever), and busy (nothing ran) from deflected.
        extra = {"priority": self.priority}
        if self._had_to_wait:
            extra.update(wait=self.wait, waited=round(self.waited, 6))
        if self._outcome is not None:
            extra["outcome"] = self._outcome
        event = self._event("deflected", reason=REASON_BUSY, holder=self.holder, **extra)
        self._deflected_ts = event["ts"]
        self._log(event)
        self.gate.store.release(handle)
        self._handle = None
        return self

    def fail_open(self, why: str) -> "Turn":
        """The gate cannot be taken: the turn goes ahead ungated, with one warning."""
        return self._fail_open(why, self._handle)

    def cannot_take(self, error: GateUnavailable) -> "Turn":
        """The store could not take the gate: a crowded one (GateCrowded: out of descriptors,
        memory or locks) deflects, a broken one fails open."""
        if isinstance(error, GateCrowded):   # GateUntrusted too: attacked is not broken
            return self._crowded(str(error), error.reason)
        return self._fail_open(str(error), self._handle)

    def _crowded(self, why: str, reason: str = GateCrowded.reason) -> "Turn":
        """Crowded is not broken: the gate is there, this process only cannot open or read it
        now, so it cannot tell whether another turn holds the lane (with no descriptor, nothing
        can be asked of the kernel). Running beside a holder is what the gate exists to prevent,
        so the turn deflects (reason gate_crowded) -- at once: the descriptors it lacks are its
        own, and waiting would not bring them back. Nothing is journaled or counted (that needs
        the descriptors it lacks); the caller says the one line."""
        if self._handle is not None:
            self.gate.store.release(self._handle)
            self._handle = None
        self._pending = None
        self.state, self.reason, self.holder = DEFLECTED, reason, None
        self.crowded = why
        self._settled = True
        return self

    def _fail_open(self, why: str, handle) -> "Turn":
        self.state, self.reason = FAIL_OPEN, why
        self.gate.warn(f"gate unavailable ({why}); running without it")
        if handle is None and not self.gate.config_error:
            handle = self.gate.store.event_handle(self.gate.lane)
        if handle is not None:
            try:
                self.gate.store.append_event(handle, self._event("fail-open", reason=why))
            except RecordNotWritten:   # the one warning above is all a failing gate may say
                pass
            if self.gate.store.keeps_place(handle):
                self._ungated_place = handle   # let go when the turn ends (release())
            else:
                self.gate.store.release(handle, {"outcome": "fail_open"})
            self._settled = True
        self._handle = None
        return self

    # -- releasing -------------------------------------------------------------------------------
    def release(self, exit_status: int | None = None, *, ended: str | None = None) -> None:
        """Let the lane go (idempotent). exit_status is recorded in the holder record and the
        journal; ended, beside it, how a turn that did not finish its work ended, in words (the
        proxy's 'the client hung up mid-answer'), so no view calls it a clean release."""
        if self.state == FAIL_OPEN and self._ungated_place is not None:
            place, self._ungated_place = self._ungated_place, None
            self.gate.store.release(place, {"outcome": "fail_open"})
        if self.state != HELD:
            return
        if self.nested:
            self.state = RELEASED
            return
        handle = self._handle
        duration = round(time.monotonic() - self._started, 6)
        if not self.lost:   # a lost lane already belongs to someone else: leave its record alone
            # Update the record while still holding the lock: after unlock it is the next turn's.
            now = time.time()
            ending = {"ended": ended} if ended else {}
            fields = {"released_at": utc_now(now), "exit_status": exit_status,
                      "held_seconds": duration, **ending}
            try:
                self.gate.store.write_release(self._handle, self._record, fields)
            except RecordNotWritten as error:
                self.gate.warn(f"the holder record's release was not written: {error}")
            self._log(self._event("released", at=(now, fields["released_at"]),
                                  duration=duration, exit_status=exit_status, **ending))
        else:   # it ran ungated from the loss to now: said on its side too (the taker's)
            self._journal_lost(duration, exit_status, ended)
        _debug_pause("during-release")
        _HELD_HERE.pop(self._key, None)
        waited = self.waited if self._had_to_wait else None
        count = None if self.lost else {"outcome": "waited" if waited is not None else "local",
                                        "held": duration, "waited": waited,
                                        "priority": self.priority,
                                        **({"ungated": round(self.ungated, 3)}
                                           if self.ungated else {})}
        self._settled = True
        self.gate.store.release(handle, count)
        self._handle = None
        self.state = RELEASED

    def _journal_lost(self, duration: float, exit_status: int | None, ended: str | None) -> None:
        """A turn whose lane was lost and not taken back ran ungated from the loss to its end:
        its 'lost' event (those seconds, its fence) and the ungated count, through a connection
        of its own (its session is gone). A server that does not answer now is asked again for
        LOST_JOURNAL_WITHIN at most (plus one connect timeout): the exit is never held longer,
        and a line says what was not written."""
        now = time.time()
        lost_at = self._lost_at if self._lost_at is not None else now
        ungated = round(max(0.0, now - lost_at), 3)
        event = self._event("lost", at=(now, utc_now(now)), lost_at=utc_now(lost_at),
                            lost_ts=round(lost_at, 6), ungated=ungated, duration=duration,
                            exit_status=exit_status, fence=self.fence,
                            how="ended" if self._lost_for_good else "not-taken-back",
                            **({"ended": ended} if ended else {}))
        store = self.gate.store
        deadline, tries = time.monotonic() + LOST_JOURNAL_WITHIN, 0
        while True:
            handle = store.event_handle(self.gate.lane, again=tries > 0)
            if handle is not None:
                try:
                    store.append_event(handle, event)
                except RecordNotWritten as error:
                    store.release(handle)
                    self.gate.warn(f"the lost lane's {ungated:.1f} s ungated were not "
                                   f"journaled: {error}")
                    return
                # a restart it came back from before counts too: no count of its release has it
                store.release(handle, {"outcome": None,
                                       "ungated": round(ungated + self.ungated, 3)})
                return
            pause = backoff(tries)
            if time.monotonic() + pause >= deadline:
                self.gate.warn(f"the lost lane's {ungated:.1f} s ungated were not journaled: "
                               "the lane store does not answer")
                return
            tries += 1
            time.sleep(pause)

    @property
    def _had_to_wait(self) -> bool:
        """The turn asked to wait and blocked: the journal's 'waited' event and the 'waited'
        outcome of the counts (a wait=0 turn's grace is not a wait)."""
        return self._blocked and self.wait != 0

    def command_started(self, pid: int | None) -> None:
        """The command runs as pid: if it is not the process the record names (the parked child
        was killed and forked again), the record names it now -- the next turn waits for it
        should this one be killed (store/outlived.py)."""
        if self.state != HELD or self.nested or self._handle is None or pid is None \
                or (self._command is not None and self._command[0] == pid):
            return
        command = holder_facts.command_facts(pid)
        if command is not None:
            self.command_pid, self._command = pid, command
            self._write_record(self._record())

    def regain(self, lost_at: float) -> bool | None:
        """A held turn whose store ended its session (self.lost, since time.time() lost_at):
        take the lane back if the server restarted under it (store.retake). True: held again --
        the row renewed, the ungated interval journaled ('regained', ungated seconds) and kept
        in the record; False: the store ended the session itself, the lane stays lost; None:
        not yet (ask again)."""
        if self.state != HELD or self.nested or self._handle is None:
            return False
        if self._lost_at is None:
            self._lost_at = lost_at
        try:
            got = self.gate.store.retake(self._handle)
        except GateUnavailable:
            got = None
        if got is False:
            self._lost_for_good = True
        if not got:
            return got
        now = time.time()
        self.lost, self._lost_at = False, None
        self.ungated += now - lost_at
        self._write_record(self._record())
        self._log(self._event("regained", at=(now, utc_now(now)), lost_at=utc_now(lost_at),
                              ungated=round(now - lost_at, 3)))
        return True

    def mark_stopped(self, stopped: bool) -> None:
        """The command was stopped (^Z, SIGSTOP) or continued: the holder record says since when,
        so `status` and deflection lines can tell a paused holder from a busy one."""
        if self.state != HELD or self.nested or self.lost or self._handle is None:
            return
        if stopped == (self._stopped_at is not None):
            return
        self._stopped_at = utc_now() if stopped else None
        self._write_record(self._record())

    def abandon(self, reason: str) -> None:
        """Journal a wait given up before the lane came (the proxy's client hung up: reason
        client_gone) as its own 'abandoned' event -- how long it waited, what it asked for -- so
        history shows the request. It is not a turn: nothing ran, and nothing is counted. Only a
        cancelled turn that was waiting has one; a store with no handle for it records nothing."""
        if self.state != CANCELLED or not self._blocked:
            return
        self.waited = time.monotonic() - self._started_wait
        self._journal_aside(self._event("abandoned", reason=reason, wait=self.wait,
                                        waited=round(self.waited, 6), priority=self.priority))

    @property
    def unsettled(self) -> bool:
        """A deflected turn whose outcome is not counted yet (settle() has store work to do)."""
        return not self._settled and self.state == DEFLECTED

    def settle(self, outcome: str | None = None) -> None:
        """Count a deflected turn's outcome once, for the metrics: 'deflected' when a fallback
        ran (the default for API turns), 'busy' when nothing did. Held turns count themselves on
        release, fail-open ones when they fail open."""
        if self._settled or self.state != DEFLECTED:
            return
        self._settled = True
        outcome = outcome or self._outcome or "deflected"
        waited = self.waited if self.wait != 0 else None
        self.gate.store.count(self.gate.lane, outcome, reason=self.reason,
                              waited=waited, priority=self.priority)
        if outcome != (self._outcome or "deflected"):
            self._journal_outcome(outcome)

    def _journal_outcome(self, outcome: str) -> None:
        """The deflected event said a fallback would run and none did (every one failed): say
        so after it ('settled', naming the deflection's ts), for history to count it busy."""
        self._journal_aside(self._event("settled", outcome=outcome, of=self._deflected_ts))

    def _journal_aside(self, event: dict) -> None:
        """An event of a turn that holds no handle any more (settled, abandoned), through the
        store's event handle; a store with none records nothing, and a line not written is
        only lost (history reads what was)."""
        handle = self.gate.store.event_handle(self.gate.lane)
        if handle is None:
            return
        try:
            self.gate.store.append_event(handle, event)
        except RecordNotWritten:
            pass
        finally:
            self.gate.store.release(handle)

    # -- records ---------------------------------------------------------------------------------
    def _record(self) -> dict:
        if self._argv_cache is None:
            self._argv_cache = holder_facts.argv_fields(self.argv)
        record = holder_facts.record(
            lane=self.gate.lane, session=self.session, model=self.model, argv=self._argv_cache,
            acquired_at=self._acquired_at, acquired_monotonic=self._started, turn=self.token,
            stopped_at=self._stopped_at, labels=self.labels, command=self._command)
        if self.ungated:   # the lane was lost (a store restart) and taken back: for how long
            record["ungated_seconds"] = round(self.ungated, 3)
        if self._took_over is not None:   # from a turn that never let go: it may run on
            record["took_over"] = self._took_over
        return record

    def _event(self, event: str, at: tuple[float, str] | None = None, **extra) -> dict:
        # "monotonic" is one system-wide clock: durations between turns survive wall-clock jumps.
        # at: (time.time(), its utc_now() text) when the caller has both already.
        now, text = at if at is not None else (time.time(), None)
        return {"event": event, "time": text or utc_now(now), "ts": round(now, 6),
                "monotonic": round(time.monotonic(), 6),
                "lane": self.gate.lane.name, "pid": os.getpid(), "session": self.session,
                "model": self.model, **({"turn": self.token} if self.token else {}),
                **self.labels, **extra}

    def _write_record(self, record: dict) -> None:
        try:
            self.gate.store.write_holder(self._handle, record)
        except RecordNotWritten as error:
            self.gate.warn(f"lane held, but the holder record was not written: {error}")

    def _log(self, *events: dict) -> None:
        """Events as one append (one write() on a flock store's journal). A held turn's events
        that could not be written (a full disk) go with its next ones: a release carries the
        acquired event the disk had no room for, and history still has the whole turn."""
        events = (*self._unjournaled, *events)
        self._unjournaled = ()
        try:
            self.gate.store.append_event(self._handle, *events)
        except RecordNotWritten as error:
            if self.state == HELD or events[-1]["event"] == "released":
                self.gate.warn(f"journal not written: {error}")
            if self.state == HELD and events[-1]["event"] != "released":
                self._unjournaled = events


def _debug_pause(step: str) -> None:
    """Fault-test hook: LANELOCK_DEBUG_PAUSE=STEP stops this process (SIGSTOP) at STEP, so a test
    can SIGKILL it exactly there. Steps: before-acquire, after-acquire, during-release."""
    if os.environ.get("LANELOCK_DEBUG_PAUSE") == step:
        import signal

        os.kill(os.getpid(), signal.SIGSTOP)


def _taken_from(record, token: str | None) -> dict | None:
    """Who held the lane before this turn and never released it (its session ended: lost, or
    killed), from its row: enough for history to find its 'lost' event (turn) and for a
    resource to tell its requests from this turn's (fence)."""
    if not isinstance(record, dict) or record.get("turn") in (None, token):
        return None
    return {name: record[name] for name in ("turn", "fence", "pid", "hostname", "session",
                                            "acquired_at") if record.get(name) is not None}


def describe_holder(gate: Gate, handle) -> dict:
    """Who holds the lane (a deflection's line, probe): the one judge's holder of the store's
    facts, read through the handle where the store can."""
    try:
        from .inspection.judge import holder

        facts = gate.store.survey(gate.lane, handle)[0]
    except GateUnavailable as error:
        return holder_facts.unlabelled(None, None, f"the store could not say: {error}")
    except OSError as error:   # out of descriptors (an import opens a file too): the kernel said
        # busy, only who holds it cannot be read now
        return holder_facts.unlabelled(None, None, f"who, cannot be read now: {error.strerror}")
    return holder(facts)
