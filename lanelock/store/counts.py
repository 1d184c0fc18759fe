"""Cumulative per-lane counts for metrics: turns by outcome, deflections by reason, and histograms
of hold and wait times. STEM.counts beside the lock.

Counters never go backwards: a count derived from the journal would drop when it rotates, and
Prometheus would read that as a reset. So every turn adds its outcome here, once, after it let go
of the lane (never on the hand-off path), under a flock of this file's own: concurrent turns
(holders, deflected turns, proxies) each add theirs, none is lost. Readers take the shared lock,
so they never see half an update. Mode 0666, like the journal: every user's turns count.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import stat

OUTCOMES = ("local", "waited", "deflected", "busy", "ungated", "fail_open")
BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
MAX_BYTES = 64 * 1024
_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def empty() -> dict:
    return {"schema": 1, "turns": {outcome: 0 for outcome in OUTCOMES}, "deflections": {},
            "hold": _histogram(), "wait": _histogram()}


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


def merge(data, outcome: str | None, *, reason: str | None = None, held: float | None = None,
          waited: float | None = None) -> dict:
    """data (stored counts, any shape) checked, plus one turn when outcome is given."""
    counts = _parse(json.dumps(data).encode() if not isinstance(data, bytes) else data) \
        if data is not None else empty()
    if outcome is not None:
        counts["turns"][outcome] = counts["turns"].get(outcome, 0) + 1
        if reason:
            counts["deflections"][reason] = counts["deflections"].get(reason, 0) + 1
        if held is not None:
            observe(counts["hold"], held)
        if waited is not None:
            observe(counts["wait"], waited)
    return counts


def add(dir_fd: int, name: str, outcome: str, *, reason: str | None = None,
        held: float | None = None, waited: float | None = None) -> None:
    """Count one turn. OSError when the file cannot be written (the caller stays silent: a
    count is never worth a warning line on a turn)."""
    try:
        fd = os.open(name, os.O_RDWR | _FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        try:
            fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | _FLAGS, 0o666, dir_fd=dir_fd)
            os.fchmod(fd, 0o666)
        except FileExistsError:
            fd = os.open(name, os.O_RDWR | _FLAGS, dir_fd=dir_fd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, f"{name} is not a regular file")
        fcntl.flock(fd, fcntl.LOCK_EX)
        old = os.pread(fd, MAX_BYTES + 1, 0)
        counts = merge(old, outcome, reason=reason, held=held, waited=waited)
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
    """The counts (empty ones when there are none yet, or they are unreadable). Never raises."""
    try:
        fd = os.open(path, os.O_RDONLY | _FLAGS)
    except OSError:
        return empty()
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return empty()
        fcntl.flock(fd, fcntl.LOCK_SH)
        return _parse(os.pread(fd, MAX_BYTES + 1, 0))
    except OSError:
        return empty()
    finally:
        os.close(fd)


def _parse(raw: bytes) -> dict:
    counts = empty()
    if not raw or len(raw) > MAX_BYTES:
        return counts
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        return counts
    if not isinstance(data, dict):
        return counts
    for outcome, value in (data.get("turns") or {}).items():
        if isinstance(outcome, str) and _count(value):
            counts["turns"][outcome] = value
    for reason, value in (data.get("deflections") or {}).items():
        if isinstance(reason, str) and _count(value):
            counts["deflections"][reason] = value
    for key in ("hold", "wait"):
        histogram = data.get(key)
        if isinstance(histogram, dict) and isinstance(histogram.get("buckets"), list) \
                and len(histogram["buckets"]) == len(BUCKETS) \
                and all(_count(value) for value in histogram["buckets"]) \
                and _count(histogram.get("count")) \
                and isinstance(histogram.get("sum"), (int, float)):
            counts[key] = {"buckets": list(histogram["buckets"]), "count": histogram["count"],
                           "sum": float(histogram["sum"])}
    return counts


def _count(value) -> bool:
    return type(value) is int and 0 <= value < 1 << 62
