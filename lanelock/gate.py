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

import os
import time

from . import handover, say
from .errors import GateUnavailable
from .facts import default_session, utc_now
from .holder import command_facts
from .place import Place, check_arguments
from .priority import CLASSES, class_named
from .settings import Settings
from .turn import nesting, stops
from .turn.acquisition import Acquisition, describe_holder
# The states and LOST_JOURNAL_WITHIN are the turn's; named here too (`from lanelock.gate import`).
from .turn.record import LOST_JOURNAL_WITHIN, TurnRecord  # noqa: F401
from .turn.states import (CANCELLED, DEFLECTED, FAIL_OPEN, HELD, REASON_BUSY,  # noqa: F401
                          RELEASED, UNGATED)

__all__ = ["Gate", "Turn", "describe_holder", "HELD", "DEFLECTED", "UNGATED", "FAIL_OPEN",
           "RELEASED", "REASON_BUSY", "BUSY_WORDS", "busy_sentence"]

BUSY_WORDS = "local model in use by another session"


def busy_sentence(who: str, then: str | None = None) -> str:
    """The one line every deflection prints (run and proxy alike), and its reason's words:
    'local_backend_busy: local model in use by another session (WHO); THEN'."""
    return f"{REASON_BUSY}: {BUSY_WORDS} ({who})" + (f"; {then}" if then else "")


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
                 settings: Settings | None = None, lane_store=None, priority: str | None = None,
                 no_model_said: bool = False):
        check_arguments({"priority": priority})
        super().__init__(backend, model=model, key_by=key_by, lock_dir=lock_dir, gate=gate,
                         grace=grace, store=store, warn=warn, settings=settings,
                         lane_store=lane_store, no_model_said=no_model_said)
        self.grace = float(self.settings.get("grace"))
        self.priority = class_named(priority) or self.settings.get("priority")
        self.journal_max_bytes = self.settings.get("journal_max_bytes")

    def sibling(self, backend: str, model: str | None = None,
                no_model_said: bool = False) -> "Gate":
        """The gate of another backend's lane (a fallback engine), read with this gate's settings:
        the same files, lock root and store, so both lanes live side by side. BackendError or
        UsageProblem for a malformed backend."""
        flags = self.settings.flags
        return Gate(settings=self.settings.derive(
            backend=backend, model=model, lock_dir=flags.get("lock_dir"), store=flags.get("store"),
            key_by=flags.get("key_by")),
            warn=self.warn, lane_store=self._own_store, priority=self.priority,
            no_model_said=no_model_said)

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

        problem = gate_problem(self.store, self.lane)   # what a turn would meet here
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
    """One turn on a gate's lane: its state and what it hands on (env, headers). Its parts live
    apart: the acquisition's steps (turn/acquisition.py, self.acquisition), its record and
    journal (turn/record.py, self.record), same-process nesting (turn/nesting.py)."""

    def __init__(self, gate: Gate, *, session, model, argv, wait, labels=None, askers=None,
                 priority=None, command_pid=None, fallback=None):
        self.gate = gate
        self.session = session or gate.settings.get("session") or default_session()
        self.priority = class_named(priority or gate.priority)
        if self.priority is None:
            raise ValueError(f"priority must be one of {', '.join(CLASSES)}, not {priority!r}")
        self.rank = CLASSES.index(self.priority)
        self.model = model
        self.argv = list(argv or [])
        self.labels = dict(labels or {})
        self.command_pid = command_pid
        self.wait = wait
        self.state: str | None = None
        self.reason: str | None = None
        self.holder: dict | None = None
        self.nested = False
        self.waited = 0.0
        self.crowded: str | None = None   # why a crowded gate could not be taken (deflected)
        self.handle = None   # the store's handle on the lane while the turn holds it
        self._ungated_place = None   # a fail-open turn's handle the store keeps (keeps_place)
        self.record = TurnRecord(gate, session=self.session, model=model, argv=self.argv,
                                 labels=self.labels, priority=self.priority, fallback=fallback)
        self.acquisition = Acquisition(self, askers)

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
    def token(self) -> str | None:
        """Names this held turn (or the one it nests in): what it hands over (handover.py)."""
        return self.record.token

    @property
    def fence(self) -> int | None:
        """The store's generation of this turn (LANELOCK_FENCE), where the store has one."""
        return self.record.fence

    @property
    def seat(self) -> int | None:
        """The lane's seat this held turn holds (1..the lane's seat count; LANELOCK_SEAT), or
        None when it holds none (deflected, ungated, nested in another turn)."""
        return self.record.seat if self.state == HELD and not self.nested else None

    @property
    def ungated(self) -> float:
        """Seconds this held turn's lane was lost before it took it back."""
        return self.record.ungated

    @property
    def lost(self) -> bool:
        """The store took the lane away mid-turn (a PostgreSQL session ended) and it is not back."""
        return self.record.lost

    @lost.setter
    def lost(self, value: bool) -> None:
        self.record.lost = value

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
            if self.record.seat is not None:   # which seat: the engine's slot, when pinned
                env["LANELOCK_SEAT"] = str(self.record.seat)
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

    def acquire(self) -> "Turn":
        """Take the lane in this thread, waiting as the turn asked, and record what it became
        (turn/acquisition.py has the steps, for a driver that waits its own way)."""
        self.acquisition.take()
        return self.acquisition.record()

    def fail_open(self, why: str) -> "Turn":
        """The gate cannot be taken: the turn goes ahead ungated, with one warning."""
        handle = self.handle
        self.state, self.reason = FAIL_OPEN, why
        self.gate.warn(f"gate unavailable ({why}); running without it")
        if handle is None and not self.gate.config_error:
            handle = self.gate.store.fail_open_handle(self.gate.lane)
        if handle is not None:
            self.record.failed_open(why, handle)
            if self.gate.store.keeps_place(handle):
                self._ungated_place = handle   # let go when the turn ends (release())
            else:
                self.gate.store.release(handle, {"outcome": "fail_open"})
        self.handle = None
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
        if self.acquisition.unwritten is not None:   # held (hold()) and not yet recorded
            self.acquisition.record()
        handle = self.handle
        duration = round(time.monotonic() - self.record.started, 6)
        if not self.lost:   # a lost lane already belongs to someone else: leave its record alone
            self.record.released(handle, exit_status, ended, duration)
        else:   # it ran ungated from the loss to now: said on its side too (the taker's)
            self.record.journal_lost(duration, exit_status, ended)
        stops.reached(stops.DURING_RELEASE)
        nesting.let_go(handle.ident)
        waited = self.waited if self.acquisition.had_to_wait else None
        count = None if self.lost else {"outcome": "waited" if waited is not None else "local",
                                        "held": duration, "waited": waited,
                                        "priority": self.priority,
                                        **({"ungated": round(self.ungated, 3)}
                                           if self.ungated else {})}
        self.record.settled = True
        self.gate.store.release(handle, count)
        self.handle = None
        self.state = RELEASED

    # -- while held ------------------------------------------------------------------------------
    def command_started(self, pid: int | None) -> None:
        """The command runs as pid: if it is not the process the record names (the parked child
        was killed and forked again), the record names it now -- the next turn waits for it
        should this one be killed (store/outlived.py)."""
        command = self.record.command
        if self.state != HELD or self.nested or self.handle is None or pid is None \
                or (command is not None and command[0] == pid):
            return
        command = command_facts(pid)
        if command is not None:
            self.command_pid, self.record.command = pid, command
            self.record.write(self.handle)

    def regain(self, lost_at: float) -> bool | None:
        """A held turn whose store ended its session (self.lost, since time.time() lost_at):
        take the lane back if the server restarted under it (store.retake). True: held again --
        the row renewed, the ungated interval journaled ('regained', ungated seconds) and kept
        in the record; False: the store ended the session itself, the lane stays lost; None:
        not yet (ask again)."""
        if self.state != HELD or self.nested or self.handle is None:
            return False
        record = self.record
        if record.lost_at is None:
            record.lost_at = lost_at
        try:
            got = self.gate.store.retake(self.handle)
        except GateUnavailable:
            got = None
        if got is False:
            record.lost_for_good = True
        if not got:
            return got
        now = record.regained(lost_at)
        record.write(self.handle)
        record.log(self.handle, True, record.event(
            "regained", at=(now, utc_now(now)), lost_at=utc_now(lost_at),
            ungated=round(now - lost_at, 3)))
        return True

    def mark_stopped(self, stopped: bool) -> None:
        """The command was stopped (^Z, SIGSTOP) or continued: the holder record says since when,
        so `status` and deflection lines can tell a paused holder from a busy one."""
        if self.state != HELD or self.nested or self.lost or self.handle is None:
            return
        if stopped == (self.record.stopped_at is not None):
            return
        self.record.stopped_at = utc_now() if stopped else None
        self.record.write(self.handle)

    # -- after --------------------------------------------------------------------------------
    def abandon(self, reason: str) -> None:
        """Journal a wait given up before the lane came (the proxy's client hung up: reason
        client_gone) as its own 'abandoned' event -- how long it waited, what it asked for -- so
        history shows the request. It is not a turn: nothing ran, and nothing is counted. Only a
        cancelled turn that was waiting has one; a store with no handle for it records nothing."""
        if self.state != CANCELLED or not self.acquisition.blocked:
            return
        self.waited = time.monotonic() - self.acquisition.started_wait
        self.record.aside(self.record.event("abandoned", reason=reason, wait=self.wait,
                                            waited=round(self.waited, 6),
                                            priority=self.priority))

    @property
    def unsettled(self) -> bool:
        """A deflected turn whose outcome is not counted yet (settle() has store work to do)."""
        return not self.record.settled and self.state == DEFLECTED

    def settle(self, outcome: str | None = None) -> None:
        """Count a deflected turn's outcome once, for the metrics: 'deflected' when a fallback
        ran (the default for API turns), 'busy' when nothing did. Held turns count themselves on
        release, fail-open ones when they fail open."""
        record = self.record
        if record.settled or self.state != DEFLECTED:
            return
        record.settled = True
        outcome = outcome or record.outcome or "deflected"
        waited = self.waited if self.wait != 0 else None
        self.gate.store.count(self.gate.lane, outcome, reason=self.reason,
                              waited=waited, priority=self.priority)
        if outcome != (record.outcome or "deflected"):
            # The deflected event said a fallback would run and none did (every one failed):
            # say so after it ('settled', naming the deflection's ts), for history to count it
            # busy.
            record.aside(record.event("settled", outcome=outcome, of=record.deflected_ts))
