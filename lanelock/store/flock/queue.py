"""The waiting turns of a flock lane, kept by the kernel.

Each waiting turn is a file in the lane's queue directory (STEM.queue/ under the lock root, mode
1777 like /tmp: every user's turns queue there), named ARRIVAL.RANK.PID.RANDOM -- ARRIVAL in
CLOCK_MONOTONIC nanoseconds, one clock for every process of the machine -- holding a line of JSON
for `status` (session, class). The turn holds an exclusive flock on its file for as long as it
waits; the file appears (rename) already locked, so a file nobody locks is a waiter that is gone:
one that got the lane and left, or one killed with kill -9 (the kernel dropped its lock). Gone
files are skipped by everyone and removed by whoever notices; no file a live process holds is
ever removed, and nobody has to clean up after a crash for the queue to move.

The order, and every rule of who goes next, are store/order.py's; this module is the medium: the
entries, whether each still waits (its file locked), whether it is stopped (/proc), who it is
(the file's line), and the waits on them (EntryWait, wait_mine).
"""

from __future__ import annotations

import _thread
import errno
import fcntl
import json
import os
import stat
import time

from ... import locks, proc
from ...errors import crowded
from ...priority import TOP, next_step
from .. import order

RING_ASKS = 3   # how many times a waiter's entry is asked while its owner keeps ringing it
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_JOINING = ".new."      # a file of a join not yet renamed into the queue (locked_file)
_SWEEP_AT_MOST = 4      # such files a look removes at most: planted ones cost a look little
_ABANDONED = 10.0       # seconds an unlocked such file must be old to be a killed join's


class Entry:
    """One queued turn, as its file name says (ARRIVAL.RANK.PID.RANDOM), read at one moment:
    waited is the seconds it had waited then (an order.Queued)."""

    __slots__ = ("name", "arrival", "rank", "pid", "waited")

    def __init__(self, name: str, arrival: int, rank: int, pid: int, waited: float = 0.0):
        self.name, self.arrival, self.rank, self.pid = name, arrival, rank, pid
        self.waited = waited

    @classmethod
    def parse(cls, name: str, now_ns: int) -> "Entry | None":
        parts = name.split(".")
        if len(parts) != 4 or not all(part.isdigit() for part in parts[:3]):
            return None
        rank, arrival = int(parts[1]), int(parts[0])
        return cls(name, arrival, rank, int(parts[2]), (now_ns - arrival) / 1e9) \
            if rank <= TOP else None

    def at(self, now_ns: int) -> "Entry":
        """The same entry read at now_ns."""
        return Entry(self.name, self.arrival, self.rank, self.pid, (now_ns - self.arrival) / 1e9)

    @property
    def tiebreak(self) -> str:
        return self.name


# This process's live tickets, by file name -> what to call when each leaves. A waiter whose
# turn comes after another turn of this same process waits for it here, not in the kernel: the
# kernel wait costs a thread per file (store/flock/waiting.py), a thread for each of a proxy's
# waiting requests; this costs none.
_MINE: dict[str, list] = {}
_GUARD = _thread.allocate_lock()


class Ticket:
    """This turn's place in the queue: its file, locked, until leave()."""

    def __init__(self, queue: "Queue", entry: Entry, fd: int):
        self.queue, self.entry, self.fd = queue, entry, fd
        with _GUARD:
            _MINE[entry.name] = []

    def leave(self) -> None:
        if self.fd is None:
            return
        try:
            os.unlink(self.entry.name, dir_fd=self.queue.dir_fd)
        except OSError:
            pass
        os.close(self.fd)   # after the unlink: nobody mistakes the file for a gone waiter's
        self.fd = None
        with _GUARD:
            wakers = _MINE.pop(self.entry.name, [])
        for wake in wakers:
            wake()

    def ring(self) -> None:
        """The waiters just behind this ticket look again; the ticket keeps its place. Its file
        is replaced under the same name by a copy locked before it appears (rename: the name
        never goes missing), then the old one is let go: whoever waits on the old one wakes and
        finds the same entry still waiting. A PostgreSQL host's head rings as it comes first,
        so the waiter that is now next connects ahead (pg/hostqueue.py). A ring that cannot be
        made leaves the waiter behind to look at its next moment (never raises)."""
        if self.fd is None:
            return
        try:
            temp, fd = self.queue.locked_file(os.pread(self.fd, 65536, 0))
        except OSError:
            return
        try:
            os.rename(temp, self.entry.name, src_dir_fd=self.queue.dir_fd,
                      dst_dir_fd=self.queue.dir_fd)
        except OSError:
            self.queue._drop(temp, fd)
            return
        old, self.fd = self.fd, fd
        os.close(old)
        with _GUARD:
            wakers = _MINE.get(self.entry.name, [])
            _MINE[self.entry.name] = []
        for wake in wakers:
            wake()

    def ahead(self, now: int | None = None) -> Entry | None:
        """The live entry just ahead of this one in the order at `now` (CLOCK_MONOTONIC ns;
        default: now), or None when first. Only the entries ahead are asked whether they live,
        nearest first, and only until one does: a waiter alone asks nothing."""
        now = time.monotonic_ns() if now is None else now
        return order.just_ahead(self.entry.at(now), self.queue.listed(now, sweep=True),
                                self.queue.aging, self.queue)

    def next_step(self, now: int | None = None) -> float | None:
        """Seconds from `now` until this turn's class rises a step (None: at the top, or no
        aging), read with the same `now` as ahead()."""
        now = time.monotonic_ns() if now is None else now
        return next_step(self.entry.rank, (now - self.entry.arrival) / 1e9, self.queue.aging)


class Queue:
    """The queue directory of one lane (dir_fd: the lock root)."""

    def __init__(self, root_fd: int, stem: str, aging: float):
        self.root_fd, self.name, self.aging = root_fd, f"{stem}.queue", aging
        self.dir_fd: int | None = None

    def open(self, create: bool) -> bool:
        """Open the directory (make it when create); False when there is none yet."""
        if self.dir_fd is not None:
            return True
        try:
            self.dir_fd = os.open(self.name, _DIR_FLAGS, dir_fd=self.root_fd)
            return True
        except FileNotFoundError:
            if not create:
                return False
        try:
            os.mkdir(self.name, 0o1777, dir_fd=self.root_fd)
            os.chmod(self.name, 0o1777 | stat.S_ISVTX, dir_fd=self.root_fd)   # past the umask
        except FileExistsError:
            pass
        self.dir_fd = os.open(self.name, _DIR_FLAGS, dir_fd=self.root_fd)
        return True

    def close(self) -> None:
        if self.dir_fd is not None:
            os.close(self.dir_fd)
            self.dir_fd = None

    def join(self, rank: int, facts: dict, arrival: int | None = None) -> Ticket:
        """Queue this turn: its file, locked before it appears (OSError: the queue is broken).
        arrival: when it began waiting (CLOCK_MONOTONIC ns; default: now) -- a turn that waited
        elsewhere and comes back keeps its place."""
        self.open(create=True)
        temp, fd = self.locked_file((json.dumps(facts) + "\n").encode())
        try:
            arrival = time.monotonic_ns() if arrival is None else arrival
            entry = Entry(f"{arrival:020d}.{rank}.{os.getpid()}.{os.urandom(4).hex()}", arrival,
                          rank, os.getpid())
            os.rename(temp, entry.name, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)
        except BaseException:
            self._drop(temp, fd)
            raise
        return Ticket(self, entry, fd)

    def locked_file(self, content: bytes) -> tuple[str, int]:
        """A new file of the queue under a temporary name, locked before any name of an entry is
        given it (rename): (its name, its descriptor). OSError: the queue is broken."""
        temp = f"{_JOINING}{os.getpid()}.{os.urandom(6).hex()}"
        fd = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW,
                     0o644, dir_fd=self.dir_fd)
        try:
            # Readable by every user past any umask (077 included): a waiter behind it opens it
            # to wait on its lock, and `status` reads who waits.
            os.fchmod(fd, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.write(fd, content)
        except BaseException:
            self._drop(temp, fd)
            raise
        return temp, fd

    def _drop(self, temp: str, fd: int) -> None:
        try:
            os.unlink(temp, dir_fd=self.dir_fd)
        except OSError:
            pass
        os.close(fd)

    def listed(self, now: int | None = None, sweep: bool = False) -> list[Entry]:
        """Every entry in the directory, its waiter alive or gone (no question asked yet), read at
        now (CLOCK_MONOTONIC ns; default: now). sweep: a waiting turn's look also removes a few
        files of joins that never finished (_sweep); `status` changes nothing."""
        if not self.open(create=False):
            return []
        now = time.monotonic_ns() if now is None else now
        names = os.listdir(self.dir_fd)
        if sweep:
            self._sweep([name for name in names if name.startswith(_JOINING)][:_SWEEP_AT_MOST])
        return [entry for name in names if (entry := Entry.parse(name, now)) is not None]

    def _sweep(self, names: list[str]) -> None:
        """Remove the files of joins killed before they were renamed into the queue (kill -9
        between locked_file() and the rename): no listing counts them, but nothing else would
        ever remove them. Such a file is unlocked and old: a live join locks its file
        microseconds after making it and keeps it locked until the rename, so an unlocked one
        older than _ABANDONED seconds is no live join's."""
        for name in names:
            try:
                fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK,
                             dir_fd=self.dir_fd)
            except OSError:
                continue
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or time.time() - st.st_mtime < _ABANDONED:
                    continue
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError:
                continue   # locked: a join going on (or not ours to ask)
            finally:
                os.close(fd)
            self._remove(name)   # another user's (sticky directory): left to her own turns

    # -- the medium's answers to the order's rules (order.Entries) ---------------------------------
    def waits(self, entry: Entry) -> bool:
        """Does the entry's waiter still wait? Asked of the entry itself (a non-blocking lock
        attempt on its file: never /proc/locks on a turn's path); the file of a waiter found gone
        is removed on the way."""
        alive = self._alive(entry)
        if alive is False:
            self._remove(entry.name)
        return bool(alive)

    def stopped(self, entry: Entry) -> bool:
        return proc.is_stopped(entry.pid)   # every waiter is a process of this machine

    def who(self, entry: Entry) -> dict:
        return {**self._facts(entry.name), "pid": entry.pid}

    def live_for_status(self) -> list[Entry]:
        """The entries whose turn still waits, for `status`: /proc/locks read once, after the
        listing (a file listed was locked before it appeared, so a waiter still there shows in
        it) -- `status` takes no lock of any kind, and reads what it looks at without changing
        it. Without /proc/locks, each file is asked."""
        entries = self.listed()
        held = locks.held_files() if entries else None
        if held is None:
            return [entry for entry in entries if self._alive(entry)]
        return [entry for entry in entries if self._held(entry, held)]

    def live_asked(self) -> list[Entry]:
        """The entries whose turn still waits, each asked itself (a turn's own path: no
        /proc/locks); files of waiters gone are left for the waiters to remove."""
        return [entry for entry in self.listed() if self._alive(entry)]

    def _held(self, entry: Entry, held: set) -> bool:
        try:
            st = os.stat(entry.name, dir_fd=self.dir_fd, follow_symlinks=False)
        except OSError:
            return False
        return (locks.device_of(st), st.st_ino) in held and genuine(st, entry.pid)

    def _remove(self, name: str) -> None:
        try:   # nobody holds it: its waiter is gone, and the file can never be locked again
            os.unlink(name, dir_fd=self.dir_fd)
        except OSError:
            pass   # another user's (sticky directory) or removed already: skipped all the same

    def _alive(self, entry: Entry) -> bool | None:
        """True while the entry's waiter waits (its file locked), False when it is gone; None
        for a file that is no waiter's entry (not genuine(): left alone, counted by no one).
        Gone only while the name still names the file found unlocked: a waiter that rings
        (Ticket.ring) puts a locked copy under its name and then lets the old file go, and a
        look that opened the old file before the rename and tried its lock after saw a live
        waiter as gone -- and removed its file (a PostgreSQL host's head vanished from its host
        queue, and the waiter behind it joined the server as a second head). The file now under
        the name is asked in its turn (RING_ASKS at most: only its owner renames onto a name,
        and it rings once it has joined)."""
        for _ in range(RING_ASKS):
            try:
                fd = os.open(entry.name,
                             os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK,
                             dir_fd=self.dir_fd)
            except OSError as error:
                if crowded(error):   # not asked is not gone: its file stays, the asker hears why
                    raise
                return False
            try:
                st = os.fstat(fd)
                if not genuine(st, entry.pid):
                    return None
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                if not self._renamed_onto(entry.name, st):
                    return False
            except OSError as error:
                if crowded(error):   # its /proc status unread, or no lock record: not gone either
                    raise
                return error.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
            finally:
                os.close(fd)
        return True   # rung each time it was asked: its owner is there

    def _renamed_onto(self, name: str, st: os.stat_result) -> bool:
        """Does the name now name another file than st's (a ring's copy)?"""
        try:
            now = os.stat(name, dir_fd=self.dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return False   # left (or removed) meanwhile: gone all the same
        return (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino)

    def waiting_at_or_above(self, rank: int) -> bool:
        """order.waiting_at_or_above over this queue (no barging)."""
        return order.waiting_at_or_above(self.listed(), rank, self.aging, self)

    def describe(self, kernel: bool = True) -> list[dict]:
        """The live entries in order, for `status` (order.status_rows). kernel=False: on a
        turn's path, each entry asked itself."""
        live = self.live_for_status() if kernel else self.live_asked()
        return order.status_rows(live, self.aging, self)

    def _facts(self, name: str) -> dict:
        try:
            fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK,
                         dir_fd=self.dir_fd)
        except OSError:
            return {}
        try:
            data = json.loads(os.read(fd, 4096) or b"{}")
        except ValueError:
            data = {}
        finally:
            os.close(fd)
        return data if isinstance(data, dict) else {}


def genuine(st: os.stat_result, pid: int) -> bool:
    """Is the file a waiter's own entry: a regular file made by the user its pid runs as? Anyone
    can put a file in the queue directory (1777); one named for another user's process (a
    locked "pid 1"), or a FIFO, must queue no one and blame no one. A user's entry naming one of
    their own processes can only make them wait in line, as a real turn of theirs could."""
    return stat.S_ISREG(st.st_mode) and st.st_uid == proc.files_uid(pid, strict=True)


def is_mine(entry: Entry) -> bool:
    """Is the entry a live ticket of this very process (waited for without the kernel)?"""
    return entry.pid == os.getpid() and entry.name in _MINE


def _listen(entry: Entry, wake) -> bool:
    """Call wake when the entry's ticket leaves; False when it has left already."""
    with _GUARD:
        wakers = _MINE.get(entry.name)
        if wakers is None:
            return False
        wakers.append(wake)
        return True


def _forget(entry: Entry, wake) -> None:
    with _GUARD:
        wakers = _MINE.get(entry.name)
        if wakers is not None and wake in wakers:
            wakers.remove(wake)


def wait_mine(entry: Entry, timeout: float | None, cancel=None) -> None:
    """Until this process's ticket of entry leaves, timeout passes or cancel (an Event) is set."""
    import threading

    left = threading.Event()
    if not _listen(entry, left.set):
        return
    try:
        if cancel is None:
            left.wait(timeout)
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        while not left.is_set() and not cancel.is_set():   # slices only to notice a cancel
            rest = None if deadline is None else deadline - time.monotonic()
            if rest is not None and rest <= 0:
                return
            left.wait(0.05 if rest is None else min(0.05, rest))
    finally:
        _forget(entry, left.set)


async def wait_mine_async(entry: Entry, timeout: float | None) -> None:
    """wait_mine for an asyncio task: the leaving ticket resolves a future on the loop."""
    import asyncio

    loop = asyncio.get_running_loop()
    left = loop.create_future()

    def resolve() -> None:
        if not left.done():
            left.set_result(None)

    def wake() -> None:
        try:
            loop.call_soon_threadsafe(resolve)
        except RuntimeError:   # the loop is closed: nobody waits
            pass

    if not _listen(entry, wake):
        return
    try:
        await asyncio.wait_for(asyncio.shield(left), timeout)
    except asyncio.TimeoutError:
        pass
    finally:
        _forget(entry, wake)


class Rung:
    """An entry watched from the moment this is made until its waiter rings (Ticket.ring) or
    leaves: made BEFORE the caller's last look at what the ring follows, so a ring between that
    look and wait() is not missed -- a waiter of another process lets the file opened here go
    (the kernel wait on it returns), one of this process calls the waker registered here.
    FileNotFoundError: the entry left already."""

    __slots__ = ("entry", "rung", "wait_fd")

    def __init__(self, queue: "Queue", entry: Entry):
        import threading

        self.entry, self.rung, self.wait_fd = entry, None, None
        if is_mine(entry):
            self.rung = threading.Event()
            if not _listen(entry, self.rung.set):
                raise FileNotFoundError(entry.name)
        else:
            self.wait_fd = EntryWait(queue, entry)

    def wait(self, timeout: float) -> None:
        """Until the ring or the leave, or timeout seconds."""
        if self.rung is not None:
            self.rung.wait(timeout)
            return
        from . import waiting

        try:
            waiting.wait(self.wait_fd, timeout)
        except OSError:
            pass   # the entry went away as we waited: the caller looks again

    def close(self) -> None:
        if self.rung is not None:
            _forget(self.entry, self.rung.set)
        if self.wait_fd is not None:
            self.wait_fd.close()


class EntryWait:
    """A descriptor on the entry just ahead, for waiting.wait (it locks handle.fd)."""

    __slots__ = ("fd",)

    def __init__(self, queue: Queue, entry: Entry):
        self.fd = os.open(entry.name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK,
                          dir_fd=queue.dir_fd)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
