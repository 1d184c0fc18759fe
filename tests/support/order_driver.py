"""A turn waiting in a lane's queue that reports every look of the order (store/order.py), for
tests/test_order.py:

    order_driver.py KIND WHERE BACKEND SESSION PRIORITY [stall=N | freeze]

Each look prints {"look": ahead-or-null, "step": seconds-or-null} on stdout; once the turn holds
the lane it prints {"held": true, "state": ..., "at": CLOCK_MONOTONIC seconds} and lets go, then
prints {"left": ...}. With stall=N, its Nth look, if it finds someone ahead and a step coming, is
held up until that step has passed: an aging step falls between the look and the wait it decides.
With freeze, a look that finds it first is held up until a line on stdin: a waiter frozen between
the look that gives it the lane and its take (the lane free, the waiter queued).
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
    freeze = mode == ("freeze",)
    stall_at = int(mode[0].partition("=")[2]) if mode and not freeze else 0

    def report(ahead, step) -> None:
        name = None if ahead is None else str(pid_of(ahead))
        print(json.dumps({"look": name, "step": step}), flush=True)
        looks.append(name)
        if len(looks) == stall_at and ahead is not None and step is not None:
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
    with gate(kind, where, backend).turn(session=session, wait=60, priority=priority) as turn:
        print(json.dumps({"held": turn.held, "state": turn.state, "at": time.monotonic(),
                          "stalled": stalled}), flush=True)
    print(json.dumps({"left": time.monotonic()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
