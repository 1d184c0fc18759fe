"""The flock(2) lane store: the only module that takes the lock (waiting.py blocks on it).

Per lane, under the lock root: STEM.lock (the lock), STEM.json (the holder record, sidecar.py) and
STEM.journal (the events, journal.py). The contract is store/base.py's LaneStore.

Rules that matter here:
- flock(2), not fcntl/lockf: a lock per open file description, dropped only when the last fd on it
  closes, interoperable with flock(1) and lslocks (fasteners#93).
- The lock file is opened with O_CLOEXEC, so a child never inherits it and a daemon it starts can
  never keep the lane (ceph-qa-suite PR 583).
- An existing lock file is opened without O_CREAT (protected_regular refuses O_CREAT on another
  user's file in a sticky directory) and never through a symlink.
- Lock files are never unlinked: waiters would lock different inodes (filelock#574).
"""

from __future__ import annotations

import errno
import fcntl
import os

from ... import say
from ...errors import GateCrowded, GateUnavailable, RecordNotWritten, crowded
from ...paths import Root, creation_problem, open_root
from ...priority import CLASSES, DEFAULT_AGING, DEFAULT_RANK
from .. import order, seating
# survey up front too: a deflecting turn names its holder through it, and at a low open-file
# limit a module imported mid-turn is a descriptor it may not get (EMFILE: the proxy's 500).
from . import interrupt, journal, lock_file, queue, seats, sidecar, survey, taking, waiting
from .handle import Handle
from .line import FlockLine
from ..base import LaneStore

CONTENDED = frozenset({errno.EWOULDBLOCK, errno.EAGAIN})


class FlockStore(LaneStore):
    kind = "flock"
    blocking_io = False
    warn = staticmethod(say.warn)   # a count not added (the Gate gives its own: -q, the proxy's)

    def __init__(self, root: Root, journal_max_bytes: int | None = None,
                 priority_aging: float = DEFAULT_AGING):
        self.root = root
        self.journal_max_bytes = journal_max_bytes or journal.DEFAULT_MAX_BYTES
        self.aging = priority_aging
        self._caveat_checked: str | None = None
        self._queue_warned = False
        # The signal that calls an abandoned kernel wait off (interrupt.py) can be handled only
        # if installed from the main thread: a gate is usually built there, its turns may wait
        # in any thread (a worker pool's).
        interrupt.prepare()

    @staticmethod
    def names(stem: str) -> dict[str, str]:
        return {"lock": f"{stem}.lock", "sidecar": f"{stem}.json", "journal": f"{stem}.journal"}

    def path(self, name: str) -> str:
        return os.path.join(self.root.path, name)

    def problems(self) -> list:
        why = creation_problem(self.root)   # a missing root is fine when the first turn can make it
        return [why] if why else []

    def qualify(self, lane):
        return lane   # one machine, one root: "localhost" is this machine

    def where(self, lane) -> dict:
        names = self.names(lane.stem)
        return {"lock_path": self.path(names["lock"]), "sidecar_path": self.path(names["sidecar"]),
                "journal_path": self.path(names["journal"]),
                "detail": (f"flock(2) under {self.root.path}: a holder's lane frees the moment "
                           "its process ends, even on kill -9")}

    # -- values kept with the lanes (kept.py) --------------------------------------------------------
    def kept(self, name: str):
        from . import kept

        try:
            dir_fd = open_root(self.root, create=False)
        except FileNotFoundError:
            return None
        try:
            return (kept.read(dir_fd) or {}).get(name)
        except kept.Untrusted as why:
            raise GateUnavailable(f"{self.path(kept.NAME)}: {why}") from None
        except OSError as error:
            raise GateUnavailable(f"cannot read {self.path(kept.NAME)}: "
                                  f"{error.strerror or error}") from None
        finally:
            os.close(dir_fd)

    def keep(self, name: str, value) -> None:
        from . import kept

        dir_fd = open_root(self.root, create=True)
        try:
            kept.write(dir_fd, name, value)
        except OSError as error:
            raise GateUnavailable(f"cannot keep {name} in {self.path(kept.NAME)}: "
                                  f"{error.strerror or error}") from None
        finally:
            os.close(dir_fd)

    def make_seats(self, lane, count: int) -> None:
        """Seats 2..count made by whoever sets the count (seats.make), before the count is kept:
        no turn ever makes a seat's files, so no turn's user owns them."""
        from . import kept

        if count <= 1:   # one seat: nothing to make (forget_seats: the seats made before)
            return
        dir_fd = open_root(self.root, create=True)
        try:
            kept.may_set(dir_fd)
            try:
                before = (kept.read(dir_fd) or {}).get(seats.files_key(lane.name))
            except (kept.Untrusted, OSError):
                before = None
            made = seats.make(dir_fd, lane.stem, count,
                              before if isinstance(before, dict) else None)
            kept.write(dir_fd, seats.files_key(lane.name), {**(before or {}), **made}
                       if isinstance(before, dict) else made)
        except OSError as error:
            raise GateUnavailable(f"cannot make the seats of {lane.name} in "
                                  f"{self.path(seats.folder(lane.stem))}: "
                                  f"{error.strerror or error}") from None
        finally:
            os.close(dir_fd)

    def forget_seats(self, lane, count: int) -> None:
        """The seats past the count nobody holds now, forgotten (kept seat-files: a turn and
        `status` look at no others; a lane of one seat then looks at none). Asked after the new
        count is kept: a turn that read the old count and takes a seat past the new one after
        this look finds the new count as it takes it (taking.FlockSeats) and lets it go; one
        that took it before is held here, and kept."""
        from . import kept

        try:
            dir_fd = open_root(self.root, create=False)
        except (OSError, GateUnavailable):
            return
        try:
            values = kept.read(dir_fd) or {}
            files = values.get(seats.files_key(lane.name))
            if not isinstance(files, dict):
                return
            still = {number: made_as for number, made_as in files.items()
                     if (seat := seating.seat_number(number)) is not None
                     and (seat <= count or seats.held(dir_fd, lane.stem, seat))}
            if still != files:
                kept.write(dir_fd, seats.files_key(lane.name), still or None)
        except (kept.Untrusted, OSError):
            pass   # the map stays as it was: more seats looked at, never fewer
        finally:
            os.close(dir_fd)

    def open(self, lane, *, create: bool = True) -> Handle:
        """A handle on the lane's lock file. Raises GateUnavailable; with create=False a missing
        root or lock file gives a handle that does not exist (nobody can hold it)."""
        stem = lane.stem
        try:
            dir_fd = open_root(self.root, create=create)
        except FileNotFoundError:   # nothing to lock (exists False): one lock that never is
            handle = Handle(-1, None, self.names(stem)["lock"], None, stem=stem)
            handle.taker = seating.taker(taking.FlockSeats(self, handle))
            return handle
        except GateUnavailable as error:
            if crowded(error):   # out of descriptors, not out of a gate: it may be held
                raise GateCrowded(str(error)) from None
            raise
        handle = Handle(dir_fd, None, self.names(stem)["lock"], None, stem=stem)
        try:
            if self._caveat_checked != self.root.path:   # once per store: mounts do not move
                self._caveat_checked = self.root.path
                handle.caveat = lock_file.network_caveat(self.root.path, os.fstat(dir_fd))
            lock_file.open_file(self, handle, create)
            handle.lane_st = handle.st
            taking.count(self, handle, lane)
            handle.taker = seating.taker(taking.FlockSeats(self, handle))   # once: the count read
        except GateUnavailable:
            handle.close()
            raise
        except OSError as error:
            handle.close()
            kind = GateCrowded if crowded(error) else GateUnavailable
            raise kind(f"cannot open {self.path(handle.name)}: {error.strerror}") from None
        return handle

    # -- seats (taking.py walks them) ------------------------------------------------------------
    def on_seat(self, handle: Handle, seat: int, fd: int | None = None) -> None:
        """Point the handle at the seat's lock file (lock_file.on_seat)."""
        lock_file.on_seat(self, handle, seat, fd)

    # -- taking the lock: True only when the lane is this turn's --------------------------------
    # A flock on a file that was removed or replaced meanwhile is on an orphan inode: the next turn
    # would open the new file, two gates. So every lock taken is checked, and on a replaced file
    # the new one is locked instead; a live turn still holding an old inode (its file replaced
    # under it) keeps the lane: we let go and say busy.
    def try_lock(self, handle: Handle, rank: int = DEFAULT_RANK) -> bool:
        """One try of the lane's lock or its seats (handle.taker), kept only past no waiter of
        this class or higher (order.keep_free_lane), then claimed (a one-seat turn's record)."""
        return handle.taker.try_() and order.keep_free_lane(FlockLine(self, handle), rank) \
            and handle.taker.kept()

    # -- waiting in order (store/order.py walks it; line.py is this store's medium) ----------------
    def wait_lock(self, handle: Handle, timeout: float | None, cancel=None,
                  rank: int = DEFAULT_RANK) -> bool:
        """Block in the kernel, in the lane's queue, until the lane is ours or timeout seconds
        pass (None: forever), or cancel (a threading.Event) is set."""
        if not handle.taker.waits():   # a planted file: nothing to wait on until someone
            return False                 # removes it (seats: the others)
        return order.wait(FlockLine(self, handle, self._join(handle, rank)), timeout, cancel) \
            and handle.taker.kept()

    async def wait_lock_async(self, handle: Handle, timeout: float | None,
                              rank: int = DEFAULT_RANK) -> bool:
        """wait_lock for an asyncio task: no thread per waiter."""
        import asyncio

        if not handle.taker.waits():
            return False

        joining = asyncio.ensure_future(asyncio.to_thread(self._join, handle, rank))
        try:
            ticket = await waiting.finished(joining)
        except asyncio.CancelledError:
            if not joining.cancelled() and joining.exception() is None and joining.result():
                joining.result().leave()
            raise
        return await order.wait_async(FlockLine(self, handle, ticket), timeout) \
            and handle.taker.kept()

    def queue_of(self, handle: Handle) -> "queue.Queue | None":
        """The lane's queue (None: the lane's directory is not open)."""
        if handle.queue is None and handle.dir_fd is not None and handle.dir_fd >= 0:
            handle.queue = queue.Queue(handle.dir_fd, handle.stem, self.aging)
        return handle.queue

    def _join(self, handle: Handle, rank: int):
        """This turn's place in the queue; None when the queue is broken (once said: the wait
        then takes the kernel's order, the lane's own lock alone)."""
        found = self.queue_of(handle)
        if found is None:
            return None
        try:
            return found.join(rank, {**(handle.asker or {}), "class": CLASSES[rank],
                                     "pid": os.getpid()})
        except OSError as error:
            if not crowded(error):   # out of descriptors: the queue is fine, this turn
                self._queue_broken(found, error)   # waits in the kernel's order unannounced
            return None

    def waiting_at_or_above(self, handle: Handle, rank: int) -> bool:
        """Is a live waiter of this class or higher queued on the lane (handle: its lock held)?
        A queue that cannot be read is said once and counts as empty; one whose waiters cannot be
        asked (out of descriptors) lets the lane go and says why: never taken past them."""
        found = self.queue_of(handle)
        if found is None:
            return False
        try:
            return found.waiting_at_or_above(rank)
        except OSError as error:
            if crowded(error):   # who waits cannot be read: never take the lane past them
                self.hand_on(handle)
                raise GateCrowded(f"cannot read the queue {self.path(found.name)}: "
                                  f"{error.strerror}") from None
            self._queue_broken(found, error)
            return False

    def _queue_broken(self, found, error: OSError) -> None:
        if not self._queue_warned:
            self._queue_warned = True
            self.warn(f"queue {self.path(found.name)} unavailable "
                      f"({error.strerror or error}); waiting in the kernel's order")

    def hand_on(self, handle: Handle) -> None:
        """Holding the lane's lock but not first: let go at once for the one ahead."""
        fcntl.flock(handle.fd, fcntl.LOCK_UN)
        handle.locked = False

    def try_lane_lock(self, handle: Handle) -> bool:
        """One try of the lane's lock, never blocking (True: taken; check it: taken.checked)."""
        return self._flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)

    def _flock(self, handle: Handle, operation: int) -> bool:
        if handle.fd is None:   # refused (a planted file): busy, as for a holder
            return False
        try:
            fcntl.flock(handle.fd, operation)
            return True
        except OSError as error:
            return self.contended(handle, error)

    def contended(self, handle: Handle, error: OSError) -> bool:
        """A lock attempt's error: False when the lane is busy; else the gate is crowded or
        unavailable (raised)."""
        if error.errno in CONTENDED:
            return False
        kind = GateCrowded if crowded(error) else GateUnavailable   # ENOLCK: the kernel's locks
        raise kind(f"flock failed on {self.path(handle.name)}: {error.strerror}") from None

    def keeps_being_replaced(self, handle: Handle) -> GateUnavailable:
        return GateUnavailable(f"lock file {self.path(handle.name)} keeps being replaced")

    def release(self, handle: Handle, count: dict | None = None) -> None:
        # Closing the last fd on the description drops the flock; the file itself stays. The
        # count is added after that, so the next turn never waits for it.
        if count is not None:
            if handle.fd is not None:
                os.close(handle.fd)
                handle.fd = None
            self._add_count(handle.dir_fd, handle.stem, count)
        handle.close()

    def count(self, lane, outcome: str, **facts) -> None:
        try:
            dir_fd = open_root(self.root, create=False)
        except (OSError, GateUnavailable):
            return
        try:
            self._add_count(dir_fd, lane.stem, dict(facts, outcome=outcome))
        finally:
            os.close(dir_fd)

    def _add_count(self, dir_fd, stem: str, count: dict) -> None:
        if dir_fd is None or dir_fd < 0:
            return
        outcome = count.pop("outcome")
        try:
            from .. import counts
        except OSError as error:   # out of descriptors: an import opens a file too
            self.warn(f"turn not counted in {self.path(stem + '.counts')}: {error.strerror}")
            return
        loop = _running_loop()
        try:
            # On an event loop's thread (the proxy lets a lane go there: asyncturn.release) the
            # counts' lock is only tried: another process's turn at the file must not stall
            # every request. Held, the count is added in the loop's thread pool instead.
            counts.add(dir_fd, f"{stem}.counts", outcome, block=loop is None, **count)
        except counts.Busy:
            try:
                later = os.dup(dir_fd)   # the handle's own closes as the release returns
            except OSError as error:   # out of descriptors: the release still completes
                self.warn(f"turn not counted in {self.path(stem + '.counts')}: "
                          f"{error.strerror}")
                return
            loop.run_in_executor(None, self._count_later, later, stem, dict(count,
                                                                             outcome=outcome))
        except counts.NotCounted as error:   # the turn goes on; silence would hide a reset
            if outcome != "fail_open":   # a failing gate has said its one line already
                self.warn(f"turn not counted in {self.path(stem + '.counts')}: {error}")

    def _count_later(self, dir_fd: int, stem: str, count: dict) -> None:
        try:
            self._add_count(dir_fd, stem, count)
        finally:
            os.close(dir_fd)

    def counts(self, facts) -> dict:
        from .. import counts

        return counts.read(facts.lock_path[:-len(".lock")] + ".counts")

    # -- the holder record (sidecar) and events (journal) ------------------------------------------
    def write_holder(self, handle: Handle, record: dict) -> None:
        if handle.record is not None:
            handle.record.close()
            handle.record = None
        # status compares the inode with the file at the path: a replaced lock file is two gates.
        record = {**record, "lock_inode": handle.st.st_ino if handle.st else None}
        try:
            fd, handle.record_fd = handle.record_fd, None
            handle.record = sidecar.write(handle.dir_fd, handle.record_name, record, fd)
        except OSError as error:
            raise RecordNotWritten(error.strerror or str(error)) from None

    def write_release(self, handle: Handle, full_record, fields: dict) -> None:
        if handle.record is None:   # the acquire-time write failed: try the whole record now
            self.write_holder(handle, {**full_record(), **fields})
            return
        try:
            sidecar.extend(handle.record, fields)
        except OSError as error:
            raise RecordNotWritten(error.strerror or str(error)) from None

    def append_event(self, handle: Handle, *events: dict) -> None:
        if handle.dir_fd is None or handle.dir_fd < 0:
            return
        name = self.names(handle.stem)["journal"]
        if handle.locked and handle.journal_fd is None:
            # A holder's first events: rotate if due (only seat 1's holder rotates, so two never
            # race: two renames would put an empty journal over the old one), and keep the
            # descriptor for the turn's later events.
            try:
                handle.journal_fd = journal.open_for_append(
                    handle.dir_fd, name,
                    self.journal_max_bytes if handle.seat == 1 else float("inf"))
            except OSError:
                handle.journal_fd = None   # the append below reports the problem
        try:
            journal.append(handle.dir_fd, name, list(events), handle.journal_fd)
        except OSError as error:
            raise RecordNotWritten(error.strerror or str(error)) from None

    def event_handle(self, lane, again: bool = False) -> Handle | None:
        """Somewhere to record a fail-open turn when the lock file itself could not be opened."""
        try:
            dir_fd = open_root(self.root, create=False)
        except (OSError, GateUnavailable):
            return None
        return Handle(dir_fd, None, self.names(lane.stem)["lock"], None, stem=lane.stem)

    # -- inspection ----------------------------------------------------------------------------------
    def survey(self, lane=None, handle=None) -> list:
        if lane is None:
            return [survey.facts(self.root.path, stem, aging=self.aging) for stem in
                    survey.lane_stems(self.root.path)]
        # handle: a turn asks on its own path (a deflection, a hand-over): no /proc/locks read
        found = survey.facts(self.root.path, lane.stem, lane.name, self.aging,
                             kernel=handle is None,
                             seated=None if handle is None else (handle.seats, handle.past))
        if handle is not None and handle.refused and handle.seat == 1:
            found.problem_lock = handle.refused
        return [found]

    def survey_all(self, most: int) -> list:
        """Every lane's facts, at most `most` of them: the ones whose files changed last, chosen
        with one lstat each before any is judged (survey.latest)."""
        stems, self.left_out = survey.latest(self.root.path, survey.lane_stems(self.root.path),
                                             most)
        return [survey.facts(self.root.path, stem, aging=self.aging) for stem in stems]

    def waiting(self, lane) -> list:
        return survey.queue_rows(self.root.path, lane.stem, self.aging, kernel=False)

    def holding(self, lane, handle=None) -> tuple:
        return survey.holding_any(self.root.path, lane.stem)

    def seats_holding(self, lane, handle=None) -> tuple:
        """Each seat's record read as holding() reads seat 1's (never /proc/locks): seat 1 and
        every seat whose lock file exists, past the count too (a turn still on it is real)."""
        held, ago = survey.holding(self.path(self.names(lane.stem)["sidecar"]))
        count, agos = int(bool(held)), [ago]
        try:
            dir_fd = os.open(self.root.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return count, ago   # no root yet: no seat files either
        try:
            others = seats.made_here(dir_fd, lane.name)
        except OSError:
            others = []
        finally:
            os.close(dir_fd)
        for seat in others:
            record = seats.record_name(seats.lock_name(lane.stem, seat))
            held, ago = survey.holding(self.path(record))
            count += bool(held)
            agos.append(None if held else ago)
        agos = [ago for ago in agos if ago is not None]
        return count, min(agos) if agos else None

    def claim_witness(self, lane, who: str | None = None) -> tuple:
        """A flock on STEM.witness beside the lock (never removed, like the lock): the kernel lets
        go of it when the witness ends, and a witness standing by takes over."""
        from .witness_file import claim

        dir_fd = open_root(self.root, create=True)   # GateUnavailable when it cannot be had
        try:
            return claim(dir_fd, f"{lane.stem}.witness", who)
        except OSError as error:
            raise GateUnavailable(f"{self.path(lane.stem + '.witness')}: "
                                  f"{error.strerror or error}") from None
        finally:
            os.close(dir_fd)

    def lane_names(self) -> list[str]:
        return [survey.lane_name(stem) for stem in survey.lane_stems(self.root.path)]

    def events(self, lane, since: float | None) -> tuple:
        return journal.read(self.where(lane)["journal_path"], since=since)


def _running_loop():
    """The event loop running in this thread, or None (a plain thread may wait for a lock).
    asyncio is not imported for the asking: a process that never imported it runs no loop
    (`run` imports nothing slow)."""
    import sys

    asyncio = sys.modules.get("asyncio")
    if asyncio is None:
        return None
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
