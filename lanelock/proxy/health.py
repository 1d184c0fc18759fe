"""GET /lanelock/health: the proxy's own health, for a load balancer, a systemd check or a person.

200 while the engine answers, 503 while it does not, with a JSON body either way: the proxy's
state (serving, its pid, since when, requests in flight and taking the lane, the last reload),
the engine's answer (one look at what costs it nothing -- llama.cpp's /slots, llama-swap's
/running, /metrics: engine.py, never a request that could load a model) and the seats of each
lane it serves, held and in all. "Proxy up, engine down" is a 503 that says so, never the
engine's own 404 or health passed through. An engine that answers but cannot be witnessed
(Ollama) answers: 200.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

from aiohttp import web

from .. import engine as engines
from ..errors import GateUnavailable

_ENGINES: dict = {}   # url -> engine.Engine, its kind found once


def look(url: str) -> dict:
    """{url, answers, kind, generating, slots, problem}: one look at the engine."""
    engine = _ENGINES.get(url)
    if engine is None:
        engine = _ENGINES[url] = engines.Engine(url)
    found = {"url": url, "answers": True, "kind": None, "generating": None, "slots": None,
             "problem": None}
    try:
        account = engine.sample()
        found.update(kind=engine.kind, generating=account.generating, slots=account.slots)
    except engines.CannotWitness as error:
        found.update(kind=error.kind or engine.kind, problem=f"cannot witness: {error}")
    except engines.Unreadable as error:
        engine.kind = None   # asked afresh next time: it may come back as another engine
        found.update(answers=False, problem=f"not answering: {error}")
    return found


def seats(proxy) -> list[dict]:
    """Each lane the proxy serves: {lane, seats, held} (None where the store cannot say)."""
    from ..seat_count import read

    lanes = []
    for lane in proxy.lanes:
        gate = lane.gate
        if not gate.gated:
            lanes.append({"lane": gate.lane.name, "seats": None, "held": None, "gated": False})
            continue
        try:
            count = read(gate)
        except GateUnavailable:
            count = None
        try:
            held = gate.store.seats_holding(gate.lane)[0]
        except GateUnavailable:
            held = None
        lanes.append({"lane": gate.lane.name, "seats": count, "held": held, "gated": True})
    return lanes


def proxy_state(proxy) -> dict:
    configured = proxy.configured
    started = configured.started if configured is not None else None
    return {"state": "serving", "pid": os.getpid(),
            "started": _utc(started), "uptime": round(time.time() - started, 3)
            if started else None, "reloaded": _utc(configured.reloaded if configured else None),
            "in_flight": proxy.in_flight.count - 1,   # less this one
            "taking_the_lane": proxy.waiting}


async def answer(request: web.Request) -> web.Response:
    from .app import PROXY

    proxy = request.app[PROXY]
    engine, lanes = await asyncio.gather(asyncio.to_thread(look, proxy.backend_url),
                                         asyncio.to_thread(seats, proxy))
    body = {"proxy": proxy_state(proxy), "engine": engine, "lanes": lanes}
    if proxy.witness is not None:
        body["witness"] = proxy.witness.now()
    return web.json_response(body, status=200 if engine["answers"] else 503,
                             dumps=lambda data: json.dumps(data, indent=2, sort_keys=True))


def _utc(when: float | None) -> str | None:
    if when is None:
        return None
    from ..facts import utc_now

    return utc_now(when)
