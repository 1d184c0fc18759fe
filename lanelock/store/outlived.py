"""A killed turn's command that outlives its lock: the next turn takes the lane only once all of it
is gone.

`lanelock run` holds the lock, and its command runs in a process group of its own (run/runner.py
says why a group and not a cgroup): the turn is that whole group -- `curl` inside `sh -c` as much
as the shell. When the wrapper is killed outright (SIGKILL, the OOM killer), the kernel closes its
files -- dropping the lock -- and the direct child gets its parent-death signal, but the rest of
the group goes on generating. So the holder record names the group (command_pgid, which is the
leader's command_pid, its command_start_ticks and its session command_sid), and a turn that finds
the record of a turn that never released (it was killed) waits, holding the lock, until no
process of that group is left. A record that names a pid and no group (the Python API's Turn given
a command_pid that leads no group of its own, or a record of an older lanelock) is waited for as
that one process.

The kernel says whether the group exists: kill(-pgid, 0). A group id can be taken again only once
the group is empty and no process has that pid; against that anyway, a process counts only if it
is in the command's session and started no earlier than its leader, and the group is not the
command's once the leader's pid runs another process.

The group's processes are found by one pass over /proc and waited for on their pidfds, which the
kernel makes readable when each ends; then /proc is read again (one of them may have forked
meanwhile), until the kernel says the group is empty. A process leaving the group (setsid) makes
no pidfd readable, so /proc is also read again every LEAVE_LOOK seconds; and when the kernel says
the group exists while /proc shows none of it (hidepid), every UNSEEN_LOOK seconds. This runs
only for a killed turn's record (and for a wrapper whose command left processes behind), never
on the usual hand-off.
"""

from __future__ import annotations

import os
import select
import time

from .. import proc
from ..facts import boot_id, hostname
from ..holder import field, still_running

# A wait that can be cancelled from another thread looks at its cancel event this often.
CANCEL_LOOK = 0.1
# The kernel says the group exists but /proc shows none of its processes: look again this often.
UNSEEN_LOOK = 0.5
# Every process seen ended before its pidfd was opened: look again after this long at most.
SOON = 0.02
# A process that leaves the group (setsid, setpgid) is no longer the turn's, but no pidfd says
# so: while a group is waited for, /proc is read again this often.
LEAVE_LOOK = 1.0


class Command:
    """The command of a turn: its leader (pid, start ticks) and, when it leads a process group of
    its own, that group (pgid, session). members: what the last look found still running."""

    __slots__ = ("pid", "ticks", "pgid", "sid", "members")

    def __init__(self, pid: int, ticks: int, pgid: int | None = None, sid: int | None = None):
        self.pid, self.ticks, self.pgid, self.sid = pid, ticks, pgid, sid
        self.members: list[int] = []

    def running(self) -> list[tuple[int, int]] | None:
        """[(pid, start ticks)] of the command's processes still running; [] when none is; None
        when the kernel says the group still exists but /proc does not show its processes."""
        if self.pgid is None:
            return [(self.pid, self.ticks)] if proc.start_ticks(self.pid) == self.ticks else []
        if not group_exists(self.pgid):
            return []
        leader = proc.start_ticks(self.pid)
        if leader is not None and leader != self.ticks:
            return []   # the leader's pid runs another process: its group was empty once
        found, seen = proc.group_members(self.pgid)
        ours = [(pid, ticks) for pid, sid, ticks in found
                if (self.sid is None or sid == self.sid) and ticks >= self.ticks]
        if ours or seen:
            return ours   # seen but none ours: zombies, or another group under a reused id
        return None

    @property
    def named(self) -> int:
        """The process to name as holding the lane: the leader while it runs, else one of the
        group's processes still running."""
        return self.pid if self.pid in self.members or not self.members else self.members[0]

    def look(self) -> list[tuple[int, int]] | None:
        """running(), and members set from it."""
        live = self.running()
        self.members = [pid for pid, _ in live or ()]
        return live


def group_exists(pgid: int) -> bool:
    """Does process group pgid have a process (a zombie not yet reaped counts)? The kernel's
    answer, atomic: EPERM is another user's group, which exists."""
    try:
        os.kill(-pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def running_command(record: dict | None) -> Command | None:
    """The command of a turn killed without releasing, while any of it still runs on this
    machine (Command.members says which processes); None otherwise (released, its holder alive
    -- a PostgreSQL turn whose session was ended runs on, ungated, as it says --, another host's
    or boot's, all gone, or its pid reused)."""
    if not record or "released_at" in record or _holder_lives(record):
        return None
    pid = field(record, "command_pid", int)
    ticks = field(record, "command_start_ticks", int)
    if pid is None or ticks is None or pid <= 1 or pid == os.getpid():
        return None
    if record.get("hostname") not in (None, hostname()) \
            or record.get("boot_id") not in (None, boot_id()):
        return None
    pgid, sid = field(record, "command_pgid", int), field(record, "command_sid", int)
    # A group lanelock made is led by the command itself; any other group id is not the turn's.
    group = pgid == pid and sid is not None and sid > 0
    command = Command(pid, ticks, pgid if group else None, sid if group else None)
    return command if command.look() != [] else None


def lingering(record: dict | None) -> Command | None:
    """The command of a live turn on this machine that has ended while others of its process
    group still run -- its wrapper keeps the lane until they end; None otherwise."""
    if not record or "released_at" in record or record.get("hostname") not in (None, hostname()):
        return None
    pid, ticks = field(record, "command_pid", int), field(record, "command_start_ticks", int)
    pgid, sid = field(record, "command_pgid", int), field(record, "command_sid", int)
    if pid is None or ticks is None or pgid != pid or sid is None or pid <= 1:
        return None
    if proc.start_ticks(pid) == ticks:
        return None   # the command itself runs: the usual turn
    command = Command(pid, ticks, pgid, sid)
    return command if command.look() else None


def _holder_lives(record: dict) -> bool:
    """Does the turn's own process still run, and not on its way out? (The lock can be free the
    moment a killed holder's files close, before it is a zombie: that holder is dying.)"""
    return still_running(record) is True and not proc.exiting(field(record, "pid", int))


def _pidfds(live: list[tuple[int, int]]) -> list[int]:
    """pidfds of the processes still named (pid, ticks): one that ended or whose pid was reused
    before its pidfd was opened is left out."""
    fds = []
    for pid, ticks in live:
        try:
            fd = os.pidfd_open(pid)
        except OSError:   # gone (ESRCH), or this kernel has no pidfds: looked at again below
            continue
        if proc.start_ticks(pid) == ticks:
            fds.append(fd)
        else:
            os.close(fd)
    return fds


def _bound(live, fds, left: float | None) -> float | None:
    """How long one wait may block: until one of fds ends, except when there is nothing to wait
    on (the group is hidden from /proc, or each process ended before its pidfd was opened)."""
    if fds:
        return LEAVE_LOOK if left is None else min(left, LEAVE_LOOK)
    # Hidden: ask the kernel again in a while. Ended before the open: look again at once (a
    # small bound, so a kernel without pidfds looks a few times a second rather than spinning).
    again = UNSEEN_LOOK if live is None else SOON
    return again if left is None else min(left, again)


def gone(command: Command, timeout: float | None, cancel=None) -> bool:
    """Wait up to timeout seconds (None: for ever) until no process of the command runs: True
    once none does. cancel: a threading.Event that abandons the wait (looked at every
    CANCEL_LOOK seconds)."""
    deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
    while True:
        live = command.look()
        if live == []:
            return True
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if cancel is not None:
            left = CANCEL_LOOK if left is None else min(left, CANCEL_LOOK)
        fds = _pidfds(live or [])
        try:
            select.select(fds, [], [], _bound(live, fds, left))
        finally:
            for fd in fds:
                os.close(fd)
        if (cancel is not None and cancel.is_set()) \
                or (deadline is not None and time.monotonic() >= deadline):
            return command.look() == []


async def gone_async(command: Command, timeout: float | None) -> bool:
    """gone() for an asyncio task: the loop watches the pidfds."""
    import asyncio

    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + max(0.0, timeout)
    while True:
        live = command.look()
        if live == []:
            return True
        left = None if deadline is None else max(0.0, deadline - loop.time())
        fds = _pidfds(live or [])
        ended = loop.create_future()
        try:
            for fd in fds:
                loop.add_reader(fd, lambda: ended.done() or ended.set_result(True))
            try:
                await asyncio.wait_for(ended, _bound(live, fds, left))
            except asyncio.TimeoutError:
                pass
        finally:
            for fd in fds:
                loop.remove_reader(fd)
                os.close(fd)
        if deadline is not None and loop.time() >= deadline:
            return command.look() == []
