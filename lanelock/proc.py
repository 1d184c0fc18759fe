"""What /proc says of a process: its parent and ancestors, its start time, its state, its
command line (locks.py reads /proc/locks).

The leaf every other /proc reader stands on. Plain reads: the run path must not import psutil.
Every look at another process is racy, so each answers None (or '?') for a process that is gone
or a zombie.
"""

from __future__ import annotations

import errno
import os


def _stat_fields(pid: int) -> list[bytes]:
    """The fields of /proc/PID/stat from the state on ([] when the process is gone). comm may
    hold spaces and parentheses: the fields start after the last ')'."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            data = handle.read()
    except (OSError, ValueError):
        return []
    return data[data.rfind(b")") + 2:].split()


ENVIRON_LIMIT = 1 << 20   # bytes of an environment read at most
_CHUNK = 16 << 10


def environ(pid: int) -> bytes:
    """/proc/PID/environ as it was at exec (NUL-separated), up to ENVIRON_LIMIT; raises OSError
    (gone, another user's). Read in small pieces: read(1 MiB) allocates the whole megabyte and
    gives most of it back, and a proxy doing so for each request grew its resident memory by
    half over 10,000 requests (glibc kept the holes of its thread arenas)."""
    parts, size = [], 0
    with open(f"/proc/{pid}/environ", "rb", buffering=0) as handle:
        while size < ENVIRON_LIMIT:
            part = handle.read(_CHUNK)
            if not part:
                break
            parts.append(part)
            size += len(part)
    return b"".join(parts)[:ENVIRON_LIMIT]


def proc_stat(pid: int) -> tuple[int, int] | None:
    """(ppid, start time in clock ticks since boot) of a live process; None when it is gone or a
    zombie (a zombie's files, and so its locks, are already closed: it holds nothing)."""
    fields = _stat_fields(pid)
    if not fields or fields[0] in (b"Z", b"X"):
        return None
    try:
        return int(fields[1]), int(fields[19])
    except (IndexError, ValueError):
        return None


def name(pid: int) -> str | None:
    """The process's name as the kernel keeps it (/proc/PID/comm: the executable's or script's
    base name, 15 bytes at most), None when it is gone."""
    try:
        with open(f"/proc/{pid}/comm", "rb") as handle:
            return handle.read().rstrip(b"\n").decode("utf-8", "replace")
    except (OSError, ValueError):
        return None


def start_ticks(pid: int) -> int | None:
    found = proc_stat(pid)
    return found[1] if found else None


def state(pid: int) -> bytes | None:
    """The process's state letter (b"R", b"S", b"T" stopped, ...), None when it is gone."""
    fields = _stat_fields(pid)
    return fields[0] if fields else None


def is_stopped(pid: int) -> bool:
    """Is the process stopped (kill -STOP, ^Z, a debugger's stop)?"""
    return state(pid) in (b"T", b"t")


PF_EXITING = 0x4   # include/linux/sched.h: the process is in do_exit()


def exiting(pid: int) -> bool:
    """Is the process gone, a zombie, or on its way out (killed: its files, and so its locks, are
    being closed, but it is not a zombie yet)?"""
    fields = _stat_fields(pid)
    try:
        return fields[0] in (b"Z", b"X") or bool(int(fields[6]) & PF_EXITING)
    except (IndexError, ValueError):
        return True


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


def files_uid(pid: int, strict: bool = False) -> int | None:
    """The uid a process makes files as (its fsuid, from /proc/PID/status, which every user may
    read; /proc/PID's own owner is root for a process that changed its uid), None when gone.
    strict: out of descriptors or memory raises (the process may well be there) instead."""
    try:
        fd = os.open(f"/proc/{pid}/status", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as error:
        if strict and error.errno in (errno.EMFILE, errno.ENFILE, errno.ENOMEM):
            raise
        return None
    try:
        text = os.read(fd, 4096)
    except OSError:
        return None
    finally:
        os.close(fd)
    at = text.find(b"\nUid:")
    try:
        return int(text[at + 1:text.index(b"\n", at + 1)].split()[4]) if at >= 0 else None
    except (ValueError, IndexError):
        return None


def command_words(pid: int) -> list[str] | None:
    """A process's argv from /proc (None when it is gone or hidden)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            raw = handle.read(4096)
    except OSError:
        return None
    return [part.decode("utf-8", "replace") for part in raw.split(b"\0") if part]


def describe_process(pid: int) -> dict:
    """{pid, command, lanelock}: whether it is a lanelock wrapper; '?' for what cannot be seen.
    Plain /proc reads: a deflection on the run path describes its holder with this."""
    cmdline = command_words(pid)
    if not cmdline:
        return {"pid": pid, "command": "?", "lanelock": False}
    from .say import argv_text

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


def group_members(pgid: int) -> tuple[list[tuple[int, int, int]], bool]:
    """([(pid, session, start ticks)] of the live processes of process group pgid, any seen):
    one pass over /proc. any seen is True when a process of the group was seen at all, zombies
    included -- False with a group the kernel says exists means /proc hides it (hidepid).
    Racy as every /proc read: a process may fork or end during the pass."""
    members, seen = [], False
    try:
        names = os.listdir("/proc")
    except OSError:
        return [], False
    for name in names:
        if not name.isdigit():
            continue
        fields = _stat_fields(int(name))
        try:
            if int(fields[2]) != pgid:
                continue
            seen = True
            if fields[0] not in (b"Z", b"X"):
                members.append((int(name), int(fields[3]), int(fields[19])))
        except (IndexError, ValueError):
            continue
    return members, seen
