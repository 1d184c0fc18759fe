"""What /proc/PID/stat says of one process: its parent, its start time, its state.

The leaf every other /proc reader stands on (holders.py for locks and trees, facts.py for this
process's own start time). Plain reads: the run path must not import psutil. Every look at another
process is racy, so each answers None for a process that is gone or a zombie.
"""

from __future__ import annotations


def proc_stat(pid: int) -> tuple[int, int] | None:
    """(ppid, start time in clock ticks since boot) of a live process; None when it is gone or a
    zombie (a zombie's files, and so its locks, are already closed: it holds nothing)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            data = handle.read()
    except (OSError, ValueError):
        return None
    # comm may hold spaces and parentheses: the fields start after the last ')'.
    fields = data[data.rfind(b")") + 2:].split()
    if not fields or fields[0] in (b"Z", b"X"):
        return None
    try:
        return int(fields[1]), int(fields[19])
    except (IndexError, ValueError):
        return None


def start_ticks(pid: int) -> int | None:
    found = proc_stat(pid)
    return found[1] if found else None


def state(pid: int) -> bytes | None:
    """The process's state letter (b"R", b"S", b"T" stopped, ...), None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            data = handle.read()
    except OSError:
        return None
    fields = data[data.rfind(b")") + 2:].split()
    return fields[0] if fields else None
