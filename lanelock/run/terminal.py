"""The terminal's foreground, handed between the wrapper and its command's process group.

The command runs in a process group of its own (runner.py says why). A terminal sends ^C, ^\\ and
^Z to its foreground group alone, and lets only that group read from it. So when the wrapper's
group is in the foreground, the wrapper hands the foreground to the command's group while the
command runs, and takes it back when the command ends or stops -- as a shell does for its jobs.
A stop is handled as sudo handles its command's (sudo_suspend_parent): take the terminal back,
stop, and once continued give it to the command again only if our group has it again.

The foreground is handed before the command starts only when the wrapper is alone in its group
(a job of its own). A group it shares -- a pager after it in a pipeline (`lanelock run -- cmd |
less`), a script's shell without job control -- keeps the foreground: handing it away would stop
the pager (SIGTTIN) while the command fills its pipe. There the terminal's ^C and ^Z reach the
wrapper, which sends them on to the command's group, and a command that wants to read the
terminal stops and is given it then (runner.py).

Invariant: the foreground only ever moves from the wrapper's group to the command's while the
wrapper's has it, and back while the command's has it. A shell that has moved on meanwhile (`bg`,
another job in front) keeps its terminal. tcsetpgrp() from a background group would stop the
wrapper with SIGTTOU: it is blocked around every call.
"""

from __future__ import annotations

import os
import signal


class Terminal:
    """The controlling terminal, if the wrapper has one (fd -1 otherwise: nothing is handed)."""

    def __init__(self) -> None:
        self.fd = -1
        self.handed_to: int | None = None   # the command's group, while it has the foreground
        try:
            self.fd = os.open("/dev/tty", os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC)
        except OSError:   # no controlling terminal (cron, a service, a pipe): nothing to hand
            pass
        # Decided once, before the lane is taken (one pass over /proc, only on a terminal).
        self.upfront = self.fd >= 0 and self.ours() and _alone_in_group()

    def ours(self) -> bool:
        """Is the wrapper's group in the terminal's foreground?"""
        return self._foreground() == os.getpgrp()

    def hand(self, pgid: int) -> bool:
        """Give the foreground to the command's group if ours has it: True when it was given."""
        if self.fd < 0 or not self.ours():
            return False
        if self._set(pgid):
            self.handed_to = pgid
        return self.handed_to == pgid

    def holds(self) -> bool:
        """Does the command's group we handed the foreground to still have it?"""
        return self.handed_to is not None and self._foreground() == self.handed_to

    def take_back(self) -> None:
        """The foreground back to the wrapper's group, if the command's group still has it."""
        if self.holds():
            self._set(os.getpgrp())
        self.handed_to = None

    def close(self) -> None:
        self.take_back()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def hand_upfront(self, pgid: int) -> None:
        """Before the command starts: hand it the foreground if we are a job of our own."""
        if self.upfront:
            self.hand(pgid)

    def _foreground(self) -> int | None:
        if self.fd < 0:
            return None
        try:
            return os.tcgetpgrp(self.fd)
        except OSError:   # hung up meanwhile
            return None

    def _set(self, pgid: int) -> bool:
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTTOU})
        try:
            os.tcsetpgrp(self.fd, pgid)
            return True
        except OSError:   # the group is gone, or the terminal hung up
            return False
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _alone_in_group() -> bool:
    """Is this process the only live one of its process group (the parked child has its own)?
    Another member is the parent (a script's shell without job control) or a sibling (the rest
    of a pipeline a shell made one job): a few reads, not a pass over /proc, unless the kernel
    does not list a process's children."""
    me, group, parent = os.getpid(), os.getpgrp(), os.getppid()
    try:
        if os.getpgid(parent) == group:
            return False
        with open(f"/proc/{parent}/task/{parent}/children", "rb") as handle:
            siblings = [int(pid) for pid in handle.read().split()]
    except (OSError, ValueError):
        from ..proc import group_members

        return all(pid == me for pid, _, _ in group_members(group)[0])
    for pid in siblings:
        try:
            if pid != me and os.getpgid(pid) == group:
                return False
        except OSError:   # ended meanwhile
            continue
    return True
