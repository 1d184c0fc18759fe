"""Loaded by a test's Python process whose PYTHONPATH starts with this folder: on SIGUSR2 it
appends one line to $LANELOCK_TEST_OBJECTS -- the blocks Python's allocator holds live after a
full collection (sys.getallocatedblocks) -- so a test reads the process's live objects from
outside, free of what the allocators keep of memory once used (arenas, glibc's per-thread pools),
which an RSS reading is not."""

import os
import signal

_OUT = os.environ.get("LANELOCK_TEST_OBJECTS")


def _report(signum, frame):
    import gc
    import sys

    gc.collect()
    with open(_OUT, "a") as out:
        out.write(f"{sys.getallocatedblocks()}\n")


if _OUT:
    signal.signal(signal.SIGUSR2, _report)
