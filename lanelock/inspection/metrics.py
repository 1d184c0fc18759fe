"""Prometheus exposition of the lanes: the kernel's view now (gauges) and every turn so far
(counters and histograms from the store's cumulative counts, which never go backwards).

Labels are of low cardinality only: lane, outcome, reason -- never a pid, session or argv. The
text comes from prometheus-client (`pip install '.[metrics]'` in lanelock's checkout), not a formatter of ours.
"""

from __future__ import annotations

import os
import re
import tempfile

from .. import __version__
from ..say import sanitize
from ..store.counts import BUCKETS, CLASSES, OUTCOMES, UNGATED
from .status import statuses

TEXTFILE = "lanelock.prom"
REASON = re.compile(r"[a-z][a-z_]{0,63}")
NEEDS = ("metrics need prometheus-client: pip install '.[metrics]' in lanelock's checkout "
         "(or pip install prometheus-client)")


def snapshot(store, lane=None) -> list[tuple[dict, dict]]:
    """[(status, counts)] for the lane, or every lane the store knows."""
    from .status import ALL_ENGINE_LOOKS, add_engine, judged

    found = []
    looks = [ALL_ENGINE_LOOKS if lane is None else None]   # status --all's bound
    for status, facts in judged(store, lane):
        counts = store.counts(facts)   # once: the counters and the witness's engine both
        add_engine(status, facts, counts, lane, looks)
        found.append((status, counts))
    return found


class LaneCollector:
    """A prometheus-client collector over the lanes; fetch() gives (snapshot()'s list, the
    store's problems()). extra: {outcome: count} turns of this process the store never sees (a
    proxy's ungated requests)."""

    def __init__(self, fetch, extra=None):
        self.fetch, self.extra = fetch, extra

    def collect(self):
        from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                            HistogramMetricFamily, InfoMetricFamily)

        info = InfoMetricFamily("lanelock_build", "lanelock's version")
        info.add_metric([], {"version": __version__})
        yield info
        held = GaugeMetricFamily("lanelock_lane_held", "1 while a turn holds the lane",
                                 labels=["lane"])
        seats = GaugeMetricFamily("lanelock_lane_seats",
                                  "the lane's seat count: up to that many turns hold it at once "
                                  "(`lanelock seats`)", labels=["lane"])
        held_seats = GaugeMetricFamily("lanelock_lane_held_seats",
                                       "seats held now (more than lanelock_lane_seats while a "
                                       "count made smaller still has its holders)",
                                       labels=["lane"])
        waiters = GaugeMetricFamily("lanelock_lane_waiters",
                                    "turns waiting for the lane, as `lanelock status` counts "
                                    "them: its queue, or where the store keeps none, the "
                                    "processes blocked on its lock", labels=["lane"])
        since = GaugeMetricFamily("lanelock_lane_held_since_seconds",
                                  "how long the current holder has held the lane (0 when free)",
                                  labels=["lane"])
        stopped = GaugeMetricFamily("lanelock_lane_holder_stopped",
                                    "1 while the holder is stopped (^Z, SIGSTOP): it keeps the lane",
                                    labels=["lane"])
        turns = CounterMetricFamily("lanelock_turns", "turns by outcome: local (held at once), "
                                    "waited (held after waiting), deflected (a fallback ran), busy "
                                    "(nothing ran), ungated, fail_open",
                                    labels=["lane", "outcome"])
        deflections = CounterMetricFamily("lanelock_deflections",
                                          "turns sent away from the lane, by reason",
                                          labels=["lane", "reason"])
        hold = HistogramMetricFamily("lanelock_lane_hold_seconds",
                                     "how long turns held the lane", labels=["lane"])
        wait = HistogramMetricFamily("lanelock_lane_wait_seconds",
                                     "how long turns that waited for the lane waited",
                                     labels=["lane"])
        class_wait = HistogramMetricFamily("lanelock_lane_class_wait_seconds",
                                           "how long turns that waited for the lane waited, by "
                                           "their priority class", labels=["lane", "class"])
        waiters_stopped = GaugeMetricFamily(
            "lanelock_lane_waiters_stopped", "queued turns stopped (^Z, SIGSTOP) where the store "
            "can see it: passed over while stopped, they keep their place", labels=["lane"])
        queued = GaugeMetricFamily("lanelock_lane_queued",
                                   "turns waiting in the lane's queue, by the class they count "
                                   "as now (aging included)", labels=["lane", "class"])
        # Whether the gate can be taken at all: 0 means turns run ungated (fail open),
        # for the lane, or for any lane with no lock yet (a root that is not there cannot list
        # its lanes: only the store-wide gauge can say it is broken).
        gate = GaugeMetricFamily("lanelock_gate_available",
                                 "1 when a turn can take the lane's gate; 0: turns run ungated "
                                 "(fail open; `lanelock status` says why)", labels=["lane"])
        unseen = CounterMetricFamily("lanelock_engine_unseen",
                                     "generations the engine ran that no turn held the lane for "
                                     "(a client reaches it without lanelock), as its witness saw",
                                     labels=["lane"])
        unseen_seconds = CounterMetricFamily("lanelock_engine_unseen_seconds",
                                             "seconds the engine generated unseen",
                                             labels=["lane"])
        held_idle = CounterMetricFamily("lanelock_lane_held_idle_seconds",
                                        "seconds a turn held the lane while the engine computed "
                                        "nothing (tool calls, a client thinking)",
                                        labels=["lane"])
        ungated = CounterMetricFamily("lanelock_ungated_seconds",
                                      "seconds the lane ran ungated under a holder whose lane "
                                      "store session ended: until it took the lane back (a "
                                      "restart), or to its end (lost: terminated, a partition)",
                                      labels=["lane"])
        generating = GaugeMetricFamily("lanelock_engine_generating",
                                       "slots the engine says it is computing now (one look per "
                                       "scrape; absent when it cannot be read)", labels=["lane"])
        lanes, problems = self.fetch()
        store = GaugeMetricFamily("lanelock_store_available",
                                  "1 when a turn on a lane with no lock yet can create one; 0: "
                                  "such turns run ungated (`lanelock where` says why)",
                                  value=0.0 if problems else 1.0)
        readable = GaugeMetricFamily("lanelock_counts_readable",
                                     "1 when the lane's counts could all be read; 0: the counters "
                                     "that could not are left out, not reset (`lanelock metrics` "
                                     "says why)", labels=["lane"])
        for status, counts in lanes:
            lane = sanitize(status["lane"], 200)   # a lock file's name: anyone's to choose
            gate.add_metric([lane], 0.0 if status.get("gate") == "unavailable" else 1.0)
            readable.add_metric([lane], 0.0 if counts.get("problem") else 1.0)
            is_held = status["state"] == "held"
            held.add_metric([lane], 1.0 if is_held else 0.0)
            seats.add_metric([lane], float(status.get("seats") or 1))
            held_seats.add_metric([lane], float(status.get("held_seats") or 0))
            # A waiter is a turn that still wants the lane: its queue entry is the record (the
            # kernel sees only the first of the queue on the lane's lock).
            waiters.add_metric([lane], float(len(status.get("queue") or ()) or
                                             len(status["waiters"])))
            waiters_stopped.add_metric([lane], float(sum(
                1 for entry in status.get("queue") or () if entry.get("stopped"))))
            for klass in CLASSES:
                queued.add_metric([lane, klass], float(sum(
                    1 for entry in status.get("queue") or () if entry["effective_class"] == klass)))
            holder = status.get("holder") or {}
            since.add_metric([lane], float(holder.get("held_for") or 0.0) if is_held else 0.0)
            stopped.add_metric([lane], 1.0 if holder.get("stopped") else 0.0)
            extra = (self.extra or {}).get(lane, {}) if isinstance(self.extra, dict) else {}
            # A count that could not be read (None) is left out: a 0 would be a reset.
            for outcome in OUTCOMES:
                value = counts["turns"].get(outcome, 0)
                if value is not None:
                    turns.add_metric([lane, outcome], float(value + extra.get(outcome, 0)))
            found = counts["deflections"]
            for reason, value in sorted((found or {}).items()):
                # The counts file is everyone's to write: a reason is a label only when it
                # looks like one of ours (no escape for a terminal, no unbounded label set).
                if value is not None and REASON.fullmatch(reason):
                    deflections.add_metric([lane, reason], float(value))
            if found is not None and "local_backend_busy" not in found:
                deflections.add_metric([lane, "local_backend_busy"], 0.0)
            witnessed = counts.get("witness") or {}
            for family, name in ((unseen, "unseen"), (unseen_seconds, "unseen_seconds"),
                                 (held_idle, "held_idle_seconds")):
                if witnessed.get(name) is not None:   # unknown is left out, never 0
                    family.add_metric([lane], float(witnessed[name]))
            if counts.get(UNGATED) is not None:   # unknown is left out, never 0
                ungated.add_metric([lane], float(counts[UNGATED]))
            engine = status.get("engine") or {}
            if engine.get("generating") is not None:
                generating.add_metric([lane], float(engine["generating"]))
            for family, labels, histogram in (
                    (hold, [lane], counts["hold"]), (wait, [lane], counts["wait"]),
                    *((class_wait, [lane, klass], counts.get(f"wait_{klass}"))
                      for klass in CLASSES)):
                if histogram is None:
                    continue
                cumulative, total = [], 0
                for bound, value in zip(BUCKETS, histogram["buckets"]):
                    total += value
                    cumulative.append((_bound(bound), float(total)))
                cumulative.append(("+Inf", float(histogram["count"])))
                family.add_metric(labels, cumulative, histogram["sum"])
        yield from (gate, store, held, seats, held_seats, waiters, waiters_stopped, queued, since, stopped, turns, deflections, hold,
                    wait, class_wait, readable, unseen, unseen_seconds, held_idle, ungated,
                    generating)


def counts_problems(lanes) -> list[str]:
    """One warning per lane whose counts could not all be read (snapshot()'s list)."""
    return [f"counts of {status['lane']} not all read ({counts['problem']}): those counters are "
            "left out, not reset; fix or remove the file to count again"
            for status, counts in lanes if counts.get("problem")]


def _bound(value: float) -> str:
    return repr(float(value))


def exposition(collector) -> bytes:
    try:
        from prometheus_client import CollectorRegistry, generate_latest
    except ImportError:
        raise ImportError(NEEDS) from None
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return generate_latest(registry)


def write_textfile(directory: str, data: bytes) -> str:
    """DIR/lanelock.prom, atomically: a temp file in DIR renamed over it (node_exporter's
    textfile collector must never read half a file)."""
    fd, temp = tempfile.mkstemp(prefix=".lanelock.prom.", dir=directory)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.chmod(temp, 0o644)
        path = os.path.join(directory, TEXTFILE)
        os.replace(temp, path)
    except BaseException:
        try:
            os.unlink(temp)
        except OSError:
            pass
        raise
    return path


def lanes_fetch(store, lane):
    return lambda: (snapshot(store, lane), store.problems())


__all__ = ["LaneCollector", "exposition", "write_textfile", "snapshot", "lanes_fetch",
           "counts_problems", "statuses", "TEXTFILE"]
