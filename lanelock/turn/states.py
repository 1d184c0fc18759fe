"""A turn's states (LANELOCK_STATE, turn.state, the proxy's X-Lanelock-State) and its busy reason."""

HELD, DEFLECTED, UNGATED, FAIL_OPEN, RELEASED = "held", "deflected", "ungated", "fail-open", "released"
CANCELLED = "cancelled"   # an asyncio turn whose task was cancelled while it waited
REASON_BUSY = "local_backend_busy"
