"""The proxy's own answers, one route per path ahead of the catch-all (serve.make_app): its status,
health, metrics and page, each answering only its raw spelling -- a target that merely resolves
to one (/lanelock/%73tatus, /./metrics) is a request for the engine, as every other (app.py).
They are the proxy's own polls: counted in flight, never in the -v log.
"""

from __future__ import annotations

from aiohttp import web

from . import health, page, state
from .app import PROXY, UPSTREAM
from .traffic import PROXIED


async def _metrics(request: web.Request) -> web.Response:
    return await request.app[PROXY].metrics(request.app[UPSTREAM])


ANSWERS = {"/lanelock/status": state.answer, "/lanelock/health": health.answer,
           "/metrics": _metrics, **page.ROUTES}


def add(app: web.Application) -> None:
    """Register the proxy's own routes on app (before the catch-all)."""
    for path, answer in ANSWERS.items():
        app.router.add_get(path, _only_its_spelling(path, answer), allow_head=False)


def _only_its_spelling(path: str, answer):
    async def handler(request: web.Request) -> web.StreamResponse:
        proxied = request[PROXIED]
        if proxied.path != path:
            return await request.app[PROXY].handle(request)
        proxied.own = True
        return await answer(request)

    return handler
