"""What the flock store can say about a lane without taking it: the lock file, the kernel's view
of it (/proc/locks) and the holder record beside it. Facts only; inspection/judge.py decides.

Never takes the lock (asking must never make a turn deflect), except where /proc/locks cannot be
read: then it probes once and says so (kernel_source "probe"). Every look at another process is
racy and shows '?' rather than failing.
"""

from __future__ import annotations

import fcntl
import os
import stat

from ... import locks, proc
from . import seats, sidecar
from .. import seating
from ..base import LaneFacts
from ..record_facts import read_record


def lane_stems(root: str) -> list[str]:
    """Every lane under the root, by lock file."""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    return sorted(name[:-5] for name in names if name.endswith(".lock") and not name.startswith("."))


def latest(root: str, stems: list[str], most: int) -> tuple[list[str], int]:
    """(the `most` stems whose record -- else lock file -- changed last, in name order; how many
    were left out): one lstat each, nothing opened, so a root anyone filled with lanes is chosen
    from in bounded memory and little time before any lane is judged."""
    if len(stems) <= most:
        return stems, 0
    import heapq

    def changed(stem: str) -> float:
        for name in (f"{stem}.json", f"{stem}.lock"):
            try:
                return os.lstat(os.path.join(root, name)).st_mtime
            except OSError:
                continue
        return 0.0

    chosen = heapq.nlargest(most, stems, key=changed)
    return sorted(chosen), len(stems) - most


def facts(root: str, stem: str, lane: str | None = None, aging: float = 0.0,
          kernel: bool = True, seated: tuple | None = None) -> LaneFacts:
    """kernel=False: asked on a turn's own path (a deflection naming its holder, a hand-over
    check), where /proc/locks must not be read (each cold read stalls every flock()
    on the machine, the hand-off under way included). The holder is then the record's, when the
    record is a live turn's on this very lock file (only a holder writes it, while it holds); the
    kernel is asked only when no record says so (a flock(1) holder, a record of another file).

    seated: (the lane's seat count, the seats past it the count's setter made), as the turn's handle
    read them; None: read here (seat_numbers). Each other seat's facts are judged as seat 1's:
    the seat's own lock file, the kernel's view of it and its own record."""
    name = lane or lane_name(stem)
    count, past = seated if seated is not None else seat_numbers(root, stem, name)
    entries: list = []   # /proc/locks, read at most once for every seat
    found = _seat_facts(root, seats.lock_name(stem, 1), name, kernel, entries)
    if found.exists and not found.problem_lock:
        found.queue = queue_rows(root, stem, aging, kernel)
    found.seats = count
    found.other_seats = [_seat_facts(root, seats.lock_name(stem, seat), name, kernel, entries,
                                     seat)
                         for seat in (*range(2, count + 1), *past)]
    # A seat past the count is the lane's only while held (it keeps a new turn out); once let
    # go it is nobody's, and a lane made one seat again reads as one seat.
    found.other_seats = [seat for seat in found.other_seats
                         if seat.seat <= count or seat.held is not False]
    return found


def seat_numbers(root: str, stem: str, lane: str) -> tuple:
    """(the lane's seat count, the seats past it the count's setter made) from ROOT/kept.json
    alone (seats.made: the folder is never listed). Nothing kept (no kept.json): one seat, and the folder is not looked at --
    a one-seat lane's survey costs one failed lstat more. A count that cannot be read or believed
    is 1, as a turn takes it (taking.count)."""
    from . import kept

    if not os.path.lexists(os.path.join(root, kept.NAME)):   # one lstat: nothing ever kept
        return 1, ()
    try:
        dir_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return 1, ()
    try:
        try:
            values = kept.read(dir_fd)
        except (kept.Untrusted, OSError):
            values = {}
        if values is None:
            return 1, ()
        count = seating.count_of(values.get(seating.key(lane))) or 1
        return count, tuple(seat for seat in seats.made(values, lane) if seat > count)
    finally:
        os.close(dir_fd)


def _seat_facts(root: str, lock: str, lane: str, kernel: bool, entries: list,
                seat: int = 1) -> LaneFacts:
    """The facts of one seat's lock file and record (seat 1's are the lane's own).
    entries: [/proc/locks' entries] once an earlier seat read them, [] before."""
    found = LaneFacts(lane, os.path.join(root, lock), os.path.join(root, seats.record_name(lock)))
    found.seat = seat
    if seat > 1:
        planted = _seat_planted(root, lock, seat)
        if planted is not None:   # as a turn finds it (store.on_seat): the seat is not usable
            found.exists, found.problem_lock = True, planted
            if kernel:   # status: a seat file moved or removed under its holder is a split
                found.problem_lock = _moved_seat(root, lane, seat, found.lock_path) or planted
            return found
    try:
        st = os.lstat(found.lock_path)
    except FileNotFoundError:
        return found
    except OSError as error:
        found.error = f"cannot inspect the lock file: {error.strerror}"
        return found
    found.exists = True
    if not stat.S_ISREG(st.st_mode):
        kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a regular file"
        found.problem_lock = f"the lock path is {kind}"
        return found
    if not st.st_mode & 0o004 and st.st_uid != os.geteuid():
        # planted 0600: its owner's turns can lock it, nobody else's can open it
        found.problem_lock = (f"the lock file is mode {stat.S_IMODE(st.st_mode):04o} of uid "
                              f"{st.st_uid}: other users cannot lock it")
        return found
    # status (kernel) says what any other user's turn finds; a turn, what it found itself
    controlled = _record_controlled(root, seats.record_name(lock), -1 if kernel else None)
    if controlled is not None:   # as a turn finds it (record_claim): the lane is busy
        found.problem_lock = controlled
        return found
    record, problem = sidecar.read(found.sidecar_path)
    found.record, found.record_problem = record, problem
    found.record_absent = problem == sidecar.MISSING
    holder = None if kernel else _live_holder(record, st)
    view = None if holder is not None else _kernel_view(st, entries)
    if holder is not None:
        found.kernel_source = "record"
        found.held, found.holders = True, [proc.describe_process(holder)]
    elif view is None:
        found.kernel_source = "probe"
        found.held = _probe_held(found.lock_path)
    else:
        found.held = bool(view.holders)
        found.holders = [proc.describe_process(pid) for pid in view.holders]
        found.waiters = [proc.describe_process(pid) for pid in view.waiters]
    if record is None:
        return found
    pid = sidecar.field(record, "pid", int)
    kernel_pids = [holder["pid"] for holder in found.holders]
    found.matches = pid is not None and (not kernel_pids or pid in kernel_pids)
    # the lock root is this machine's: every record's process is of this machine
    read_record(found, record, True,
                lambda command: sidecar.turns_command(command, found.lock_path, record))
    inode = sidecar.field(record, "lock_inode", int)
    if "released_at" not in record and inode is not None and inode != st.st_ino:
        # A live holder still locking the old inode is two gates; a dead one is a stale record.
        old = locks.holds_other_inode(pid, st, inode) if found.alive else None
        if old is not None:
            found.replaced = (f"on a removed or replaced lock file (inode {old}; the file here is "
                              f"inode {st.st_ino}): the lane is split")
        else:
            found.store_stale = (f"it was written for lock inode {inode}, the file here is inode "
                                 f"{st.st_ino}")
    return found


def _record_controlled(root: str, name: str, me: int | None) -> str | None:
    """A holder record user me's turns can neither write nor replace (record_claim.controlled;
    -1: any user but its owner and root), in the words a turn says it."""
    from .record_claim import controlled

    try:
        dir_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        why = controlled(dir_fd, name, me)
    finally:
        os.close(dir_fd)
    return None if why is None else f"{os.path.join(root, why)}: remove it"


def _moved_seat(root: str, lane: str, seat: int, path: str) -> str | None:
    """A seat's lock file gone from its name while the file it was made as is still flocked
    (moved aside or removed under its holder: split.moved_holder): who holds it, said as a
    split lane is."""
    from . import kept
    from .split import moved_holder

    try:
        dir_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        try:
            made_as = ((kept.read(dir_fd) or {}).get(seats.files_key(lane)) or {}).get(str(seat))
        except (kept.Untrusted, OSError, AttributeError):
            return None
        inode, stamp = seats.identity_of(made_as)
        if inode is None:
            return None
        try:
            if seats.is_file(os.lstat(path), made_as):
                return None   # still there: planted otherwise, not moved
        except OSError:
            pass
        pid = moved_holder(os.fstat(dir_fd).st_dev, inode, stamp)
    finally:
        os.close(dir_fd)
    if pid is None:
        return None
    command = proc.describe_process(pid)["command"][:120]
    return (f"{path} was moved or removed under its holder pid {pid} ({command}; inode "
            f"{inode}): the lane is split; the seat is that holder's until it ends, then set "
            "the count again (lanelock seats)")


def _seat_planted(root: str, lock: str, seat: int) -> str | None:
    """Why a turn may not use seat K >= 2 (its folder or lock file missing, planted, or another
    user's: seats.open_seat), in the words a turn says it; None when it may."""
    stem = lock.split(".seats/", 1)[0]
    try:
        dir_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        os.close(seats.open_seat(dir_fd, stem, seat))
    except seats.Planted as planted:
        return os.path.join(root, str(planted))
    except OSError:
        return None
    finally:
        os.close(dir_fd)
    return None


def _kernel_view(st: os.stat_result, entries: list):
    """The kernel's view of the lock file, /proc/locks read once per survey of a lane's seats
    (entries filled by the first seat that asks); None when it cannot be read."""
    if not entries:
        entries.append(locks.flock_entries())
    return locks.view_of(st, entries[0])


def _live_holder(record: dict | None, st: os.stat_result) -> int | None:
    """The pid of a live turn the record names as holding this lock file now, else None."""
    if record is None or sidecar.field(record, "lock_inode", int) != st.st_ino:
        return None
    pid = _live_turn(record)
    # Anyone may write the record: its pid is believed only as sidecar.holds() says; a forged
    # one (pid 1) is the kernel's to say.
    return pid if pid is not None and sidecar.holds(pid, st, record) else None


def _live_turn(record: dict) -> int | None:
    """The pid of the turn an unreleased record names, while that process lives (the same
    start time: not a reused pid), else None."""
    if "released_at" in record:
        return None
    pid = sidecar.field(record, "pid", int)
    ticks = sidecar.field(record, "start_ticks", int)
    if pid is None or ticks is None or proc.start_ticks(pid) != ticks:
        return None
    return pid


def holding_any(root: str, stem: str) -> tuple:
    """holding() of the lane: held while any of its seats is, else the latest release of any.
    Seat 1 is asked first; the seats the count's setter made (seats.made: kept.json, never a
    listing of the folder) only when seat 1 is free, past the count too (a seat past it still
    held holds the lane)."""
    held, ago = holding(os.path.join(root, f"{stem}.json"))
    if held:
        return held, ago
    try:
        dir_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return held, ago
    try:
        made = seats.made_here(dir_fd, lane_name(stem))   # the seats the count's setter made
    finally:
        os.close(dir_fd)
    for seat in made:
        seat_held, seat_ago = holding(os.path.join(root, seats.record_name(
            seats.lock_name(stem, seat))))
        if seat_held:
            return True, None
        if seat_ago is not None and (ago is None or seat_ago < ago):
            ago = seat_ago
    return False, ago


def holding(sidecar_path: str) -> tuple:
    """(held, seconds since the release) from the holder record and the holder's /proc/PID/stat
    alone: never /proc/locks, whose every read stalls every flock() on the machine, so a
    witness can ask several times a second. A record not released whose process lives
    (same start time) holds; so does the command of a killed turn that still runs. A holder that
    writes no record (a plain flock(1)) is not seen here: a witness asks survey() before it calls
    a generation unseen."""
    from ...holder import released_ago

    record, _ = sidecar.read(sidecar_path)
    if record is None:
        return False, None
    if "released_at" in record:
        return False, released_ago(record)
    lock_path = sidecar_path[:-len(".json")] + ".lock"
    pid = _live_turn(record)
    if pid is not None:
        try:   # a forged record (pid 1) holds nothing
            return sidecar.holds(pid, os.stat(lock_path), record), None
        except OSError:
            return False, None
    from ..outlived import running_command

    command = running_command(record)
    return command is not None and sidecar.turns_command(command, lock_path, record), None


def queue_rows(root: str, stem: str, aging: float, kernel: bool = True) -> list[dict]:
    """The lane's waiting turns in order (store/flock/queue.py); [] when there are none to read."""
    from .queue import Queue

    try:
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return []
    waiting = Queue(root_fd, stem, aging)
    try:
        return waiting.describe(kernel)
    except OSError:
        return []
    finally:
        waiting.close()
        os.close(root_fd)


def _probe_held(lock_path: str) -> bool | None:
    try:
        fd = os.open(lock_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    except OSError:
        return None
    finally:
        os.close(fd)


def lane_name(stem: str) -> str:
    """The lane a lock file's stem names (a stem no lane makes: '?STEM')."""
    from ...lanes import name_from_stem

    return name_from_stem(stem) or f"?{stem}"
