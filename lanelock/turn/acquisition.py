"""Taking a turn: one sequence of steps, followed by both drivers.

    try_first()  open the lane's lock and try it; None: decided (taken, nested, handed over, the
                 holder itself asking), else a Wait -- the handle and how long to wait on it
    (the wait)   the driver's own: store.wait_lock() in a thread (take(), Turn.acquire), or
                 store.wait_lock_async() on an event loop (asyncturn.py)
    decide()     after the wait: held, deflected, or abandoned (stop_waiting() was called)
    record()     write what was decided -- the holder record and 'acquired', or 'deflected'

A held decision may also be recorded in two steps: hold() (the turn holds the lane from then on:
its state, token, clocks and seat), then record() (its holder record and journal). The proxy
forwards a request on a free lane of one seat in between, and names the turn's session meanwhile.

take() is try_first, the wait and decide in one thread, with a crowded server asked again within
the turn's wait; Turn.acquire() is take() then record(). Deciding records nothing, so a driver
may let a decision go unrecorded: an asyncio turn takes in one place and records only once its
task resumes, and a task cancelled as the lane frees gives back (give_back()) a lock nobody will
use, leaving no trace. begin() and stop_waiting() are for a driver whose turn is owned by
something other than the thread taking it (an asyncio task) and whose wait may be cancelled.

Invariant: decision is set exactly between a decide() that took or deflected and its record()
or give_back(); while it is set the turn's handle is open and its state is not yet written.
"""

from __future__ import annotations

import threading
import time

from .. import handover
from ..duration import backoff
from ..errors import GateCrowded, GateUnavailable, ServerCrowded, WouldBlock
from ..facts import boot_id, hostname, own_start_ticks, user_name
from ..holder import command_facts, live_pids_here, unlabelled
from . import nesting, stops
from .states import CANCELLED, DEFLECTED, HELD, REASON_BUSY, UNGATED


class Wait:
    """What try_first() leaves to the wait: the lane's handle, and the seconds to wait on it
    (None: for ever)."""

    __slots__ = ("handle", "timeout")

    def __init__(self, handle, timeout: float | None):
        self.handle, self.timeout = handle, timeout


class Decision:
    """What decide() found, for record() to write: HELD with the lane's ident, or DEFLECTED with
    who holds the lane."""

    __slots__ = ("state", "ident", "holder")

    def __init__(self, state: str, ident: tuple | None = None, holder: dict | None = None):
        self.state, self.ident, self.holder = state, ident, holder


class Acquisition:
    """The steps that take one turn (see the module's doc), and what they keep between them:
    the decision, who owns the turn, and how long it has waited."""

    def __init__(self, turn, askers=None):
        self.turn = turn
        self.askers = askers   # who asks, when not this process (handover.py)
        self.decision: Decision | None = None
        self.owner = None     # who may nest in this turn: the thread, or an asyncio task
        self.cancel: threading.Event | None = None   # set: a wait in another thread gives up
        self.blocked = False  # the turn blocked in the store's wait: 'waited' is that fact, not
        # a duration (a hand-off can take less than a millisecond, and it was still a wait)
        self.started_wait = 0.0
        self.crowded_since: float | None = None   # first refusal of a crowded server (its wait)
        # The seat of the holding turn a handed-over turn is part of (its requests' engine slot,
        # with the proxy's --pin-slots); None while it is part of none.
        self.part_of: int | None = None
        self.unwritten: float | None = None   # held (hold()), its record not yet written: when
        self.seated: bool | None = None   # the lane had seats when last opened (None: not yet)

    @property
    def had_to_wait(self) -> bool:
        """The turn asked to wait and blocked: the journal's 'waited' event and the 'waited'
        outcome of the counts (a wait=0 turn's grace is not a wait)."""
        return self.blocked and self.turn.wait != 0

    def begin(self, owner) -> None:
        """owner (an asyncio task's token instead of the thread) may nest in this turn; its wait
        can be cancelled from another thread (stop_waiting())."""
        self.owner, self.cancel = owner, threading.Event()

    # -- the steps -------------------------------------------------------------------------------
    def take(self, try_only: bool = False):
        """try_first(), the wait in this thread and decide(), or what the turn is when the lane
        cannot be asked: ungated, fail-open, deflected by a crowded gate. try_only: raise
        WouldBlock instead of waiting (an asyncio turn's first try, on the event loop)."""
        turn, gate = self.turn, self.turn.gate
        if gate.config_error:
            return turn.fail_open(gate.config_error)
        if not gate.gated:
            turn.state = UNGATED
            return turn
        tries = 0
        while True:
            try:
                waiting = self.try_first(try_only)
                if waiting is not None:
                    self.decide(waiting.handle, gate.store.wait_lock(
                        waiting.handle, waiting.timeout, self.cancel, rank=turn.rank))
                return turn
            except ServerCrowded as error:
                pause = self._crowded_pause(tries, try_only)
                if pause is None:
                    return self.cannot_take(error)
            except GateUnavailable as error:
                return self.cannot_take(error)
            tries += 1
            time.sleep(pause)

    def try_first(self, try_only: bool = False, seats: bool = True) -> Wait | None:
        """Open the lane's lock and try it: None when the turn is decided (nested, or the lock
        taken: record() records it), else the Wait. try_only: WouldBlock instead of a Wait.
        seats=False: WouldBlock for a lane of seats too, before anything is asked or tried
        there (a caller that cannot yet say who asks)."""
        turn = self.turn
        gate, store = turn.gate, turn.gate.store
        # Facts the holder record needs, read (once per process) before the lock: after it, they
        # would delay the hand-off.
        own_start_ticks(), boot_id(), user_name(), hostname()
        if turn.command_pid is not None and turn.record.command is None:
            turn.record.command = command_facts(turn.command_pid)
        turn.handle = None
        handle = turn.handle = store.open(gate.lane)
        handle.asker = {"session": turn.session, "hostname": hostname()}
        if handle.caveat:
            gate.warn(handle.caveat)
        if self.owner is None:
            self.owner = nesting.this_thread()
        outer = nesting.outer(handle.ident, self.owner)
        if outer is not None:
            self._nested(handle, outer)
            return None
        # A turn a crowded server kept out has waited since its first refusal: that counts.
        self.started_wait = self.crowded_since or time.monotonic()
        stops.reached(stops.BEFORE_ACQUIRE)
        self.seated = handle.seated
        if not seats and handle.seated:
            store.release(handle)
            turn.handle = None
            raise WouldBlock
        # On a lane of seats, a turn handed over (or the holder itself asking) is asked about
        # before any seat is tried: a free seat must not make one turn two. On one seat only a
        # busy lane asks, so a free lane never pays for the lookup.
        handed = self._handed_over(handle) if handle.seated else None
        if handed is None and store.try_lock(handle, rank=turn.rank):
            self.decide(handle, True)
            return None
        if try_only and handed is None:
            store.release(handle)
            turn.handle = None
            raise WouldBlock
        if not handle.seated:
            handed = self._handed_over(handle)
        if handed == handover.NESTED:
            self._nested(handle)
            return None
        if handed == handover.ITSELF:   # the holder's own request (the proxy's client)
            turn.record.outcome = "busy"   # told so, nothing runs
            self.decide(handle, False)   # deflects at once: waiting would wait for itself
            return None
        self.blocked = True
        if turn.wait is None:
            return Wait(handle, None)
        left = turn.wait if self.crowded_since is None else \
            turn.wait - (time.monotonic() - self.crowded_since)
        return Wait(handle, max(left, gate.grace))

    def decide(self, handle, got: bool) -> None:
        """After the lock was tried or waited for (got: taken): the decision record() writes."""
        turn = self.turn
        turn.waited = time.monotonic() - self.started_wait
        if not got and self.cancel is not None and self.cancel.is_set():
            turn.gate.store.release(handle)   # abandoned, not deflected: nothing to record
            turn.handle, turn.state = None, CANCELLED
        elif not got:
            self.decision = Decision(DEFLECTED, holder=describe_holder(turn.gate, handle))
        else:
            self.decision = Decision(HELD, ident=handle.ident)

    def record(self):
        """Write what decide() decided: the holder record and 'acquired', or 'deflected'.
        Nothing to write (ungated, nested, fail-open, cancelled, recorded already): nothing."""
        if self.decision is not None and self.decision.state == HELD:
            self.hold()
        if self.unwritten is not None:
            return self._written()
        decision, self.decision = self.decision, None
        if decision is None:
            return self.turn
        return self._deflect(self.turn.handle, decision.holder)

    def hold(self) -> None:
        """A held decision (decide() took the lane) takes effect: the turn holds the lane from
        now on -- its state, token, clocks and seat -- its holder record and journal not yet
        written (record() writes them; the release writes them first if nothing did)."""
        decision, self.decision = self.decision, None
        turn = self.turn
        turn.state = HELD
        nesting.hold(decision.ident, self.owner, turn)
        self.unwritten = turn.record.holding(handover.new_token(), turn.handle)
        stops.reached(stops.AFTER_ACQUIRE)

    # -- a driver's way out ----------------------------------------------------------------------
    def give_back(self) -> None:
        """Cancelled before its decision was recorded: let go of whatever was taken (a lock a
        wait got as it was cancelled, a decision not yet recorded), record nothing."""
        turn = self.turn
        if turn.state is not None and self.decision is None:
            return   # decided and recorded, or nothing taken (ungated, nested, fail-open)
        self.decision = None
        if turn.handle is not None:
            turn.gate.store.release(turn.handle)
            turn.handle = None
        turn.state = CANCELLED

    def stop_waiting(self) -> None:
        """Make a wait blocked in another thread give up (an asyncio turn's cancellation)."""
        if self.cancel is not None:
            self.cancel.set()
        handle = self.turn.handle
        if handle is not None:
            self.turn.gate.store.cancel_wait(handle)

    def cannot_take(self, error: GateUnavailable):
        """The store could not take the gate: a crowded one (GateCrowded: out of descriptors,
        memory or locks) deflects, a broken one fails open."""
        if isinstance(error, GateCrowded):   # GateUntrusted too: attacked is not broken
            return self._crowded(str(error), error.reason)
        return self.turn.fail_open(str(error))

    # -- what the steps decide -------------------------------------------------------------------
    def _crowded_pause(self, tries: int, try_only: bool) -> float | None:
        """How long to pause before asking a crowded server again, or None: the turn's wait
        does not reach past the pause (or it has none), so it deflects (gate_crowded) now."""
        turn = self.turn
        now = time.monotonic()
        if self.crowded_since is None:
            self.crowded_since = now
        if turn.handle is not None:   # refused after it opened: nothing of it is kept
            turn.gate.store.release(turn.handle)
            turn.handle = None
        pause = backoff(tries)   # a crowded server's connections free as other turns end
        if try_only or turn.wait is not None and self.crowded_since + turn.wait - now <= pause:
            return None
        return pause

    def _handed_over(self, handle) -> str | None:
        """Is the process asking part of the holding turn, or the holder itself (handover.py's
        verdict)? Only a busy lane asks, so a free lane never pays for the lookup."""
        askers = self.askers() if self.askers is not None else [handover.this_process()]
        if not askers or None in askers:
            return None
        gate = self.turn.gate
        try:
            facts = gate.store.survey(gate.lane, handle)[0]
        except GateUnavailable:
            return None
        # On a lane of seats, any seat's turn may be the one the asker is part of.
        for seat in (facts, *facts.other_seats):
            verdict = handover.verdict(seat.record, askers, live_pids_here(seat))
            if verdict is not None:
                if verdict == handover.NESTED:
                    self.part_of = seat.seat
                return verdict
        return None

    def _nested(self, handle, outer=None) -> None:
        """Part of a turn this owner already holds, or one handed over to this process: run
        through. outer: the same owner's turn (its token goes on in env)."""
        turn = self.turn
        turn.gate.store.release(handle)
        turn.handle = None
        turn.state, turn.nested = HELD, True
        if outer is not None:
            turn.record.token, turn.record.fence = outer.token, outer.fence

    def _written(self):
        turn, now, self.unwritten = self.turn, self.unwritten, None
        turn.record.held(turn.handle, now, turn.waited if self.had_to_wait else None)
        return turn

    def _deflect(self, handle, holder: dict | None = None):
        turn = self.turn
        turn.state, turn.reason = DEFLECTED, REASON_BUSY
        turn.holder = holder or describe_holder(turn.gate, handle)
        turn.record.deflected(handle, REASON_BUSY, turn.holder, turn.wait,
                              turn.waited if self.had_to_wait else None)
        turn.gate.store.release(handle)
        turn.handle = None
        return turn

    def _crowded(self, why: str, reason: str = GateCrowded.reason):
        """Crowded is not broken: the gate is there, this process only cannot open or read it
        now, so it cannot tell whether another turn holds the lane (with no descriptor, nothing
        can be asked of the kernel). Running beside a holder is what the gate exists to prevent,
        so the turn deflects (reason gate_crowded) -- at once: the descriptors it lacks are its
        own, and waiting would not bring them back. Nothing is journaled or counted (that needs
        the descriptors it lacks); the caller says the one line."""
        turn = self.turn
        if turn.handle is not None:
            turn.gate.store.release(turn.handle)
            turn.handle = None
        self.decision = None
        turn.state, turn.reason, turn.holder = DEFLECTED, reason, None
        turn.crowded = why
        turn.record.settled = True
        return turn


def describe_holder(gate, handle) -> dict:
    """Who holds the lane (a deflection's line, probe): the one judge's holder of the store's
    facts, read through the handle where the store can."""
    try:
        from ..inspection.judge import holder

        facts = gate.store.survey(gate.lane, handle)[0]
    except GateUnavailable as error:
        return unlabelled(None, None, f"the store could not say: {error}")
    except OSError as error:   # out of descriptors (an import opens a file too): the kernel said
        # busy, only who holds it cannot be read now
        return unlabelled(None, None, f"who, cannot be read now: {error.strerror}")
    return holder(facts)
