"""GET /lanelock/status: what the proxy serves and how, as JSON -- the page's data too (page.py).

- "lanes": `lanelock status --json` of each lane the proxy serves (holders by seat, the queue
  with each waiter's class and estimate, the engine and what its witnesses counted), each with
  "last_hour": its journal's last hour, a cell a minute as `history` draws it, and the unseen
  generations of that hour;
- "proxy": its pid, since when, the last reload, requests in flight and taking the lane, its
  witness, the config files read and "settings": every proxy setting's value and source, as
  `config show --json` has them -- never a secret (configured.py);
- "sessions": per session, its turns, seconds held, deflections and waits in the last hour,
  summed over the lanes: `history --json`'s "sessions" (inspection/usage.py) of the same hour.

The journal's hour is read at most once a FRESH per lane, whoever asks (a page open in three
tabs, each polling, reads it once): the lanes' state itself is read on every request.
"""

from __future__ import annotations

import asyncio
import json
import time

from aiohttp import web

FRESH = 1.0   # seconds a lane's last hour is reused
HOUR = 3600.0
_HOURS: dict = {}   # lane name -> (read at, its last hour)


def last_hour(gate, now: float) -> dict:
    """{start, timeline (60 cells), unseen, sessions} of the lane's journal's last hour."""
    from ..inspection.history import from_events, last_hour as cells

    kept = _HOURS.get(gate.lane.name)
    if kept is not None and now - kept[0] < FRESH:
        return kept[1]
    try:
        events, bad = gate.store.events(gate.lane, now - HOUR)
    except Exception:  # noqa: BLE001 - any store's failure: the hour is unknown, the rest stands
        return {"start": None, "timeline": [], "unseen": [], "sessions": {},
                "problem": "the journal cannot be read"}
    data = from_events(events, bad, now)
    start, timeline = cells(data["events"], now)
    unseen = [{key: event.get(key) for key in ("time", "ts", "duration", "slots", "tokens",
                                                "tokens_final", "turns", "witness")}
              for event in data["events"] if event["event"] == "unseen"]
    hour = {"start": start, "timeline": timeline, "unseen": unseen[-50:],
            "sessions": data["sessions"]}
    _HOURS[gate.lane.name] = (now, hour)
    return hour


def body(proxy) -> dict:
    """The answer's body (read in a thread: the stores' reads block)."""
    from ..inspection.render import valid_text   # strict parsers reject lone surrogates
    from ..inspection.status import statuses
    from ..inspection.usage import added
    from .health import proxy_state

    gates = [lane.gate for lane in proxy.lanes]
    lanes = [found for gate in gates for found in statuses(gate.store, gate.lane, True)]
    now = time.time()
    hours = {gate.lane.name: last_hour(gate, now) for gate in gates if gate.gated}
    sessions: dict = {}
    for lane in lanes:
        hour = hours.get(lane["lane"])
        if hour is not None:
            lane["last_hour"] = {key: value for key, value in hour.items() if key != "sessions"}
            added(sessions, hour["sessions"])
    here = proxy_state(proxy)
    if proxy.witness is not None:   # the witness now: what it saw last, or why it cannot
        here["witness"] = proxy.witness.now()
    configured = proxy.configured
    if configured is not None:
        here["settings"] = configured.shown()
        here["config_files"] = list(configured.settings.config.files)
    return valid_text({"lanes": lanes, "proxy": here, "sessions": sessions})


async def answer(request: web.Request) -> web.Response:
    from .app import PROXY

    found = await asyncio.to_thread(body, request.app[PROXY])
    return web.json_response(found, dumps=lambda data: json.dumps(data, indent=2,
                                                                  sort_keys=True))
