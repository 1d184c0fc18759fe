"""The lane-store contract: what a store is, for whoever writes the next one (Redis, etcd, ...).

A store keeps three things per lane:
- the lock: whoever holds it owns the lane; it dies with its holder (process, connection), with no
  reaper and no heartbeat, and nothing the store does ever removes a lock another turn may hold;
- the holder record: who holds it, written by the holder while it holds, read by anyone;
- the events (`history`) and the cumulative counts (`metrics`).

A store subclasses LaneStore and implements its abstract methods, twelve of them: abc refuses one
that forgets any. Everything else here has a default a store may override. Policy -- when to
wait, what a deflection says, who nests in a turn, what a verdict is -- is not the store's: the
gate (gate.py) and the one judge (inspection/judge.py) decide for every store alike. What a store
must get right about its own medium (a replaced lock file, a transaction-mode pooler) it does
inside try_lock and wait_lock: they answer True only when the lane is really this turn's.

Errors crossing this interface are lanelock's own (errors.py): GateUnavailable (the gate cannot be
taken or read: the turn fails open) and RecordNotWritten (a record or an event was not written:
the turn keeps its lane and warns once). Stores return facts (LaneFacts, documented fields, no
sentinel strings); the judge turns facts into verdicts.

The abstract methods:
  where(lane)                      its paths, and one line on what the store is and bounds
  qualify(lane)                    the lane as this store keys it
  open(lane, create=)              a LockHandle, not yet locked
  try_lock(handle)                 take it now, or False
  wait_lock(handle, timeout, cancel)   block (never poll) until it is ours, or False
  release(handle, count=)          let go (and count the turn), never raising
  write_holder(handle, record)     the holder record, while holding
  append_event(handle, *events)    the journal
  count(lane, outcome, ...)        add a turn that held no lock to the counts
  counts(facts)                    the lane's cumulative counts
  survey(lane=None, handle=None)   LaneFacts, without taking the lock
  events(lane, since)              the journal, oldest first
and, with defaults a store may improve, what a witness (witness.py) needs: holding(lane), asked
several times a second, and claim_witness(lane), so that one witness counts a lane's engine.
The tests hold every store to it (tests/test_store_contract.py), tests/support/contract_store.py
included: a store of about a hundred lines made of these twelve alone.
"""

from __future__ import annotations

from abc import ABC, abstractmethod


class LaneFacts:
    """What a store can say about one lane without taking it (the judge's input).

    Plain attributes (no dataclass: the run path never builds these, but the module is imported)."""

    __slots__ = ("lane", "lock_path", "sidecar_path", "exists", "kernel_source", "problem_lock",
                 "error", "held", "holders", "waiters", "record", "record_problem", "record_absent",
                 "matches", "queue",
                 "replaced", "store_stale", "alive", "reused", "collision", "stopped", "bound",
                 "ending", "ending_pgid", "ending_pids", "seats", "seat", "other_seats")

    def __init__(self, lane: str, lock_path: str, sidecar_path: str | None = None):
        self.lane = lane
        self.lock_path = lock_path
        self.sidecar_path = sidecar_path
        self.exists = False           # a lock (file or holder row) has ever existed for the lane
        self.kernel_source = "proc-locks"   # where held/holders came from: proc-locks, probe, pg_locks
        self.problem_lock: str | None = None   # the lock itself is unusable (a symlink, a FIFO)
        self.error: str | None = None          # the lane could not be inspected at all
        self.held: bool | None = False         # None: cannot tell
        self.holders: list[dict] = []          # [{pid, command, lanelock}] from the lock's owner
        self.waiters: list[dict] = []
        self.record: dict | None = None        # the holder record, parsed
        self.record_problem: str | None = None  # why there is no usable record (words for people)
        self.record_absent = False    # no record was ever written (not one that is unreadable)
        self.matches = False          # the record names the process that holds the lock
        self.replaced: str | None = None   # a live holder locks a removed/replaced lock (why)
        self.store_stale: str | None = None  # a store's own reason the record is out of date
        self.alive: bool | None = None      # the record's process is alive (None: cannot tell)
        self.reused = False           # the record's pid now belongs to another process
        self.collision = False        # another lane's turn holds the same store key
        self.stopped: dict | None = None    # the holder is stopped: {pid, since, words}
        self.bound: str | None = None       # how a holder whose host vanished loses the lane
        # The command of a turn killed without releasing, still running on this machine (its
        # pid): the lane is not free until it is gone (store/outlived.py).
        self.ending: int | None = None
        # Its process group when it has one (the lane waits for all of it), and the processes of
        # it still running (none listed: /proc does not show them).
        self.ending_pgid: int | None = None
        self.ending_pids: list[int] = []
        # The turns waiting, in the order they will get the lane: {position, class,
        # effective_class, pid, session, host, waited}; [] for a store that keeps no order.
        self.queue: list[dict] = []
        # Seats: the lane's count (up to that many turns hold it at once), the seat these facts
        # describe (the lane's own facts are seat 1's), and the facts of each other seat --
        # 2..seats, and any seat past the count still held (a count made smaller under its
        # holders) -- each a LaneFacts of its own, judged as seat 1's are. [] on a one-seat lane.
        self.seats = 1
        self.seat = 1
        self.other_seats: list["LaneFacts"] = []


class LockHandle:
    """What open() returns: one turn's hold on a lane's lock, locked or not. Every store's handle
    carries these documented fields (subclass it or set them):

      exists  -- there is a lock to take: False only for a lane that never existed, opened with
                 create=False (nobody can hold what does not exist)
      ident   -- a tuple equal for every spelling of the same lock (in-process reentrancy keys on
                 it: a thread entering a turn it already holds must not lock twice)
      caveat  -- a warning about this store the turn says once (a root on NFS), or None

      seats   -- the lane's seat count as read when opened: up to that many turns hold the
                 lane at once (1: the lane's one lock, as ever)
      seat    -- the seat (1..seats) the handle is on: the one it holds once locked
      past    -- the seats past the count that may still be held (a count made smaller under
                 its holders): they count against it (store/seating.py)

    and one the gate sets after open(): asker, {session, hostname} of the turn, for a store that
    shows its waiters (`status`'s queue) and picks a session's seat. close() frees whatever the
    handle holds (release() calls it)."""

    exists = True
    ident: tuple = ()
    caveat: str | None = None
    asker: dict | None = None
    seats = 1
    seat = 1
    past: tuple = ()

    @property
    def seated(self) -> bool:
        """More than the lane's one lock to think of: seats, or seats past the count."""
        return self.seats > 1 or bool(self.past)

    def close(self) -> None:
        pass


class LaneStore(ABC):
    kind = "?"
    # Can the store take a lane away from a living holder (a server ending its session)? Then
    # its holders are watched (lanewatch.py), and `run` loads the watch while it waits.
    takes_lanes_away = False
    # True when taking a free lane may block on the network (an asyncio turn then takes it in a
    # thread); False when it is a few local system calls (it is then tried on the event loop, and
    # the store must implement wait_lock_async).
    blocking_io = True
    # What a store says but never decides on (a count not added); the Gate gives its own.
    warn = staticmethod(lambda message: None)

    # -- where the lane lives ----------------------------------------------------------------------
    @abstractmethod
    def where(self, lane) -> dict:
        """{lock_path, sidecar_path, journal_path, detail} for `where` and every message that
        names the lane's lock: paths, or None where the store has no file (sidecar_path,
        journal_path); detail: one line on the store and what bounds it (how fast a dead
        holder's lane frees). Cheap: no connection, no lock."""

    @abstractmethod
    def qualify(self, lane):
        """The lane as this store keys it (a network store makes "localhost" per host)."""

    def problems(self) -> list:
        """What would make a turn here fail open, found without taking anything (for `where`,
        `status --all`): sentences. Default: nothing known."""
        return []

    # -- values kept with the lanes ---------------------------------------------------------------
    def kept(self, name: str):
        """The value kept under name for every process of every host that uses this store (a
        lane's seat count: "seats/LANE"; the model map: "models/BACKEND"), or None when none was
        set. GateUnavailable when it cannot be read (or is not to be believed). Default: a
        store that keeps none."""
        return None

    _seats_warned = False

    def seat_warning(self, why: str) -> None:
        """A seat count that cannot be read or believed (store/seating.py: taken as one seat):
        said once per store."""
        if not self._seats_warned:
            self._seats_warned = True
            self.warn(why)

    def make_seats(self, lane, count: int) -> None:
        """Whatever the lane's seats 2..count need before the count is kept, made by the user
        who may set it (GateUnavailable when it cannot be). Default: nothing (a store whose seats
        are rows)."""

    def forget_seats(self, lane, count: int) -> None:
        """Once a count is kept: whatever the seats past it need no more, forgotten where no turn
        holds them (one still held keeps new turns out until it lets go). Default: nothing."""

    def keep(self, name: str, value) -> None:
        """Keep value under name (None: forget it) for every process that reads this store.
        GateUnavailable when it cannot be written. Default: a store that keeps none."""
        from ..errors import GateUnavailable

        raise GateUnavailable(f"the {self.kind} store keeps no values with its lanes")

    # -- the lock -----------------------------------------------------------------------------------
    @abstractmethod
    def open(self, lane, *, create: bool = True) -> LockHandle:
        """A handle on the lane's lock, not yet taken. GateUnavailable when it cannot be had; with
        create=False a lane that never existed gives a handle whose `exists` is False."""

    @abstractmethod
    def try_lock(self, handle, rank: int = 1) -> bool:
        """Take the lock if it is free, at once. True only when the lane is now this turn's: a
        store whose lock can be taken on something no longer the lane's (a replaced lock file, a
        pooled session) checks that here and retries or raises GateUnavailable. rank: the turn's
        class (priority.py CLASSES: 0 batch, 1 normal, 2 interactive); a store that keeps its
        waiters in order answers False while one of this class or higher waits (no barging), a
        store that keeps no order ignores it."""

    @abstractmethod
    def wait_lock(self, handle, timeout: float | None, cancel=None, rank: int = 1) -> bool:
        """Block (in the kernel or the server, never by polling) up to timeout seconds (None:
        forever) until try_lock's answer would be True. cancel: a threading.Event; once it is set
        (and cancel_wait called) the wait gives up and returns False. rank: as for try_lock. A
        store that orders its waiters does not write the order: it gives store/order.py a medium
        (an order.Line: where entries live, one reading of who is ahead and the next step, how
        to wait on one) and returns order.wait(line, timeout, cancel) -- the flock store, the
        PostgreSQL store, and tests/support/contract_store.py's OrderedContractStore do. A store
        that keeps no order takes the kernel's or the server's."""

    async def wait_lock_async(self, handle, timeout: float | None, rank: int = 1) -> bool:
        """wait_lock for an asyncio task, costing no thread while it waits. Only a store whose
        blocking_io is False is asked (an asyncio turn on any other waits in a thread of its
        own, with wait_lock and cancel_wait)."""
        raise NotImplementedError

    def cancel_wait(self, handle) -> None:
        """Make a wait_lock blocked in another thread give up soon, for a store whose wait cannot
        watch the cancel Event itself (a server-side wait). Default: the Event is enough."""

    @abstractmethod
    def release(self, handle, count: dict | None = None) -> None:
        """Let go and close the handle; never raises, never removes the lock itself. count: this
        turn's outcome for the metrics (count()'s keywords with "outcome"), added where it costs
        the next turn least."""

    def keeps_place(self, handle) -> bool:
        """After the gate failed a turn open: does the handle still hold something that keeps
        this machine's turns one at a time (the PostgreSQL store's host lane, when the server
        cannot be reached)? Then the gate releases it when the turn ends. Default: no."""
        return False

    def watch_fd(self, handle) -> int | None:
        """A descriptor that becomes readable when the store may have taken the lock away from
        its holder (a server ended the session), or None when it cannot (default: a lock that
        lives as long as its holder)."""
        return None

    def lost(self, handle) -> bool:
        """After watch_fd fired: has the store really ended this turn's hold? Default: never."""
        return False

    def retake(self, handle) -> bool | None:
        """After lost(): take the lane back for its turn when the store's server restarted under
        it (an outage, not a release). True: held again; False: lost for good; None: not yet,
        ask again. Default: lost for good."""
        return False

    def serve_many(self) -> None:
        """This process serves many turns at once (the proxy): the store's short questions
        (who holds the lane, kept values, counts) may share what it keeps open for them rather
        than open something each time (store/pg/shared.py). Default: nothing to share."""

    def lease_holds(self) -> None:
        """This process watches every turn it holds (run, the proxy: lanewatch.py), so its holds
        may be leased: taken back by the store when the watch stops renewing them
        (store/pg/lease.py). Default: nothing leased."""

    def rest(self, handle, seconds: float | None) -> None:
        """This hold is kept unwatched for up to seconds (None: for as long as it takes): a
        proxy's turn lingering between a session's requests, a `run` stopped with its command.
        The store must not take it away for that silence (store/pg/lease.py). Default: nothing
        to do."""

    # A leased hold (store/pg/lease.py): the watch renews it, and a lost lease counts as lost
    # DECIDE s before it ends, its command killed by KILL_BY s before it ends.
    DECIDE = 0.0
    KILL_BY = 0.0

    def renews(self, handle) -> float | None:
        """Seconds between the watch's renewals of this hold; None: nothing to renew."""
        return None

    def renew(self, handle) -> bool:
        """Renew the hold; False: not answered in time (the link counts as lost)."""
        return True

    def lease_deadline(self, handle) -> float | None:
        """The monotonic moment another turn may take the lane after this hold is lost; None:
        not leased."""
        return None

    # -- the turn's records (RecordNotWritten on failure) --------------------------------------------
    @abstractmethod
    def write_holder(self, handle, record: dict) -> None:
        """Record the holder; only the holder writes, while it holds the lane. The store adds
        what it needs to check the record against the lock later (the lock file's inode, the
        server's backend pid)."""

    def write_release(self, handle, full_record, fields: dict) -> None:
        """Add the release's fields to this turn's record while still holding. full_record():
        the whole record. Default: write it again, whole."""
        self.write_holder(handle, {**full_record(), **fields})

    @abstractmethod
    def append_event(self, handle, *events: dict) -> None:
        """The events, as one append where the store can."""

    def event_handle(self, lane, again: bool = False):
        """Somewhere to record a fail-open turn when the lock could not be opened (a handle
        append_event and release accept), or None: not recorded (default). again: asked again
        by a caller that bounds its own tries (a lost turn's release), even where this process
        found the store unreachable before."""
        return None

    def fail_open_handle(self, lane):
        """Somewhere to record a turn that fails open with no handle of its own: event_handle's,
        unless the store keeps such records some other way while it cannot be reached (the
        PostgreSQL store: on its host, store/pg/spool.py)."""
        return self.event_handle(lane)

    @abstractmethod
    def count(self, lane, outcome: str | None, *, reason: str | None = None,
              held: float | None = None, waited: float | None = None,
              priority: str | None = None, **witness) -> None:
        """Add one turn's outcome to the lane's cumulative counts (a turn that held no lock:
        deflected, busy); or, with outcome None, a witness's increments and facts (witness=,
        engine=, last_unseen=: store/counts.py merge()); never raises."""

    @abstractmethod
    def counts(self, facts) -> dict:
        """The lane's cumulative counts (store/counts.py's shape), for the LaneFacts' lane."""

    # -- inspection (never takes the lock) -------------------------------------------------------------
    @abstractmethod
    def survey(self, lane=None, handle=None) -> list:
        """LaneFacts for the lane, or for every lane the store knows when lane is None. handle:
        an open handle on that lane the store may read through (no second connection). Raises
        GateUnavailable when the store cannot be read."""

    left_out = 0   # how many lanes survey_all() left out, at its last call

    def survey_all(self, most: int) -> list:
        """LaneFacts of at most `most` lanes of the store's, those changed last (status --all,
        metrics --all: bounded in time and memory whatever other users make); left_out says how
        many more it knows. Default: survey() of them all, cut (a store whose lanes anyone may
        make -- the flock store's shared root -- chooses before it judges, and overrides it)."""
        found = self.survey()
        self.left_out = max(0, len(found) - most)
        return found[:most]

    def lane_names(self) -> list[str]:
        """The names of every lane the store knows (a listing, cheaper than judging them all).
        Default: from survey()."""
        return [facts.lane for facts in self.survey()]

    def waiting(self, lane) -> list:
        """The lane's queue rows in order (LaneFacts.queue's shape), asked as a turn asks -- for
        an estimate on a busy answer's path, so a store whose survey() costs others something
        (the flock store's /proc/locks) overrides it. Default: survey()."""
        return self.survey(lane)[0].queue or []

    def holding(self, lane, handle=None) -> tuple:
        """(a turn holds the lane now: True, False or None when the store cannot tell; seconds
        since the last turn released it, or None), for a witness that asks several times a
        second. A store whose survey() costs others something overrides it with something
        cheaper (the flock store never reads /proc/locks here: each read stalls every flock()
        on the machine). Raises GateUnavailable when the store cannot be read. Default:
        survey()."""
        from ..holder import released_ago

        facts = self.survey(lane, handle)[0]
        held = None if facts.held is None else bool(facts.held) or facts.ending is not None
        return held, released_ago(facts.record) if not facts.held else None

    def seats_holding(self, lane, handle=None) -> tuple:
        """(how many of the lane's seats turns hold now, None when the store cannot tell;
        seconds since the latest release of a seat not held now, or None), for a witness: each
        held seat covers one generation of the engine. Cheap as holding() is (asked several
        times a second). A seat past the count still held counts: its turn is real. Raises
        GateUnavailable when the store cannot be read. Default: survey(), every seat's facts."""
        from ..holder import released_ago

        facts = self.survey(lane, handle)[0]
        every = [facts, *facts.other_seats]
        if all(seat.held is None for seat in every):
            return None, None
        held = sum(1 for seat in every if seat.held or seat.ending is not None)
        agos = [released_ago(seat.record) for seat in every
                if not seat.held and seat.ending is None]
        agos = [ago for ago in agos if ago is not None]
        return held, min(agos) if agos else None

    def claim_witness(self, lane, who: str | None = None) -> tuple:
        """(a claim, None) when this process may witness the lane's engine -- the claim lasts
        until claim.close() or this process's end, like a lock --, or (None, who) while another
        witness holds it (who: words for people, as the holder gave them). One witness per lane, whichever process and
        host, so an unseen generation is counted once. Default: every witness may (a store that
        cannot tell)."""
        return LockHandle(), None

    @abstractmethod
    def events(self, lane, since: float | None) -> tuple:
        """(events oldest first, number of unreadable entries) since the time (None: all)."""
