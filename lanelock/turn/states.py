"""A turn's states (LANELOCK_STATE, turn.state, the proxy's X-Lanelock-State), and the reason
of a turn that found its lane busy."""

HELD, DEFLECTED, UNGATED = "held", "deflected", "ungated"
FAIL_OPEN, RELEASED = "fail-open", "released"
CANCELLED = "cancelled"   # an asyncio turn whose task was cancelled while it waited
REASON_BUSY = "local_backend_busy"
