"""The lane-store contract: every operation the gate, the wrapper and the read commands use.

A store keeps three things per lane: the lock (whoever holds it owns the lane; it must die with its
holder, with no reaper and no heartbeat), the holder record (who holds it, for deflection lines and
`status`), and the events (`history`). FlockStore keeps them in files under the lock root,
PgStore in a PostgreSQL server. A new store subclasses LaneStore; abc refuses one that forgets a
method (abc is loaded at interpreter start, so the contract costs the run path nothing).

Errors crossing this interface are lanelock's own: GateUnavailable (the gate cannot be taken: the
turn fails open) and RecordNotWritten (a record or event was not written: the turn keeps its lane
and warns). Stores return facts; inspection/judge.py alone turns facts into verdicts.
"""

from __future__ import annotations

from abc import ABC, abstractmethod


class LaneFacts:
    """What a store can say about one lane without taking it (the judge's input).

    Plain attributes (no dataclass: the run path never builds these, but the module is imported)."""

    __slots__ = ("lane", "lock_path", "sidecar_path", "exists", "kernel_source", "problem_lock",
                 "error", "held", "holders", "waiters", "record", "record_problem", "matches",
                 "replaced", "store_stale", "alive", "reused", "collision", "stopped", "bound")

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
        self.record_problem: str | None = None  # why there is no usable record
        self.matches = False          # the record names the process that holds the lock
        self.replaced: str | None = None   # a live holder locks a removed/replaced lock (why)
        self.store_stale: str | None = None  # a store's own reason the record is out of date
        self.alive: bool | None = None      # the record's process is alive (None: cannot tell)
        self.reused = False           # the record's pid now belongs to another process
        self.collision = False        # another lane's turn holds the same store key
        self.stopped: dict | None = None    # the holder is stopped: {pid, since, words}
        self.bound: str | None = None       # how a holder whose host vanished loses the lane


class LaneStore(ABC):
    kind = "?"
    # True when taking a free lane may block on the network (an asyncio turn then takes it in a
    # thread); False when it is a few local system calls (it is then tried on the event loop).
    blocking_io = True

    # -- where the lane lives ----------------------------------------------------------------------
    @abstractmethod
    def qualify(self, lane):
        """The lane as this store keys it (a network store makes "localhost" per host)."""

    @abstractmethod
    def locate(self, lane) -> dict:
        """{lock_path, sidecar_path, journal_path} for `where` (None where there is no file)."""

    @abstractmethod
    def describe(self) -> str:
        """One line for `where`: the store and what bounds it (e.g. how fast a dead host's lane
        frees)."""

    @abstractmethod
    def problems(self) -> list:
        """What would make a turn here fail open, found without taking anything (for `where`)."""

    # -- the lock -----------------------------------------------------------------------------------
    @abstractmethod
    def open(self, lane, *, create: bool = True):
        """A handle on the lane's lock, not yet taken. GateUnavailable when it cannot be had; with
        create=False a lane that never existed gives a handle whose fd is None."""

    @abstractmethod
    def try_lock(self, handle) -> bool:
        """Take the lock if it is free, at once."""

    @abstractmethod
    def wait_lock(self, handle, timeout: float | None, cancel=None) -> bool:
        """Block (in the kernel or the server, never by polling) up to timeout seconds (None:
        forever) for the lock. cancel: a threading.Event; once it is set (and cancel_wait called)
        the wait gives up and returns False."""

    async def wait_lock_async(self, handle, timeout: float | None) -> bool:
        """wait_lock for an asyncio task, costing no thread while it waits. Only a store whose
        blocking_io is False is asked (an asyncio turn on any other waits in a thread of its
        own, with wait_lock and cancel_wait)."""
        raise NotImplementedError

    @abstractmethod
    def cancel_wait(self, handle) -> None:
        """Make a wait_lock blocked in another thread give up soon."""

    @abstractmethod
    def still_current(self, handle) -> bool:
        """The lock just taken is the lane's lock (not a removed file's, not a pooler's session)."""

    @abstractmethod
    def release(self, handle, count: dict | None = None) -> None:
        """Let go and close; never raises, never removes the lock itself. count: this turn's
        outcome for the metrics (count()'s keywords), added where it costs the next turn least."""

    @abstractmethod
    def ident(self, handle) -> tuple:
        """What in-process reentrancy keys on: equal for every spelling of the same lock."""

    @abstractmethod
    def kernel(self, handle):
        """holders.KernelView of who holds and waits (the lock's own truth), None if unknown."""

    @abstractmethod
    def watch_fd(self, handle) -> int | None:
        """A descriptor that becomes readable when the lock may have been taken away, or None
        when it cannot be (a flock lives as long as its descriptor)."""

    @abstractmethod
    def lost(self, handle) -> bool:
        """After watch_fd fired: has the store really ended this turn's hold?"""

    # -- the turn's records (RecordNotWritten on failure) --------------------------------------------
    @abstractmethod
    def read_holder(self, handle) -> tuple:
        """(record, None) or (None, why there is none). Never raises."""

    @abstractmethod
    def write_holder(self, handle, record: dict) -> None:
        """Record the holder; only the holder writes, while it holds the lane."""

    @abstractmethod
    def write_release(self, handle, full_record, fields: dict) -> None:
        """Add the release's fields to this turn's record (full_record(): the whole record, for a
        store that must write it again)."""

    @abstractmethod
    def record_extra(self, handle) -> dict:
        """Store facts the holder record carries (the lock inode, the advisory key)."""

    @abstractmethod
    def open_events(self, handle, max_bytes: int) -> None:
        """A held turn is about to write events: rotate if due, keep what the turn writes with."""

    @abstractmethod
    def append_event(self, handle, *events: dict) -> None:
        """The events, as one append where the store can."""

    @abstractmethod
    def event_handle(self, lane):
        """Somewhere to record a fail-open turn when the lock could not be opened, or None."""

    @abstractmethod
    def count(self, lane, outcome: str, *, reason: str | None = None, held: float | None = None,
              waited: float | None = None) -> None:
        """Add one turn's outcome to the lane's cumulative counts (metrics); never raises."""

    @abstractmethod
    def counts(self, facts) -> dict:
        """The lane's cumulative counts (store/counts.py's shape), for the LaneFacts' lane."""

    # -- who holds it (for a deflection's one line) ----------------------------------------------------
    @abstractmethod
    def holder_agrees(self, record: dict, view) -> bool:
        """Does the record name the process the lock's truth says holds it?"""

    @abstractmethod
    def holder_pids_here(self, handle, view) -> set:
        """Pids on this machine holding the lane (a nested turn recognises its holder)."""

    @abstractmethod
    def unlabelled(self, view) -> tuple:
        """(pid, command) of a holder no record describes."""

    @abstractmethod
    def is_collision(self, problem: str) -> bool:
        """Is read_holder's problem that another lane's turn holds the same store key?"""

    @abstractmethod
    def orphan_holder(self, handle) -> dict | None:
        """A live turn holding a removed or replaced lock of this lane, which must deflect us."""

    # -- inspection (never takes the lock) -------------------------------------------------------------
    @abstractmethod
    def survey(self, lane=None) -> list:
        """LaneFacts for the lane, or for every lane the store knows when lane is None."""

    @abstractmethod
    def events(self, lane, since: float | None) -> tuple:
        """(events oldest first, number of unreadable entries) since the time (None: all)."""
