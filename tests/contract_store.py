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
from lanelock.store import counts
from lanelock.store.base import LaneFacts, LaneStore, LockHandle

FLAGS = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC


def _lock(fd: int, offset: int, command: int, kind: int = fcntl.F_WRLCK) -> bool:
    """One byte's OFD lock (struct flock: type, whence, start, len, pid 0). False: contended."""
    try:
        fcntl.fcntl(fd, command, struct.pack("@hhqqi4x", kind, os.SEEK_SET, offset, 1, 0))
        return True
    except BlockingIOError:
        return False


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
        """A thread blocks in the kernel on a description of its own; the handle adopts it once
        it holds the byte. Given up (timeout, cancel), the thread lets go when it gets there."""
        if timeout is not None and timeout <= 0:
            return self.try_lock(handle)
        fd, got, mutex, gave_up = os.open(self.lock_file, FLAGS), threading.Event(), \
            threading.Lock(), []

        def block() -> None:
            _lock(fd, handle.offset, fcntl.F_OFD_SETLKW)
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
