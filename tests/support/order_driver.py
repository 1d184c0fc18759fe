"""A turn waiting in a lane's queue that reports every look of the order (store/order.py), for
tests/test_order.py:

    order_driver.py KIND WHERE BACKEND SESSION PRIORITY [stall-behind=PID | freeze] [ready]

Each look prints {"look": ahead-or-null, "step": seconds-or-null} on stdout; once the turn holds
the lane it prints {"held": true, "state": ..., "at": CLOCK_MONOTONIC seconds} and lets go, then
prints {"left": ...}. With stall-behind=PID, its first look that finds PID ahead and a step coming
is held up until that step has passed: an aging step falls between the look and the wait it
decides. (Named by whom it finds, not by count: a look may find a just-killed waiter still ahead
once more, as PostgreSQL ends its session.)
With freeze, a look that finds it first is held up until a line on stdin: a waiter frozen between
the look that gives it the lane and its take (the lane free, the waiter queued). With ready, it
prints {"ready": true} once imported and joins the queue only on a line on stdin: a test that times
arrivals starts its waiters first, so no interpreter's start-up falls inside the times it sets.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/

from lanelock.store import order  # noqa: E402
from support.store_driver import gate  # noqa: E402


def pid_of(entry) -> int:
    """The waiter's pid, as each store's entry says it (flock, PostgreSQL, the contract store)."""
    return getattr(entry, "pid", None) or entry.facts.get("pid")


def main(kind: str, where: str, backend: str, session: str, priority: str, *mode: str) -> int:
    stalled, looks, froze = [], [], []
    freeze = "freeze" in mode
    stall_behind = next((word.partition("=")[2] for word in mode
                         if word.startswith("stall-behind=")), None)

    def report(ahead, step) -> None:
        name = None if ahead is None else str(pid_of(ahead))
        print(json.dumps({"look": name, "step": step}), flush=True)
        looks.append(name)
        if name is not None and name == stall_behind and step is not None and not stalled:
            stalled.append(step)
            time.sleep(step + 0.5)   # the test's own wait for the clock, never the product's
        if freeze and ahead is None and not froze:   # only before the take, not the look after
            froze.append(True)
            sys.stdin.readline()

    order.after_look = report
    if kind == "postgresql" and os.environ.get("LANELOCK_DIR"):
        # Each waiter stands for a host of its own (a lock root of its own: a host lane of its
        # own), so every one of them waits in the server's queue, as the scenes need; waiters
        # of one host queue on its host lane first (store/pg/hostqueue.py, test_pg_hostqueue).
        os.environ["LANELOCK_DIR"] = os.path.join(os.environ["LANELOCK_DIR"], f"host-{os.getpid()}")
    lane = gate(kind, where, backend)
    if "ready" in mode:
        print(json.dumps({"ready": True}), flush=True)
        sys.stdin.readline()
    with lane.turn(session=session, wait=60, priority=priority) as turn:
        print(json.dumps({"held": turn.held, "state": turn.state, "at": time.monotonic(),
                          "stalled": stalled}), flush=True)
    print(json.dumps({"left": time.monotonic()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
