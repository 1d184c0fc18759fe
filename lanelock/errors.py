"""lanelock's own exceptions: what crosses the store interface and reaches the callers.

A store never lets an OSError or a driver's exception out: callers decide on these alone.
"""


class LanelockError(Exception):
    """Base of lanelock's own errors."""


class GateUnavailable(LanelockError):
    """The gate cannot be taken here; the turn runs without it (fail open)."""


class RecordNotWritten(LanelockError):
    """A holder record or an event could not be written. The turn keeps its lane and warns:
    a record labels a turn, it never decides one."""


class UsageProblem(LanelockError):
    """Bad input found once the arguments are parsed (a malformed backend, store URL or
    fallback): exit 2, nothing runs."""


class WouldBlock(LanelockError):
    """A try-only take (an asyncio turn's first try, on the event loop) found the lane busy:
    nothing was recorded; the caller waits elsewhere and tries again."""
