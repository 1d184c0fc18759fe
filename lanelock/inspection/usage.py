"""Who used the engine: each session's turns, seconds held, deflections and waits, from the same
journal events `history` reads (history.from_events: deflections settled, each turn's hold
known) -- so `history --json`'s "sessions" and the proxy's /lanelock/status "sessions" (the last
hour) are the same numbers, as LiteLLM's usage per key is for a gateway.

Per session: turns (local, deflected, busy and fail-open, as history's summary counts them),
local, held (seconds the session's local turns held the lane; a turn still holding counts to
now, one whose end is unknown not at all), deflected (sent to a fallback), busy (nothing ran),
fail_open, waited (seconds spent in the queue: before the lane, before a deflection after the
whole wait, and before a client hung up) and timed_out (deflections after the whole wait).
A turn without a session is counted under "?".
"""

from __future__ import annotations

FIELDS = ("turns", "local", "held", "deflected", "busy", "fail_open", "waited", "timed_out")


def sessions(events: list[dict]) -> dict:
    """{session: {FIELDS}} of from_events' events, sessions in the order of their first event."""
    found: dict = {}
    for event in events:
        kind = event["event"]
        if kind not in ("acquired", "deflected", "fail-open", "waited", "abandoned"):
            continue
        session = event.get("session")
        name = str(session)[:200] if isinstance(session, (str, int, float)) and \
            not isinstance(session, bool) else "?"
        row = found.setdefault(name, dict.fromkeys(FIELDS, 0))
        waited = _seconds(event.get("waited"))
        if kind == "acquired":
            row["local"] += 1
            row["held"] += _seconds(event.get("held")) or 0.0
        elif kind == "deflected":
            row["busy" if event.get("outcome") == "busy" else "deflected"] += 1
            row["timed_out"] += waited is not None
            row["waited"] += waited or 0.0
        elif kind == "fail-open":
            row["fail_open"] += 1
        else:   # a wait before the lane came, or one given up
            row["waited"] += waited or 0.0
    for row in found.values():
        row["turns"] = row["local"] + row["deflected"] + row["busy"] + row["fail_open"]
        row["held"], row["waited"] = round(row["held"], 3), round(row["waited"], 3)
    return found


def added(into: dict, more: dict) -> dict:
    """into with more's sessions added field by field (a proxy's lanes, each its journal)."""
    for name, row in more.items():
        if name not in into:
            into[name] = dict(row)
            continue
        for field in FIELDS:
            into[name][field] = round(into[name][field] + row[field], 3) \
                if isinstance(row[field], float) else into[name][field] + row[field]
    return into


def _seconds(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        return None
    return float(value)
