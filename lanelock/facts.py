"""Small facts about this process and the time, and how labels are shown to a person.

Cached where they cannot change within a process: a turn records them twice (acquire, release).
"""

from __future__ import annotations

import os
import time

_CACHE: dict[str, object] = {}


def utc_now(now: float | None = None) -> str:
    # time.strftime, not datetime: the run path pays for every import.
    if now is None:
        now = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1000):03d}Z"


def boot_id() -> str | None:
    if "boot_id" not in _CACHE:
        try:
            with open("/proc/sys/kernel/random/boot_id") as handle:
                _CACHE["boot_id"] = handle.read().strip()
        except OSError:
            _CACHE["boot_id"] = ""
    return _CACHE["boot_id"] or None


def user_name() -> str:
    if "user" not in _CACHE:
        try:
            import pwd

            _CACHE["user"] = pwd.getpwuid(os.getuid()).pw_name
        except (KeyError, ImportError):
            _CACHE["user"] = str(os.getuid())
    return _CACHE["user"]


def own_start_ticks() -> int | None:
    """This process's start time (clock ticks since boot): with the pid, it names us uniquely."""
    pid = os.getpid()
    if _CACHE.get("pid") != pid:   # a fork is another process
        from .holders import start_ticks

        _CACHE.update(pid=pid, start_ticks=start_ticks(pid))
    return _CACHE["start_ticks"]


def hostname() -> str:
    if "hostname" not in _CACHE:
        _CACHE["hostname"] = os.uname().nodename
    return _CACHE["hostname"]


def default_session() -> str:
    """user@tty for a person at a terminal; user@cron when there is no controlling terminal."""
    for fd in (0, 1, 2):
        try:
            return f"{user_name()}@{os.ttyname(fd).removeprefix('/dev/')}"
        except OSError:
            continue
    try:
        os.close(os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY | os.O_CLOEXEC))
        return f"{user_name()}@tty"
    except OSError:
        return f"{user_name()}@cron"


def sanitize(text: str, limit: int = 300) -> str:
    """One printable line: labels may carry newlines or ANSI escapes."""
    clean = "".join(ch if ch.isprintable() else "?" for ch in str(text))
    return clean if len(clean) <= limit else clean[:limit] + "…"


def argv_text(argv: list) -> str:
    import shlex

    return shlex.join(str(word) for word in argv)[:500]


def holder_words(holder: dict | None) -> str:
    """'pid 42, session alice@pts/1, model qwen, held 12.3s' for one stderr line."""
    if not holder:
        return "holder unknown"
    parts = [f"pid {holder['pid']}" if holder.get("pid") else "pid ?"]
    if holder.get("host"):
        parts[0] += f" on {holder['host']}"
    if holder.get("session"):
        parts.append(f"session {holder['session']}")
    if holder.get("model"):
        parts.append(f"model {holder['model']}")
    if holder.get("held_for") is not None:
        parts.append(f"held {holder['held_for']:.1f}s")
    if not holder.get("lanelock") and holder.get("command"):
        parts.append(f"not a lanelock turn: {holder['command']}")
    elif holder.get("lanelock") and holder.get("note"):
        parts.append(holder["note"])
    return sanitize(", ".join(parts))
