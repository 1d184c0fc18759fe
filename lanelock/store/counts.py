"""Cumulative per-lane counts for metrics: turns by outcome, deflections by reason, and histograms
of hold and wait times. STEM.counts beside the lock.

Counters never go backwards: a count derived from the journal would drop when it rotates, and
Prometheus would read that as a reset. So every turn adds its outcome here, once, after it let go
of the lane (never on the hand-off path), under a flock of this file's own: concurrent turns
(holders, deflected turns, proxies) each add theirs, none is lost. Readers read until two reads
agree (or take the shared lock), so they never see half an update. Mode 0666, like the journal:
every user's turns count.

Never reset silently: a file that cannot be read whole -- not JSON, not the counts'
shape, a count that is no count, a directory or symlink in its place -- is never written over (that
would start every counter again at the next turn). A turn that cannot add its count says so once
and goes on; a reader keeps what parses, marks what does not as unknown (None: left out of the
metrics, never shown as 0) and says why ("problem").
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import stat

from ..priority import CLASSES
from .shared_file import open_shared

OUTCOMES = ("local", "waited", "deflected", "busy", "ungated", "fail_open")
# The histograms: hold and wait times, and the waits of each class.
HISTOGRAMS = ("hold", "wait") + tuple(f"wait_{klass}" for klass in CLASSES)
# What a witness (witness.py) saw of the engine: generations no turn covered, and the time a turn
# held the lane while the engine computed nothing. Counters, like the turns.
WITNESS = ("unseen", "unseen_seconds", "held_idle_seconds")
# Seconds a lane ran ungated under a holder whose store session ended: until it took the lane
# back (a restart: its 'regained'), or to its end (lost for good: its 'lost'). A counter.
UNGATED = "ungated_seconds"
BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
MAX_BYTES = 64 * 1024
_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def empty() -> dict:
    return {"schema": 1, "turns": {outcome: 0 for outcome in OUTCOMES}, "deflections": {},
            "witness": {name: 0 for name in WITNESS}, "engine": None, "last_unseen": None,
            UNGATED: 0.0, **{key: _histogram() for key in HISTOGRAMS}}


def _histogram() -> dict:
    return {"buckets": [0] * len(BUCKETS), "count": 0, "sum": 0.0}


def observe(histogram: dict, value: float) -> None:
    """Non-cumulative bucket counts (the exposition makes them cumulative); +Inf is count."""
    histogram["count"] += 1
    histogram["sum"] = round(histogram["sum"] + value, 6)
    for index, bound in enumerate(BUCKETS):
        if value <= bound:
            histogram["buckets"][index] += 1
            break


class NotCounted(Exception):
    """A turn's count was not added: the file cannot be written, or cannot be read whole (then it
    is left as it is). The message says why; the turn warns once and goes on."""


def merge(data, outcome: str | None, *, reason: str | None = None, held: float | None = None,
          waited: float | None = None, priority: str | None = None, witness: dict | None = None,
          engine: dict | None = None, last_unseen: dict | None = None,
          ungated: float | None = None) -> dict:
    """data (stored counts, any shape) checked, plus one turn when outcome is given. What does
    not parse counts from 0 (the PostgreSQL store's rows, which are JSON the server checked)."""
    counts = parse(json.dumps(data).encode() if not isinstance(data, bytes) else data)[0] \
        if data is not None else empty()
    for family in ("turns", "deflections", "witness"):
        counts[family] = {name: value or 0 for name, value in (counts[family] or {}).items()}
    for key in HISTOGRAMS:
        counts[key] = counts[key] or _histogram()
    counts[UNGATED] = counts[UNGATED] or 0.0
    return _plus(counts, outcome, reason=reason, held=held, waited=waited, priority=priority,
                 witness=witness, engine=engine, last_unseen=last_unseen, ungated=ungated)


def _plus(counts: dict, outcome: str | None, *, reason=None, held=None, waited=None,
          priority=None, witness=None, engine=None, last_unseen=None, ungated=None) -> dict:
    """Whole counts (nothing None) plus one turn when outcome is given, plus a witness's
    increments ({name in WITNESS: amount}) and its latest facts (engine, last_unseen), when given."""
    for name, amount in (witness or {}).items():
        if name in WITNESS and counts["witness"].get(name) is not None:
            total = counts["witness"][name] + amount
            counts["witness"][name] = total if name == "unseen" else round(total, 3)
    if engine is not None:
        counts["engine"] = engine
    if last_unseen is not None:
        counts["last_unseen"] = last_unseen
    if ungated and counts.get(UNGATED) is not None:
        counts[UNGATED] = round(counts[UNGATED] + ungated, 3)
    if outcome is not None:
        counts["turns"][outcome] = counts["turns"].get(outcome, 0) + 1
        if reason:
            counts["deflections"][reason] = counts["deflections"].get(reason, 0) + 1
        if held is not None:
            observe(counts["hold"], held)
        if waited is not None:
            observe(counts["wait"], waited)
            if priority in CLASSES and counts.get(f"wait_{priority}") is not None:
                observe(counts[f"wait_{priority}"], waited)
    return counts


class Busy(Exception):
    """add(block=False): another process holds the counts' lock now; nothing was added."""


def add(dir_fd: int, name: str, outcome: str | None, *, block: bool = True, **facts) -> None:
    """Count one turn (outcome), or a witness's increments (outcome None; merge()'s keywords).
    NotCounted when it could not be (the caller warns once; the turn goes on). block=False:
    Busy instead of waiting for another process's turn at the file (an event loop's thread)."""
    try:
        _add(dir_fd, name, outcome, block, **facts)
    except BlockingIOError:
        raise Busy() from None
    except OSError as error:
        raise NotCounted(_why(error)) from None


def _add(dir_fd: int, name: str, outcome: str | None, block: bool = True, **facts) -> None:
    fd = open_shared(dir_fd, name)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotCounted("not a regular file")
        fcntl.flock(fd, fcntl.LOCK_EX if block else fcntl.LOCK_EX | fcntl.LOCK_NB)
        old = os.pread(fd, MAX_BYTES + 1, 0)
        counts, problem = parse(old)
        if problem:   # writing what we could read would reset what we could not
            raise NotCounted(f"{problem}; left as it is (fix or remove it to count again)")
        counts = _plus(counts, outcome, **facts)
        data = json.dumps(counts).encode()
        # A pwrite over the old bytes then a truncate, under the exclusive lock. The text can
        # shrink (a rounded sum: 0.123456 + 0.076544 is 0.2), so it is padded with spaces to the
        # old length: a turn killed between the two leaves valid JSON, not a tail of old bytes
        # that reads as no counts at all -- every counter back to zero.
        os.pwrite(fd, data.ljust(len(old)), 0)
        os.ftruncate(fd, len(data))
    finally:
        os.close(fd)   # drops the flock too


def read(path: str) -> dict:
    """The counts (empty ones when there are none yet), with "problem": None, or why they could
    not all be read ("PATH: why"; what could not is None). Never raises."""
    try:
        fd = os.open(path, os.O_RDONLY | _FLAGS)
    except (FileNotFoundError, NotADirectoryError):   # no counts yet (no root: the gate says so)
        return dict(empty(), problem=None)
    except OSError as error:
        return dict(unknown(), problem=f"{path}: {_why(error)}")
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return dict(unknown(), problem=f"{path}: not a regular file")
        raw = _stable_read(fd)
        counts, problem = parse(raw)
        return dict(counts, problem=f"{path}: {problem}" if problem else None)
    except OSError as error:
        return dict(unknown(), problem=f"{path}: {_why(error)}")
    finally:
        os.close(fd)


def _stable_read(fd: int) -> bytes:
    """The file's bytes, whole. Read twice until two reads agree and parse (a writer's pwrite
    caught half way does neither), without a lock: `status` and `metrics` take no lock of any
    kind, so a look can never delay a turn (status's audit test holds it to that). A file that
    keeps changing under the reads is read under the shared lock instead."""
    for _ in range(5):
        first = os.pread(fd, MAX_BYTES + 1, 0)
        if first == os.pread(fd, MAX_BYTES + 1, 0) and parse(first)[1] is None:
            return first
    fcntl.flock(fd, fcntl.LOCK_SH)
    return os.pread(fd, MAX_BYTES + 1, 0)


def unknown() -> dict:
    """Counts none of which could be read: every counter unknown (None), none 0."""
    return {"schema": 1, "turns": {outcome: None for outcome in OUTCOMES}, "deflections": None,
            "witness": {name: None for name in WITNESS}, "engine": None, "last_unseen": None,
            UNGATED: None, **{key: None for key in HISTOGRAMS}}


def parse(raw: bytes) -> tuple[dict, str | None]:
    """(the counts, None), or (what parses -- the rest None --, why the rest does not)."""
    if not raw:
        return empty(), None   # created by a turn that died before its first count
    if len(raw) > MAX_BYTES:
        return unknown(), f"larger than {MAX_BYTES} bytes"
    try:
        text = raw.decode("utf-8").lstrip()
        data, end = json.JSONDecoder().raw_decode(text)   # what follows the object is said below
    except (ValueError, RecursionError):   # UnicodeDecodeError is a ValueError
        return unknown(), "not JSON"
    if not isinstance(data, dict):
        return unknown(), "not a JSON object"
    turns, deflections = data.get("turns") or {}, data.get("deflections") or {}
    if not isinstance(turns, dict) or not isinstance(deflections, dict):
        return unknown(), "turns or deflections not a JSON object"
    counts, bad = empty(), []
    for family, found in (("turns", turns), ("deflections", deflections)):
        for name, value in found.items():
            counts[family][name] = value if _count(value) else None
            if not _count(value):
                bad.append(f"{family}.{name}")
    witness = data.get("witness")
    if witness is not None and not isinstance(witness, dict):
        counts["witness"] = {name: None for name in WITNESS}
        bad.append("witness")
    for name, value in (witness.items() if isinstance(witness, dict) else ()):
        if name not in WITNESS:
            continue
        good = _count(value) if name == "unseen" else _seconds(value)
        counts["witness"][name] = value if good else None
        if not good:
            bad.append(f"witness.{name}")
    ungated = data.get(UNGATED, 0.0)   # counts of a lanelock before it: none so far
    counts[UNGATED] = ungated if _seconds(ungated) else None
    if not _seconds(ungated):
        bad.append(UNGATED)
    for key in ("engine", "last_unseen"):   # facts a witness keeps, not counters
        counts[key] = data.get(key) if isinstance(data.get(key), dict) else None
    for key in HISTOGRAMS:
        histogram = data.get(key)
        if histogram is None:
            continue
        if isinstance(histogram, dict) and isinstance(histogram.get("buckets"), list) \
                and len(histogram["buckets"]) == len(BUCKETS) \
                and all(_count(value) for value in histogram["buckets"]) \
                and _count(histogram.get("count")) \
                and isinstance(histogram.get("sum"), (int, float)):
            counts[key] = {"buckets": list(histogram["buckets"]), "count": histogram["count"],
                           "sum": float(histogram["sum"])}
        else:
            counts[key] = None
            bad.append(key)
    problems = [f"{', '.join(bad)} not readable as counts"] if bad else []
    trailing = text[end:].strip()   # a count padded with spaces (see add) is whole
    if trailing:
        problems.append(f"{len(trailing)} stray characters after the counts")
    return counts, "; ".join(problems) or None


def _count(value) -> bool:
    return type(value) is int and 0 <= value < 1 << 62


def _seconds(value) -> bool:
    return type(value) in (int, float) and 0 <= value < 1e15


def _why(error: OSError) -> str:
    if error.errno == errno.ELOOP:
        return "a symlink (not followed)"
    return error.strerror or str(error)
