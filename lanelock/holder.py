"""The holder record and who holds a lane, described once: the record a turn writes (every store
keeps it as it is given), the facts taken from a record, and the words a person reads in a
deflection line, `probe` and `status`."""

from __future__ import annotations

import os
import time

from . import pidns
from .facts import boot_id, hostname, own_start_ticks, parse_utc, shown_time, user_name
from .say import argv_text, sanitize

SCHEMA = 1   # the holder record's version: a reader refuses a newer one
ARGV_BUDGET = 4096   # characters of argv a holder record keeps (the readers' limit is 64 KiB)


def record(*, lane, session: str, model: str | None, argv: dict, acquired_at: str,
           acquired_monotonic: float, turn: str | None, stopped_at: str | None = None,
           labels: dict | None = None, command: tuple[int, int] | None = None) -> dict:
    """The holder record of this process's turn on lane (a Lane). argv: argv_fields().
    command: command_facts() of the process the turn runs (`lanelock run`'s child), which the
    next turn waits for -- with its whole process group -- should this one be killed first
    (store/outlived.py)."""
    found = {
        "schema": SCHEMA, "lane": lane.name, "backend": lane.given,
        "pid": os.getpid(), "start_ticks": own_start_ticks(), "boot_id": boot_id(),
        "session": session, "model": model, **argv,
        "user": user_name(), "uid": os.getuid(), "hostname": hostname(),
        "acquired_at": acquired_at, "acquired_monotonic": acquired_monotonic, "turn": turn,
    }
    found.update(command_fields(command))
    found.update(pidns.mark())   # a container's pids are its own namespace's (pidns.py)
    if stopped_at is not None:
        found["stopped_at"] = stopped_at
    if labels:
        found.update(labels)
    return found


def command_facts(pid: int) -> tuple | None:
    """(pid, start ticks, pgid, session) of the process a turn runs; pgid and session are None
    unless it leads a process group of its own, as `lanelock run`'s command does: then the
    whole group is the turn (store/outlived.py). None when the process is gone."""
    from .proc import start_ticks

    ticks = start_ticks(pid)
    if ticks is None:
        return None
    try:
        if os.getpgid(pid) == pid:
            return pid, ticks, pid, os.getsid(pid)
    except OSError:   # gone meanwhile: its record names the pid alone
        pass
    return pid, ticks, None, None


def command_fields(command: tuple | None) -> dict:
    """The record's (and the journal's `acquired`) keys for command_facts()."""
    if command is None:
        return {}
    pid, ticks, pgid, sid = command
    found = {"command_pid": pid, "command_start_ticks": ticks}
    if pgid is not None:
        found["command_pgid"], found["command_sid"] = pgid, sid
    return found


def group_words(pids: list[int], limit: int = 3) -> str:
    """'pid 41 (curl -sN ...), pid 40 (sh -c ...)': processes of a turn's process group that
    still run, as /proc shows them."""
    from .proc import command_words

    shown = []
    for pid in pids[:limit]:
        words = command_words(pid)
        shown.append(f"pid {pid} ({sanitize(argv_text(words, 60)) if words else '?'})")
    more = f", and {len(pids) - limit} more" if len(pids) > limit else ""
    return ", ".join(shown) + more if shown else "not shown in /proc"


def argv_fields(argv: list[str]) -> dict:
    """argv for the record, bounded: a prompt passed as an argument can be megabytes, and a
    record over the readers' limit would lose the turn's labels. Words past the budget are
    dropped and long words cut; argv_bytes keeps the full length."""
    total = sum(len(word) for word in argv)
    if total <= ARGV_BUDGET and len(argv) <= 64:
        return {"argv": argv}
    kept, used = [], 0
    for word in argv[:64]:
        word = word if len(word) <= 512 else word[:512] + "…"
        if used + len(word) > ARGV_BUDGET:
            break
        kept.append(word)
        used += len(word)
    return {"argv": kept, "argv_truncated": True, "argv_bytes": total + len(argv),
            "argv_words": len(argv)}


def released_ago(record: dict | None) -> float | None:
    """Seconds since the record's turn released the lane (None: not released, or no record).
    On this boot the monotonic clock says it; elsewhere the wall clock, from released_at."""
    if not isinstance(record, dict) or "released_at" not in record:
        return None
    since, held = field(record, "acquired_monotonic", float), field(record, "held_seconds", float)
    if since is not None and held is not None and record.get("boot_id") == boot_id() \
            and record.get("hostname") in (None, hostname()):
        return max(0.0, time.monotonic() - since - held)
    text = record.get("released_at")
    released = parse_utc(text) if isinstance(text, str) else None
    return None if released is None else max(0.0, time.time() - released)


# Keys of the holder facts; documented in docs/json.md.
RECORD_KEYS = ("pid", "session", "model", "user", "acquired_at", "released_at", "exit_status",
               "held_seconds", "backend", "hostname")


def from_record(record: dict) -> dict:
    """The holder facts of any store's record: who (pid, host when not this one, session, model,
    command) and for how long (held_for, on this host's clock only)."""
    facts = {key: record.get(key) for key in RECORD_KEYS}
    for key, kind in (("pid", int), ("session", str), ("model", str), ("user", str)):
        facts[key] = field(record, key, kind)
    here = record.get("hostname") in (None, hostname())
    facts["host"] = None if here else field(record, "hostname", str)
    facts["command"] = argv_text(field(record, "argv", list, []), 300)
    if record.get("argv_truncated"):
        facts["command"] += " …"
    facts["argv_bytes"] = field(record, "argv_bytes", int)
    if "backend_pid" in record:
        facts["backend_pid"] = field(record, "backend_pid", int)
    since = field(record, "acquired_monotonic", float)
    same_clock = here and since and record.get("boot_id") == boot_id()
    facts["held_for"] = round(time.monotonic() - since, 3) \
        if same_clock and "released_at" not in record else None
    facts["lanelock"] = True
    return facts


def unlabelled(pid: int | None, command: str | None, note: str, lanelock: bool = False) -> dict:
    """A holder no record describes."""
    return {"pid": pid, "session": None, "model": None, "held_for": None, "lanelock": lanelock,
            "command": command, "note": note}


def words(holder: dict | None) -> str:
    """'pid 42, session alice@pts/1, model qwen, held 12.3s' for one line; on a lane of several
    seats, every holder: '2 of 2 seats: pid 42, session a, held 3.1s; pid 43, session b, held
    1.0s'."""
    if not holder:
        return "holder unknown"
    seated = holder.get("holders")
    if isinstance(seated, list) and seated and isinstance(holder.get("seats"), int):
        return (seat_count_words(len(seated), holder["seats"]) + ": "
                + "; ".join(_one(each if isinstance(each, dict) else None) for each in seated))
    return _one(holder)


def seat_count_words(held: int, seats: int) -> str:
    """'2 of 2 seats', '1 of 3 seats', '3 holding 2 seats' (a count made smaller under them)."""
    plural = "" if seats == 1 else "s"
    if held > seats:
        return f"{held} holding {seats} seat{plural}"
    return f"{held} of {seats} seat{plural}"


def _one(holder: dict | None) -> str:
    if not holder:
        return "holder unknown"
    parts = [f"pid {holder['pid']}" if holder.get("pid") else "its pid unknown"]
    if holder.get("host"):
        parts[0] += f" on {holder['host']}"
    if holder.get("session"):
        parts.append(f"session {holder['session']}")
    if holder.get("model"):
        parts.append(f"model {holder['model']}")
    if holder.get("held_for") is not None:
        parts.append(f"held {seconds(holder['held_for'])}")
    if isinstance(holder.get("stopped"), dict):
        parts.append(str(holder["stopped"].get("words")))
    if not holder.get("lanelock") and holder.get("command"):
        parts.append(f"not a lanelock turn: {holder['command']}")
    elif holder.get("lanelock") and holder.get("note"):
        parts.append(holder["note"])
    return sanitize(", ".join(parts), 600)


def stopped(wrapper: int, record: dict | None = None) -> dict | None:
    """{pid, since, words} when the holder (the wrapper or its command) is stopped -- it keeps the
    lane until resumed -- else None. since: when the wrapper saw it stop (the record's stopped_at)."""
    from .proc import stopped_process

    pid = stopped_process(wrapper)
    if pid is None:
        return None
    since = field(record, "stopped_at", str)
    when = f" since {shown_time(since)}" if since else ""
    how = f"fg in its shell, or kill -CONT {pid}" + (
        f" and kill -CONT {wrapper}" if pid != wrapper else "")
    # A stopped wrapper takes its TERM only once continued; a running one continues its command.
    end = f"kill {wrapper}; kill -CONT {wrapper}" if pid == wrapper else f"kill {wrapper}"
    return {"pid": pid, "since": since,
            "words": f"pid {pid} is stopped{when}: it keeps the lane until resumed ({how}) or "
                     f"ended ({end})"}


def exit_words(record: dict) -> str:
    """'exit 3' for a command's status; 'HTTP 200' for a proxy turn's answer (its exit status is
    the engine's HTTP status)."""
    status = record.get("exit_status")
    if isinstance(status, bool) or not isinstance(status, int):
        return "no exit status"
    return f"HTTP {status}" if record.get("via") == "proxy" else f"exit {status}"


def seconds(value) -> str:
    """12.3s, 4m05s, 2h03m; '?' for what is not a number."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return "?"
    if value < 60:
        return f"{value:.1f}s"
    minutes, rest = divmod(int(value), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{rest:02d}s"


def field(record: dict | None, key: str, kind: type, default=None):
    """record[key] if it has the expected type, else default (a lying sidecar cannot crash readers)."""
    if not record:
        return default
    value = record.get(key, default)
    if kind is int and isinstance(value, bool):
        return default
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value if isinstance(value, kind) else default


def live_pids_here(facts) -> set[int]:
    """The pid on this machine that holds the lane, as far as the lock's own truth confirms the
    record naming it (a busy lane's hand-over check, handover.part_of): empty when the lane is
    not held, the record does not agree with the lock's holder, or it was written elsewhere."""
    record = facts.record
    if not facts.held or not facts.matches or not isinstance(record, dict) \
            or "released_at" in record or record.get("hostname") not in (None, hostname()):
        return set()
    pid = field(record, "pid", int)
    return {pid} if pid is not None else set()


def still_running(record: dict) -> bool | None:
    """Does the process a turn's record names (its pid, start_ticks, boot_id and hostname, as the
    holder record and the journal's `acquired` event carry them) still run? False when the pid is
    gone or a zombie, runs another process (another start time: the pid was reused), or belongs
    to another boot of this machine; None when this machine cannot tell: another host's turn,
    or an old line without a start time whose pid runs."""
    from .proc import start_ticks

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
