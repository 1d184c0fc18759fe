"""lanelock's own exceptions: what crosses the store interface and reaches the callers.

A store never lets an OSError or a driver's exception out: callers decide on these alone.
"""

import errno


class LanelockError(Exception):
    """Base of lanelock's own errors."""


class GateUnavailable(LanelockError):
    """The gate cannot be taken here; the turn runs without it (fail open)."""


class GateCrowded(GateUnavailable):
    """The gate is there, but this process cannot take it now: it ran out of file descriptors
    (EMFILE, ENFILE), memory (ENOMEM) or lock records (ENOLCK). Crowded is not broken: the turn
    cannot tell whether the lane is held, so it deflects (reason gate_crowded), never runs
    ungated beside a holder as a turn on a broken gate does."""

    reason = "gate_crowded"


class ServerCrowded(GateCrowded):
    """A lane server refused a connection for load (PostgreSQL's too_many_connections: every
    slot taken, or the rest reserved). Unlike a process's own descriptors, the server's
    connections are every turn's and free again as turns end: a turn with a wait asks again
    while its wait lasts (gate.Turn._take), one without deflects (gate_crowded)."""


class GateUntrusted(GateCrowded):
    """The gate's place is there but another user could remove or lock out its files (a lock
    root group/other-writable without the sticky bit, a default root owned by another
    unprivileged user). Attacked is not broken: failing open would let that user switch the
    gate off for everyone, so the turn deflects as a crowded one does (it cannot tell whether
    the lane is held), reason gate_untrusted, with the fix named."""

    reason = "gate_untrusted"


# The errnos that say "out of resources", not "no gate here".
CROWDED_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOLCK, errno.ENOBUFS})


def crowded(error: BaseException | None) -> bool:
    """Does error (or the OSError it was raised from: a store's GateUnavailable says why in
    words and keeps the OSError as its context) say the process or machine is out of
    descriptors, memory or locks?"""
    while error is not None:
        if isinstance(error, OSError) and error.errno in CROWDED_ERRNOS:
            return True
        error = error.__cause__ or error.__context__
    return False


class RecordNotWritten(LanelockError):
    """A holder record or an event could not be written. The turn keeps its lane and warns:
    a record labels a turn, it never decides one."""


class UsageProblem(LanelockError):
    """Bad input found once the arguments are parsed (a malformed backend, store URL or
    fallback): exit 2, nothing runs."""


class WouldBlock(LanelockError):
    """A try-only take (an asyncio turn's first try, on the event loop) found the lane busy:
    nothing was recorded; the caller waits elsewhere and tries again."""
