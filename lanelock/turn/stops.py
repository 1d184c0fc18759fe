"""Stop points: named steps of a turn where a process can be asked to stop itself.

LANELOCK_DEBUG_PAUSE=STEP makes the process send itself SIGSTOP on reaching STEP, so whoever
watches it (a debugger, a fault injector) acts on it exactly there -- a SIGKILL while it holds
the lock before its record is written, say. Unset, reaching a step costs one environment lookup.
`lanelock run` clears the variable from its command's environment: the stop is asked of the
wrapper, not of the turns its command takes.
"""

from __future__ import annotations

import os

VARIABLE = "LANELOCK_DEBUG_PAUSE"
BEFORE_ACQUIRE = "before-acquire"   # the lane's lock opened, not yet tried
AFTER_ACQUIRE = "after-acquire"     # the lock held, no holder record written yet
DURING_RELEASE = "during-release"   # the release recorded, the lock still held
STEPS = (BEFORE_ACQUIRE, AFTER_ACQUIRE, DURING_RELEASE)


def reached(step: str) -> None:
    """The turn reached step: stop here (SIGSTOP) if this process was asked to."""
    if os.environ.get(VARIABLE) == step:
        import signal

        os.kill(os.getpid(), signal.SIGSTOP)
