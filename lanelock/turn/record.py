"""What a turn leaves behind: its holder record, its journal events and its counts, with the
bookkeeping they carry -- the turn's token and fence, the turn before it that never let go, and
a lane its store took away (lost) and maybe gave back (ungated seconds).

Once the lock is held, trouble writing any of these is a warning, never a reason to let the lock
go or skip it: the gate is a performance guard, its records are for the people reading them.
"""

from __future__ import annotations

import os
import time

from .. import holder
from ..duration import backoff
from ..errors import RecordNotWritten
from ..facts import boot_id, hostname, own_start_ticks, utc_now

# How long a lost turn's release asks a server that does not answer to journal its overlap.
LOST_JOURNAL_WITHIN = 4.0


class TurnRecord:
    """One turn's record and journal on gate's lane. The identity (session, model, argv, labels,
    priority) is the turn's; the rest is filled in as the turn is taken, held and let go."""

    def __init__(self, gate, *, session: str, model, argv: list, labels: dict, priority: str,
                 fallback: bool | None):
        self.gate = gate
        self.session, self.model, self.argv, self.labels = session, model, argv, labels
        self.priority = priority
        # What a deflection leads to, when known before it: "busy" (nothing runs) or None (the
        # caller says at settle()); the deflected event carries it, so history tells them apart.
        self.outcome = None if fallback is None or fallback else "busy"
        self.deflected_ts: float | None = None
        self.settled = False   # its outcome was counted (metrics)
        self.token: str | None = None   # names this held turn (or the one it nests in)
        self.fence: int | None = None   # the store's generation of this turn (store.write_holder)
        self.command: tuple[int, int] | None = None   # (pid, start ticks), read before the lock
        self.acquired_at = ""
        self.started = 0.0   # time.monotonic() the lane was held
        self.stopped_at: str | None = None
        self.took_over: dict | None = None   # the turn before, which never released
        self.lost = False      # the store took the lane away mid-turn (PostgreSQL session ended)
        self.ungated = 0.0     # seconds the lane was lost before the turn took it back
        self.lost_at: float | None = None   # time.time() the lane was lost, while not back
        self.lost_for_good = False   # the store ended the session itself: never taken back
        self.seat: int | None = None   # the seat held (1..seats), once held
        self.seats = 1                 # the lane's seat count when it was taken
        self._argv_fields: dict | None = None
        self._unjournaled: tuple = ()   # a held turn's events the journal had no room for

    # -- the holder record -----------------------------------------------------------------------
    def holder_record(self) -> dict:
        if self._argv_fields is None:
            self._argv_fields = holder.argv_fields(self.argv)
        record = holder.record(
            lane=self.gate.lane, session=self.session, model=self.model, argv=self._argv_fields,
            acquired_at=self.acquired_at, acquired_monotonic=self.started, turn=self.token,
            stopped_at=self.stopped_at, labels=self.labels, command=self.command)
        if self.seated:   # which of the lane's seats (a one-seat lane's records stay as ever)
            record.update(seat=self.seat, seats=self.seats)
        if self.ungated:   # the lane was lost (a store restart) and taken back: for how long
            record["ungated_seconds"] = round(self.ungated, 3)
        if self.took_over is not None:   # from a turn that never let go: it may run on
            record["took_over"] = self.took_over
        return record

    @property
    def seated(self) -> bool:
        """Held on a lane of more than one seat (or a seat past one: a count made smaller)."""
        return self.seat is not None and (self.seats > 1 or self.seat > 1)

    def write(self, handle) -> None:
        """The holder record as it stands now."""
        try:
            self.gate.store.write_holder(handle, self.holder_record())
        except RecordNotWritten as error:
            self.gate.warn(f"lane held, but the holder record was not written: {error}")

    # -- the journal -----------------------------------------------------------------------------
    def event(self, event: str, at: tuple[float, str] | None = None, **extra) -> dict:
        # "monotonic" is one system-wide clock: durations between turns survive wall-clock jumps.
        # at: (time.time(), its utc_now() text) when the caller has both already.
        now, text = at if at is not None else (time.time(), None)
        return {"event": event, "time": text or utc_now(now), "ts": round(now, 6),
                "monotonic": round(time.monotonic(), 6),
                "lane": self.gate.lane.name, "pid": os.getpid(), "session": self.session,
                "model": self.model, **({"turn": self.token} if self.token else {}),
                **({"seat": self.seat, "seats": self.seats} if self.seated else {}),
                **self.labels, **extra}

    def log(self, handle, held: bool, *events: dict) -> None:
        """Events as one append (one write() on a flock store's journal). held: the turn holds
        the lane. A held turn's events that could not be written (a full disk) go with its next
        ones: a release carries the acquired event the disk had no room for, and history still
        has the whole turn."""
        events = (*self._unjournaled, *events)
        self._unjournaled = ()
        try:
            self.gate.store.append_event(handle, *events)
        except RecordNotWritten as error:
            if held or events[-1]["event"] == "released":
                self.gate.warn(f"journal not written: {error}")
            if held and events[-1]["event"] != "released":
                self._unjournaled = events

    def aside(self, event: dict) -> None:
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

    # -- what the turn became --------------------------------------------------------------------
    def holding(self, token: str, handle) -> float:
        """The lane is held (handle), as the turn named token: its clocks start, its seat is
        known. Returns time.time()."""
        self.token = token
        self.seat, self.seats = handle.seat, handle.seats
        self.started = time.monotonic()
        now = time.time()
        self.acquired_at = utc_now(now)
        return now

    def held(self, handle, now: float, waited: float | None) -> None:
        """The held turn's holder record, then its journal: 'waited' (waited: the seconds it
        blocked, None when it did not), 'acquired', and 'took-over' when the turn before it never
        let go. The record is written before the caller runs anything: whoever sees the command
        running must also find who runs it."""
        self.took_over = taken_from(getattr(handle, "unreleased", None), self.token)
        self.write(handle)
        self.fence = getattr(handle, "fence", None)
        # Who holds, precisely enough for `history` to tell a live turn from a killed one.
        events = [self.event("acquired", at=(now, self.acquired_at),
                             start_ticks=own_start_ticks(), boot_id=boot_id(),
                             hostname=hostname(), priority=self.priority,
                             **({"fence": self.fence} if self.fence is not None else {}),
                             **holder.command_fields(self.command))]
        if waited is not None:
            events.insert(0, self.event("waited", at=(now, self.acquired_at),
                                        waited=round(waited, 6), priority=self.priority))
        if self.took_over is not None:   # it may still run: history says the overlap
            events.append(self.event("took-over", at=(now, self.acquired_at),
                                     fence=self.fence, **{"from": self.took_over}))
        self.log(handle, True, *events)

    def deflected(self, handle, reason: str, who: dict, wait: float | None,
                  waited: float | None) -> None:
        """The 'deflected' event (who: the holder, described). What history needs to tell a
        turn that timed out waiting from one that never waited (wait: the seconds it asked for,
        None for ever; waited: None when it did not block), and busy (nothing ran) from
        deflected."""
        extra: dict = {"priority": self.priority}
        if waited is not None:
            extra.update(wait=wait, waited=round(waited, 6))
        if self.outcome is not None:
            extra["outcome"] = self.outcome
        seated = who.get("holders") if isinstance(who, dict) else None
        if isinstance(seated, list):   # every seat held: "holder" stays the first, as ever
            extra.update(holders=seated, seats=who.get("seats"))
            who = {key: value for key, value in who.items() if key not in ("holders", "seats")}
        event = self.event("deflected", reason=reason, holder=who, **extra)
        self.deflected_ts = event["ts"]
        self.log(handle, False, event)

    def failed_open(self, why: str, handle) -> None:
        """The 'fail-open' event; the one warning the caller said is all a failing gate may say."""
        try:
            self.gate.store.append_event(handle, self.event("fail-open", reason=why))
        except RecordNotWritten:
            pass
        self.settled = True

    def released(self, handle, exit_status: int | None, ended: str | None,
                 duration: float) -> None:
        """The holder record's release and the 'released' event, written while the lock is still
        held: after unlock the record is the next turn's."""
        now = time.time()
        ending = {"ended": ended} if ended else {}
        fields = {"released_at": utc_now(now), "exit_status": exit_status,
                  "held_seconds": duration, **ending}
        try:
            self.gate.store.write_release(handle, self.holder_record, fields)
        except RecordNotWritten as error:
            self.gate.warn(f"the holder record's release was not written: {error}")
        self.log(handle, True, self.event("released", at=(now, fields["released_at"]),
                                          duration=duration, exit_status=exit_status, **ending))

    def regained(self, lost_at: float) -> float:
        """The lane lost at time.time() lost_at is held again: those seconds count as ungated.
        Returns time.time()."""
        now = time.time()
        self.lost, self.lost_at = False, None
        self.ungated += now - lost_at
        return now

    def journal_lost(self, duration: float, exit_status: int | None, ended: str | None) -> None:
        """A turn whose lane was lost and not taken back ran ungated from the loss to its end:
        its 'lost' event (those seconds, its fence) and the ungated count, through a connection
        of its own (its session is gone). A server that does not answer now is asked again for
        LOST_JOURNAL_WITHIN at most (plus one connect timeout): the exit is never held longer,
        and a line says what was not written."""
        now = time.time()
        lost_at = self.lost_at if self.lost_at is not None else now
        ungated = round(max(0.0, now - lost_at), 3)
        event = self.event("lost", at=(now, utc_now(now)), lost_at=utc_now(lost_at),
                           lost_ts=round(lost_at, 6), ungated=ungated, duration=duration,
                           exit_status=exit_status, fence=self.fence,
                           how="ended" if self.lost_for_good else "not-taken-back",
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


def taken_from(record, token: str | None) -> dict | None:
    """Who held the lane before this turn and never released it (its session ended: lost, or
    killed), from its row: enough for history to find its 'lost' event (turn) and for a
    resource to tell its requests from this turn's (fence)."""
    if not isinstance(record, dict) or record.get("turn") in (None, token):
        return None
    return {name: record[name] for name in ("turn", "fence", "pid", "hostname", "session",
                                            "acquired_at") if record.get(name) is not None}
