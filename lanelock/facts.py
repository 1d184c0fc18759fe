"""Small facts about this process, this machine and the time (say.py shows them to people).

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


def parse_utc(text: str) -> float | None:
    """utc_now()'s text (or any ISO 8601 time; UTC when it names no zone) as seconds since the
    epoch, None when it is no time."""
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


def shown_time(moment) -> str:
    """The one way a person is shown a time, by every command: local time with its zone, as
    date(1) prints it -- '2026-12-03 10:02:03.123 CET' -- from seconds since the epoch or a
    recorded UTC text (utc_now()'s). JSON, the journal and the records keep UTC. Text that is no
    time is shown as it is; nothing at all as '?'."""
    if isinstance(moment, str):
        parsed = parse_utc(moment)
        if parsed is None:
            return moment
        # the text's own milliseconds (a float of them may fall a hair short of the digit)
        millis = round(parsed * 1000)
    elif isinstance(moment, bool) or not isinstance(moment, (int, float)) \
            or not abs(moment) < 1e15:   # nan and the absurd too
        return "?"
    else:   # cut, as utc_now() cuts: one moment reads the same from its ts and its text
        millis = int(moment // 1) * 1000 + int(moment % 1 * 1000)
    try:
        local = time.localtime(millis // 1000)
    except (OverflowError, OSError, ValueError):
        return "?"
    return (time.strftime("%Y-%m-%d %H:%M:%S", local) + f".{millis % 1000:03d} "
            + time.strftime("%Z", local))


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
        from .proc import start_ticks

        _CACHE.update(pid=pid, start_ticks=start_ticks(pid))
    return _CACHE["start_ticks"]


def hostname() -> str:
    if "hostname" not in _CACHE:
        _CACHE["hostname"] = os.uname().nodename
    return _CACHE["hostname"]


# Programs that only pass a turn on: the label names whoever started them.
PASSERS = frozenset({"sh", "bash", "dash", "zsh", "fish", "ksh", "mksh", "busybox", "env", "nice",
                     "nohup", "setsid", "timeout", "stdbuf", "ionice", "chrt", "taskset", "time",
                     "flock", "xargs", "sudo", "su", "runuser", "lanelock"})
SCHEDULERS = frozenset({"cron", "crond", "anacron", "atd", "fcron"})
ANCESTORS = 16   # how far up the tree a label is looked for


def default_session(starter: int | None = None) -> str:
    """user@tty for a person at a terminal. Without a terminal: user@NAME/PID of the program
    that started the turn -- starter (`run` gives its parent), else this process -- passing over
    shells and the like (an agent's tool call runs through `sh -c`), so two agents are two
    sessions; user@cron when that is a scheduler (or nothing but passers up to init)."""
    user = user_name()
    for fd in (0, 1, 2):
        try:
            return f"{user}@{os.ttyname(fd).removeprefix('/dev/')}"
        except OSError:
            continue
    try:
        os.close(os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY | os.O_CLOEXEC))
        return f"{user}@tty"
    except OSError:
        pass
    from .proc import name, proc_stat

    pid = os.getpid() if starter is None else starter
    for _ in range(ANCESTORS):
        called = name(pid)
        if called is None or pid <= 1 or called in SCHEDULERS:
            break
        if called not in PASSERS:
            return f"{user}@{called}/{pid}"
        found = proc_stat(pid)
        if found is None:
            break
        pid = found[0]
    return f"{user}@cron"
