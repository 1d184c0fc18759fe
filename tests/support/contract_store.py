"""A lane store made of the twelve abstract methods of lanelock/store/base.py and nothing else:
tests/test_store_contract.py holds it to the same tests as the flock and PostgreSQL stores, the
proof that the contract is complete. Its medium differs from both on purpose: one file for every
lane, each lane one byte of it, locked with open-file-description record locks (F_OFD_SETLK,
fcntl(2)) that the kernel drops when the holder's descriptor closes; the holder record, the events
and the counts are plain files beside it."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import struct
import threading
import time

from lanelock.lanes import name_from_stem
from lanelock.priority import next_step
from lanelock.proc import is_stopped
from lanelock.store import counts, order, outlived
from lanelock.store.base import LaneFacts, LaneStore, LockHandle

FLAGS = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC


def _lock(fd: int, offset: int, command: int, kind: int = fcntl.F_WRLCK) -> bool:
    """One byte's OFD lock (struct flock: type, whence, start, len, pid 0). False: contended."""
    try:
        fcntl.fcntl(fd, command, struct.pack("@hhqqi4x", kind, os.SEEK_SET, offset, 1, 0))
        return True
    except BlockingIOError:
        return False


def _wait_byte(path: str, offset: int, kind: int, timeout: float | None, cancel=None,
               flags: int = FLAGS):
    """A thread blocks in the kernel for the byte's lock on a description of its own; that
    description, holding the lock, or None (timeout, cancel: the thread lets go when it gets
    there)."""
    fd, got, mutex, gave_up = os.open(path, flags, 0o666), threading.Event(), \
        threading.Lock(), []

    def block() -> None:
        _lock(fd, offset, fcntl.F_OFD_SETLKW, kind)
        with mutex:
            os.close(fd) if gave_up else got.set()

    threading.Thread(target=block, daemon=True).start()
    deadline = None if timeout is None else time.monotonic() + timeout
    while not got.is_set() and not (cancel is not None and cancel.is_set()):
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            break
        # The kernel wakes the thread, the thread this one; slices only to notice a cancel.
        got.wait(left if cancel is None else min(0.05, left or 0.05))
    with mutex:
        if not got.is_set() or (cancel is not None and cancel.is_set()):
            gave_up.append(True)
            if got.is_set():
                os.close(fd)
            return None
    return fd


class Handle(LockHandle):
    def __init__(self, store: "ContractStore", lane):
        self.lane, self.offset = lane, store.offset(lane.name)
        self.fd: int | None = os.open(store.lock_file, FLAGS, 0o666)
        self.ident = ("contract", store.lock_file, self.offset)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class ContractStore(LaneStore):
    kind = "contract"

    def __init__(self, root: str):
        self.root, self.lock_file = root, os.path.join(root, "lanes.lock")
        os.makedirs(root, exist_ok=True)

    def offset(self, name: str) -> int:
        return int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "big")

    def _file(self, stem: str, kind: str) -> str:
        return os.path.join(self.root, f"{stem}.{kind}")

    def where(self, lane) -> dict:
        return {"lock_path": f"{self.lock_file}#{self.offset(lane.name)}",
                "sidecar_path": self._file(lane.stem, "holder"),
                "journal_path": self._file(lane.stem, "events"),
                "detail": f"OFD record locks on {self.lock_file}, one byte per lane"}

    def qualify(self, lane):
        return lane

    def open(self, lane, *, create: bool = True) -> Handle:
        return Handle(self, lane)

    def try_lock(self, handle: Handle, rank: int = 1) -> bool:
        return _lock(handle.fd, handle.offset, fcntl.F_OFD_SETLK)

    def wait_lock(self, handle: Handle, timeout: float | None, cancel=None, rank: int = 1) -> bool:
        if timeout is not None and timeout <= 0:
            return self.try_lock(handle)
        fd = _wait_byte(self.lock_file, handle.offset, fcntl.F_WRLCK, timeout, cancel)
        if fd is None:
            return False
        os.close(handle.fd)
        handle.fd = fd
        return True

    def release(self, handle: Handle, count: dict | None = None) -> None:
        handle.close()
        if count is not None:
            count = dict(count)
            self.count(handle.lane, count.pop("outcome"), **count)

    def write_holder(self, handle: Handle, record: dict) -> None:
        path = self._file(handle.lane.stem, "holder")
        with open(path + ".tmp", "w") as file:
            json.dump(record, file)
        os.replace(path + ".tmp", path)

    def append_event(self, handle: Handle, *events: dict) -> None:
        data = "".join(json.dumps(event) + "\n" for event in events).encode()
        fd = os.open(self._file(handle.lane.stem, "events"),
                     os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o666)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)

    def count(self, lane, outcome: str, **facts) -> None:
        dir_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            counts.add(dir_fd, f"{self.offset(lane.name)}.counts", outcome, **facts)
        except counts.NotCounted:
            pass
        finally:
            os.close(dir_fd)

    def counts(self, facts) -> dict:
        return counts.read(os.path.join(self.root, facts.lock_path.rpartition("#")[2] + ".counts"))

    def survey(self, lane=None, handle=None) -> list:
        stems = [lane.stem] if lane is not None else sorted(
            name[:-len(".holder")] for name in os.listdir(self.root) if name.endswith(".holder"))
        return [self._facts(stem, lane.name if lane else name_from_stem(stem)) for stem in stems]

    def _facts(self, stem: str, name: str) -> LaneFacts:
        facts = LaneFacts(name, f"{self.lock_file}#{self.offset(name)}", self._file(stem, "holder"))
        facts.kernel_source = "probe"   # an OFD lock names no pid
        probe = os.open(self.lock_file, FLAGS, 0o666)
        try:
            facts.held = not _lock(probe, self.offset(name), fcntl.F_OFD_SETLK)
        finally:
            os.close(probe)   # a probe that got the byte lets go at once
        try:
            with open(facts.sidecar_path) as file:
                facts.record = json.load(file)
        except FileNotFoundError:
            facts.record_problem, facts.record_absent = "no holder record yet", True
        except ValueError:
            facts.record_problem = "holder record is not JSON"
        facts.exists = facts.held or not facts.record_absent
        if isinstance(facts.record, dict):
            from lanelock.proc import start_ticks

            ticks = start_ticks(facts.record.get("pid", -1))
            facts.alive = ticks is not None and ticks == facts.record.get("start_ticks")
            facts.matches = bool(facts.held) and facts.alive and "released_at" not in facts.record
        return facts

    def events(self, lane, since: float | None) -> tuple:
        try:
            with open(self._file(lane.stem, "events")) as file:
                lines = file.read().splitlines()
        except FileNotFoundError:
            return [], 0
        events = [json.loads(line) for line in lines if line.strip()]
        return [event for event in events if since is None or event.get("ts", 0) >= since], 0


# -- the same store keeping its waiters in order: a medium for store/order.py, not the policy ------
class OrderedContractStore(ContractStore):
    """ContractStore whose waiters queue: it gives store/order.py a medium (ContractLine, and
    QUEUE's answers about entries) and every rule of who goes next -- the order, the stopped
    waiter passed over, no barging, a killed turn's command waited for -- comes from there. A
    waiting turn is a file in LANE.queue/ named ARRIVAL.RANK.PID.RANDOM (ARRIVAL: CLOCK_MONOTONIC
    ns), alive while its waiter holds an OFD lock on its first byte."""

    kind = "contract-ordered"

    def __init__(self, root: str, aging: float | None = None):
        super().__init__(root)
        self.aging = float(os.environ.get("LANELOCK_PRIORITY_AGING", "30")) if aging is None \
            else aging

    def try_lock(self, handle: Handle, rank: int = 1) -> bool:
        line = ContractLine(self, handle)
        return line.checked(super().try_lock(handle)) and order.keep_free_lane(line, rank)

    def wait_lock(self, handle: Handle, timeout: float | None, cancel=None, rank: int = 1) -> bool:
        return order.wait(ContractLine(self, handle, _join(self._queue_dir(handle), rank)),
                          timeout, cancel)

    def _queue_dir(self, handle: Handle) -> str:
        return os.path.join(self.root, f"{handle.offset}.queue")


class Entry:
    """One entry file, read at one moment (an order.Queued)."""

    __slots__ = ("path", "arrival", "rank", "pid", "waited")

    def __init__(self, path: str, arrival: int, rank: int, pid: int, now: int):
        self.path, self.arrival, self.rank, self.pid = path, arrival, rank, pid
        self.waited = (now - arrival) / 1e9

    @property
    def tiebreak(self) -> str:
        return self.path


class _Queue:
    """What the order asks about entries (order.Entries): every waiter is a process of this
    machine, alive while it holds its entry's byte."""

    def waits(self, entry: Entry) -> bool:
        return _alive(entry.path)

    def stopped(self, entry: Entry) -> bool:
        return is_stopped(entry.pid)

    def who(self, entry: Entry) -> dict:
        return {"pid": entry.pid}


QUEUE = _Queue()


class Ticket:
    """This turn's entry, locked until leave()."""

    def __init__(self, path: str, fd: int, arrival: int, rank: int):
        self.path, self.fd, self.arrival, self.rank = path, fd, arrival, rank

    def at(self, now: int) -> Entry:
        return Entry(self.path, self.arrival, self.rank, os.getpid(), now)

    def leave(self) -> None:
        if self.fd is not None:
            os.unlink(self.path)
            os.close(self.fd)
            self.fd = None


def _join(folder: str, rank: int) -> Ticket:
    os.makedirs(folder, exist_ok=True)
    arrival = time.monotonic_ns()
    name = f"{arrival:020d}.{rank}.{os.getpid()}.{os.urandom(4).hex()}"
    fd = os.open(os.path.join(folder, "." + name), FLAGS, 0o666)
    _lock(fd, 0, fcntl.F_OFD_SETLK)   # locked before it appears
    os.rename(os.path.join(folder, "." + name), os.path.join(folder, name))
    return Ticket(os.path.join(folder, name), fd, arrival, rank)


class ContractLine(order.Line):
    def look(self, cancel=None) -> tuple:
        now, aging = time.monotonic_ns(), self.store.aging
        mine = self.ticket.at(now)
        return (order.just_ahead(mine, _entries(os.path.dirname(mine.path), now), aging, QUEUE),
                next_step(mine.rank, mine.waited, aging))

    def lock(self, timeout: float | None, cancel=None) -> bool:
        if timeout is not None and timeout <= 0:
            return ContractStore.try_lock(self.store, self.handle)
        return ContractStore.wait_lock(self.store, self.handle, timeout, cancel)

    def checked(self, got: bool) -> bool:
        """The lane's byte taken: a killed turn's command still running is the walk's to wait
        for (the holder record names it)."""
        if got:
            try:
                with open(self.store._file(self.handle.lane.stem, "holder")) as file:
                    record = json.load(file)
            except (OSError, ValueError):
                record = None
            self.outlived = outlived.running_command(record if isinstance(record, dict) else None)
        return got

    def hand_on(self) -> None:
        _lock(self.handle.fd, self.handle.offset, fcntl.F_OFD_SETLK, fcntl.F_UNLCK)

    def waiting_at_or_above(self, rank: int) -> bool:
        return order.waiting_at_or_above(_entries(self.store._queue_dir(self.handle),
                                                  time.monotonic_ns()),
                                         rank, self.store.aging, QUEUE)

    def sees_stop(self, entry) -> bool:
        return True

    def behind(self, entry, timeout: float | None, cancel=None) -> None:
        try:   # until its waiter lets go (or dies)
            fd = _wait_byte(entry.path, 0, fcntl.F_RDLCK, timeout, cancel,
                            os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return   # it left as we looked: look again
        if fd is not None:
            os.close(fd)

    def leave(self) -> None:
        if self.ticket is not None:
            self.ticket.leave()


def _entries(folder: str, now: int) -> list[Entry]:
    """Every entry file, its waiter alive or gone, read at now."""
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        parts = name.split(".")
        if len(parts) == 4 and all(part.isdigit() for part in parts[:3]):
            found.append(Entry(os.path.join(folder, name), int(parts[0]), int(parts[1]),
                               int(parts[2]), now))
    return found


def _alive(path: str) -> bool:
    """Does a waiter hold the entry's byte? (A probe that gets it lets go at once.)"""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        return not _lock(fd, 0, fcntl.F_OFD_SETLK, fcntl.F_RDLCK)
    finally:
        os.close(fd)
