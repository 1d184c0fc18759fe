"""Who holds a lane, described once: the facts taken from a holder record, and the words a person
reads in a deflection line, `probe` and `status`."""

from __future__ import annotations

import time

from .facts import argv_text, boot_id, hostname
from .say import sanitize

# Keys of the holder facts; documented under JSON output in the README.
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
    """'pid 42, session alice@pts/1, model qwen, held 12.3s' for one line."""
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
    from .holders import stopped_process

    pid = stopped_process(wrapper)
    if pid is None:
        return None
    since = field(record, "stopped_at", str)
    when = f" since {since}" if since else ""
    how = f"fg in its shell, or kill -CONT {pid}" + (
        f" and kill -CONT {wrapper}" if pid != wrapper else "")
    # A stopped wrapper takes its TERM only once continued; a running one continues its command.
    end = f"kill {wrapper}; kill -CONT {wrapper}" if pid == wrapper else f"kill {wrapper}"
    return {"pid": pid, "since": since,
            "words": f"pid {pid} is stopped{when}: it keeps the lane until resumed ({how}) or "
                     f"ended ({end})"}


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
