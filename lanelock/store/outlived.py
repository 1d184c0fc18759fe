"""A killed turn's command that outlives its lock: the next turn takes the lane only once it is gone.

`lanelock run` holds the lock and its command runs with a parent-death signal (SIGKILL). When the
wrapper itself is killed, the kernel closes its files -- dropping the lock -- before it sends its
children that signal, and a command then takes a moment to die (its memory is freed before its
sockets close). A turn that took the lane in that moment would generate beside it. So the holder
record names the command (command_pid, command_start_ticks), and a turn that finds the record of
a turn that never released (it was killed) waits, holding the lock, until that command is gone.
Nothing is polled: the wait is on a pidfd, which the kernel makes readable when the process ends.
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


def running_command(record: dict | None) -> tuple[int, int] | None:
    """(pid, start ticks) of the command of a turn killed without releasing, while the command
    still runs on this machine; None otherwise (released, its holder alive -- a PostgreSQL turn
    whose session was ended runs on, ungated, as it says --, another host's or boot's, gone, or
    its pid reused)."""
    if not record or "released_at" in record or _holder_lives(record):
        return None
    pid = field(record, "command_pid", int)
    ticks = field(record, "command_start_ticks", int)
    if pid is None or ticks is None or pid <= 0 or pid == os.getpid():
        return None
    if record.get("hostname") not in (None, hostname()) \
            or record.get("boot_id") not in (None, boot_id()):
        return None
    return (pid, ticks) if proc.start_ticks(pid) == ticks else None


def _holder_lives(record: dict) -> bool:
    """Does the turn's own process still run, and not on its way out? (The lock can be free the
    moment a killed holder's files close, before it is a zombie: that holder is dying.)"""
    return still_running(record) is True and not proc.exiting(field(record, "pid", int))


def _pidfd(pid: int) -> int | None:
    """A pidfd of the process still named pid; None when it is already gone."""
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        return None


def gone(pid: int, ticks: int, timeout: float | None, cancel=None) -> bool:
    """Wait up to timeout seconds (None: for ever) for the process to end: True once it has.
    cancel: a threading.Event that abandons the wait (looked at every CANCEL_LOOK seconds)."""
    fd = _pidfd(pid)
    if fd is None:
        return True
    try:
        if proc.start_ticks(pid) != ticks:   # the pid was reused before the pidfd was opened
            return True
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if cancel is not None:
                left = CANCEL_LOOK if left is None else min(left, CANCEL_LOOK)
            if select.select([fd], [], [], left)[0]:
                return True
            if (cancel is not None and cancel.is_set()) \
                    or (deadline is not None and time.monotonic() >= deadline):
                return False
    finally:
        os.close(fd)


async def gone_async(pid: int, ticks: int, timeout: float | None) -> bool:
    """gone() for an asyncio task: the loop watches the pidfd."""
    import asyncio

    fd = _pidfd(pid)
    if fd is None:
        return True
    loop = asyncio.get_running_loop()
    ended = loop.create_future()
    try:
        if proc.start_ticks(pid) != ticks:
            return True
        loop.add_reader(fd, lambda: ended.done() or ended.set_result(True))
        try:
            return await asyncio.wait_for(ended, None if timeout is None else max(0.0, timeout))
        except asyncio.TimeoutError:
            return False
        finally:
            loop.remove_reader(fd)
    finally:
        os.close(fd)
