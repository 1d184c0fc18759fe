"""Kernel truth about a lock file: who holds it and who waits, from /proc/locks.

The sidecar says who *claimed* the lane; /proc/locks says who *holds* it. They disagree after a
kill -9 (the kernel dropped the lock, the sidecar still names the dead holder) and after PID reuse,
so readers trust the kernel and use the sidecar only for labels. Plain /proc reads here: the run
path must not import psutil.
"""

from __future__ import annotations

import os

from .proc import proc_stat, start_ticks, state   # noqa: F401 - holders.proc_stat, ... for readers

PROC_LOCKS = "/proc/locks"


class KernelView:
    """The kernel's view of one lock (a plain class: `typing` costs the run path milliseconds)."""

    __slots__ = ("holders", "waiters")

    def __init__(self, holders: tuple[int, ...], waiters: tuple[int, ...]):
        self.holders = holders   # pids that hold an FLOCK on the file (the process that took it)
        self.waiters = waiters   # pids blocked in flock() on it

    def __eq__(self, other) -> bool:
        return isinstance(other, KernelView) and (self.holders, self.waiters) == (
            other.holders, other.waiters)

    def __repr__(self) -> str:
        return f"KernelView(holders={self.holders}, waiters={self.waiters})"


def flock_entries() -> list[tuple[int, str, int, bool]] | None:
    """(pid, "maj:min", inode, blocked) for every FLOCK in /proc/locks; None when unreadable."""
    try:
        with open(PROC_LOCKS, "rb") as handle:
            text = handle.read().decode("ascii", "replace")
    except OSError:
        return None
    entries = []
    for line in text.splitlines():
        words = line.split()
        blocked = len(words) > 1 and words[1] == "->"
        if blocked:
            words = words[:1] + words[2:]
        # "1: FLOCK  ADVISORY  WRITE 1234 fe:00:2146329 0 EOF"
        if len(words) < 6 or words[1] != "FLOCK":
            continue
        device, _, inode = words[5].rpartition(":")
        try:
            entries.append((int(words[4]), device, int(inode), blocked))
        except ValueError:
            continue
    return entries


def _device(st: os.stat_result) -> str:
    return f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}"


def kernel_view(st: os.stat_result) -> KernelView | None:
    """Holders and waiters of the file with st's device and inode; None when /proc/locks is unreadable."""
    entries = flock_entries()
    if entries is None:
        return None
    device = _device(st)
    mine = [(pid, blocked) for pid, dev, ino, blocked in entries if dev == device and ino == st.st_ino]
    return KernelView(tuple(pid for pid, blocked in mine if not blocked),
                      tuple(pid for pid, blocked in mine if blocked))


def holds_other_inode(pid: int, st: os.stat_result, inode: int | None = None) -> int | None:
    """An inode on st's device, other than st's (or exactly `inode`), that pid holds an FLOCK on:
    the sign of a lock file that was removed or replaced under a live holder."""
    device = _device(st)
    for holder, dev, ino, blocked in flock_entries() or ():
        if holder == pid and dev == device and not blocked and ino != st.st_ino \
                and (inode is None or ino == inode):
            return ino
    return None


def still_running(record: dict) -> bool | None:
    """Does the process a turn's record names (its pid, start_ticks, boot_id and hostname, as the
    holder record and the journal's `acquired` event carry them) still run? False when the pid is
    gone or a zombie, runs another process (another start time: the pid was reused), or belongs
    to another boot of this machine; None when this machine cannot tell: another host's turn,
    or an old line without a start time whose pid runs."""
    from .facts import boot_id, hostname

    def given(key, kind):
        value = record.get(key)
        return value if isinstance(value, kind) and not isinstance(value, bool) else None

    pid, host, boot = given("pid", int), given("hostname", str), given("boot_id", str)
    if pid is None or pid <= 0 or (host is not None and host != hostname()):
        return None
    if boot is not None and boot_id() and boot != boot_id():
        return False
    ticks = start_ticks(pid)
    if ticks is None:
        return False
    recorded = given("start_ticks", int)
    return None if recorded is None else ticks == recorded


def ancestors(pid: int | None = None) -> list[int]:
    """Parent, grandparent, ... up to (not including) pid 0."""
    chain: list[int] = []
    current = os.getppid() if pid is None else pid
    while current > 0 and current not in chain and len(chain) < 512:
        chain.append(current)
        found = proc_stat(current)
        if not found:
            break
        current = found[0]
    return chain


def command_words(pid: int) -> list[str] | None:
    """A process's argv from /proc (None when it is gone or hidden)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            raw = handle.read(4096)
    except OSError:
        return None
    return [part.decode("utf-8", "replace") for part in raw.split(b"\0") if part]


def command_line(pid: int, limit: int = 200) -> str:
    """The command of a process for display, '?' when it is gone or hidden."""
    from .facts import argv_text

    return argv_text(command_words(pid) or [], limit) or "?"


def describe_process(pid: int) -> dict:
    """{pid, command, lanelock}: whether it is a lanelock wrapper; '?' for what cannot be seen.
    Plain /proc reads: a deflection on the run path describes its holder with this."""
    cmdline = command_words(pid)
    if not cmdline:
        return {"pid": pid, "command": "?", "lanelock": False}
    from .facts import argv_text

    is_lanelock = any(word.endswith("lanelock") for word in cmdline[:3]) or \
        " -m lanelock " in f" {' '.join(cmdline[:4])} "
    return {"pid": pid, "command": argv_text(cmdline, 300) or "?", "lanelock": is_lanelock}


def stopped_process(pid: int) -> int | None:
    """pid, or the first of its children, when it is stopped (job control or SIGSTOP)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children", "rb") as handle:
            children = [int(word) for word in handle.read().split()]
    except (OSError, ValueError):
        children = []
    for candidate in (pid, *children):
        if state(candidate) in (b"T", b"t"):
            return candidate
    return None
