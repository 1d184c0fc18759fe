"""`lanelock status`: the truth about a lane, even when the sidecar lies.

The kernel (/proc/locks) says who holds the lock and who waits; the sidecar only labels them. status
never takes the lock (asking must never make a turn deflect), except where /proc/locks cannot be
read: then it probes once and says so. Every look at another process is racy and shows '?' rather
than failing (psutil's NoSuchProcess / AccessDenied).
"""

from __future__ import annotations

import os
import stat
import time

from .. import holders
from ..store import sidecar
from ..facts import boot_id

FUTURE_SLACK = 300.0   # seconds a sidecar's clock may run ahead before it counts as "from the future"


def lane_stems(root: str) -> list[str]:
    """Every lane under the root, by lock file."""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    return sorted(name[:-5] for name in names if name.endswith(".lock") and not name.startswith("."))


def lane_status(root: str, stem: str, lane: str | None = None) -> dict:
    lock_path = os.path.join(root, f"{stem}.lock")
    result = {"lane": lane or _lane_from_stem(stem), "lock_path": lock_path,
              "sidecar_path": os.path.join(root, f"{stem}.json"), "exists": False,
              "state": "free", "verdict": "never-used", "message": "", "holders": [],
              "waiters": [], "kernel_source": "proc-locks", "holder": None, "last": None,
              "sidecar_problem": None}
    try:
        st = os.lstat(lock_path)
    except FileNotFoundError:
        result["message"] = "free; no turn has used this lane yet"
        return result
    except OSError as error:
        return _verdict(result, "unknown", "error", f"cannot inspect the lock file: {error.strerror}")
    result["exists"] = True
    if not stat.S_ISREG(st.st_mode):
        kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a regular file"
        return _verdict(result, "unknown", "bad-lock-file",
                        f"the lock path is {kind}: turns cannot take this gate and run without it")
    record, problem = sidecar.read(result["sidecar_path"])
    result["sidecar_problem"] = problem
    view = holders.kernel_view(st)
    if view is None:
        result["kernel_source"] = "probe"
        held = _probe_held(lock_path)
        pids: tuple[int, ...] = ()
    else:
        held, pids = bool(view.holders), view.holders
        result["waiters"] = [_process(pid) for pid in view.waiters]
    result["holders"] = [_process(pid) for pid in pids]
    return _judge(result, st, held, record, problem)


def _judge(result: dict, st: os.stat_result, held: bool | None, record, problem) -> dict:
    pid = sidecar.field(record, "pid", int)
    released = record is not None and "released_at" in record
    replaced = _replaced_under(record, pid, st) if record is not None and not released else None
    if replaced is not None:
        result["holder"] = summary(record)
        return _verdict(result, "held", "lock-file-replaced",
                        f"held by lanelock turn pid {pid} ({_who(record)}) on a removed or replaced "
                        f"lock file (inode {replaced}; the file here is inode {st.st_ino}); new turns "
                        "deflect until it ends")
    stale = _stale_reason(result, st, record)
    if held is None:
        return _verdict(result, "unknown", "error", "cannot tell: /proc/locks unreadable and the probe failed")
    if held:
        kernel_pids = [h["pid"] for h in result["holders"]]
        matches = (record is not None and not released and not stale
                   and (not kernel_pids or pid in kernel_pids))
        if matches:
            result["holder"] = summary(record)
            who = _who(record)
            return _verdict(result, "held", "held",
                            f"held by lanelock turn pid {pid} ({who}), for {_ago(record)}")
        if result["holders"]:
            first = result["holders"][0]
            kind = "a lanelock turn" if first["lanelock"] else "a process that is not lanelock"
            why = problem or stale or ("the sidecar describes an earlier turn" if record else "no sidecar")
            return _verdict(result, "held", "held-unlabelled" if first["lanelock"] else "held-foreign",
                            f"held by {kind}: pid {first['pid']} ({first['command']}); {why}")
        return _verdict(result, "held", "held-unlabelled",
                        f"held (seen by a probe; /proc/locks unreadable); {problem or stale or ''}".rstrip("; "))
    if record is None:
        message = "free; " + (problem or "no sidecar")
        return _verdict(result, "free", "never-used" if problem == "no sidecar yet" else "sidecar-bad",
                        message)
    if stale:
        return _verdict(result, "free", "sidecar-stale", f"free; sidecar is stale: {stale}")
    if pid is None:
        return _verdict(result, "free", "sidecar-bad", "free; the sidecar names no usable pid")
    if released:
        result["last"] = summary(record)
        status = record.get("exit_status")
        return _verdict(result, "free", "released",
                        f"free; last holder pid {pid} ({_who(record)}) released cleanly at "
                        f"{record.get('released_at')} (exit {status if status is not None else '?'}, "
                        f"held {_seconds(record.get('held_seconds'))})")
    result["last"] = summary(record)
    alive = pid is not None and holders.start_ticks(pid) == sidecar.field(record, "start_ticks", int)
    if alive:
        return _verdict(result, "free", "releasing",
                        f"free; holder pid {pid} is alive and letting go (or lost the lock)")
    return _verdict(result, "free", "died",
                    f"free; last holder pid {pid} ({_who(record)}) died without releasing; "
                    "the kernel dropped the lock")


def _replaced_under(record: dict, pid: int | None, st: os.stat_result) -> int | None:
    """The old inode a live holder still locks after its lock file was removed or replaced."""
    inode = sidecar.field(record, "lock_inode", int)
    if pid is None or inode is None or inode == st.st_ino:
        return None
    if holders.start_ticks(pid) != sidecar.field(record, "start_ticks", int):
        return None
    return holders.holds_other_inode(pid, st, inode)


def _stale_reason(result: dict, st: os.stat_result, record) -> str | None:
    if record is None:
        return None
    lane = sidecar.field(record, "lane", str)
    if lane and lane != result["lane"] and not result["lane"].startswith("?"):
        return f"it is for another lane ({lane})"
    acquired = sidecar.field(record, "acquired_at", str)
    when = _parse_time(acquired) if acquired else None
    if acquired and when is None:
        return f"its acquired_at {acquired[:40]!r} is not a time"
    if when is not None and when > time.time() + FUTURE_SLACK:
        return f"it claims a time in the future ({acquired[:40]})"
    record_boot = sidecar.field(record, "boot_id", str)
    if record_boot and boot_id() and record_boot != boot_id():
        return "it is from a previous boot"
    inode = sidecar.field(record, "lock_inode", int)
    if inode is not None and inode != st.st_ino and "released_at" not in record:
        return f"it was written for lock inode {inode}, the file here is inode {st.st_ino}"
    pid = sidecar.field(record, "pid", int)
    ticks = sidecar.field(record, "start_ticks", int)
    if pid is not None and ticks is not None and "released_at" not in record:
        now_ticks = holders.start_ticks(pid)
        if now_ticks is not None and now_ticks != ticks:
            return f"pid {pid} was reused by another process (start time differs)"
    return None


def _probe_held(lock_path: str) -> bool | None:
    import fcntl

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


def _process(pid: int) -> dict:
    """pid, command and whether it is a lanelock wrapper; '?' for what cannot be seen."""
    import psutil

    try:
        proc = psutil.Process(pid)
        cmdline = proc.cmdline()
        command = " ".join(cmdline)[:300] or proc.name()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
        return {"pid": pid, "command": "?", "lanelock": False}
    is_lanelock = any(word.endswith("lanelock") for word in cmdline[:3]) or \
        " -m lanelock " in f" {' '.join(cmdline[:4])} "
    return {"pid": pid, "command": command, "lanelock": is_lanelock}


SUMMARY_KEYS = ("pid", "session", "model", "user", "acquired_at", "released_at", "exit_status",
                "held_seconds", "backend", "hostname")


def summary(record: dict, extra_keys: tuple[str, ...] = ()) -> dict:
    """The holder facts status shows, from any store's holder record."""
    facts = {key: record.get(key) for key in SUMMARY_KEYS + extra_keys}
    argv = sidecar.field(record, "argv", list, [])
    facts["command"] = " ".join(str(word) for word in argv)[:300]
    since = sidecar.field(record, "acquired_monotonic", float)
    same_boot = record.get("boot_id") == boot_id()
    facts["held_for"] = round(time.monotonic() - since, 3) if since and same_boot \
        and "released_at" not in record else None
    return facts


def _who(record: dict) -> str:
    parts = [f"session {record.get('session')}"]
    if record.get("model"):
        parts.append(f"model {record.get('model')}")
    argv = sidecar.field(record, "argv", list, [])
    if argv:
        parts.append(f"command {' '.join(str(word) for word in argv)[:120]}")
    return ", ".join(parts)


def _ago(record: dict) -> str:
    held_for = summary(record)["held_for"]
    return _seconds(held_for)


def _seconds(value) -> str:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return "?"
    if value < 60:
        return f"{value:.1f}s"
    minutes, seconds = divmod(int(value), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{seconds:02d}s"


def _verdict(result: dict, state: str, verdict: str, message: str) -> dict:
    result.update(state=state, verdict=verdict, message=message)
    return result


def _parse_time(text: str) -> float | None:
    from datetime import datetime, timezone

    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    try:
        return moment.timestamp()
    except (OverflowError, OSError, ValueError):
        return None


def _lane_from_stem(stem: str) -> str:
    from ..key import name_from_stem

    return name_from_stem(stem) or f"?{stem}"
