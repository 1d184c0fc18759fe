"""GET /lanelock/: the proxy's page -- every lane it serves, its seats with holder, session, model
and how long, the queue with each waiter's class, place and estimate, the engine and the
generations no turn covered, the last hour a minute a cell, and each session's usage.

Three files shipped in the package (page/: HTML, script, style), served by the proxy itself:
nothing from the internet, no font, no framework, so the page works on a box with no internet.
The script polls /lanelock/status (state.py) once a second and redraws in place -- polling, not
server-sent events: an open stream would be a request in flight that holds up the proxy's
shutdown for its whole bound, and a page is one more client a busy proxy should not keep.
Everything the page shows is set as text (never parsed as HTML: a session may name itself
anything). A Content-Security-Policy allows only the proxy's own script, style and data.

With --token-env the page is the token's, as every route (serve.py): a browser asks for it as a
password (HTTP Basic, any user name) and sends it with each poll.
"""

from __future__ import annotations

from importlib import resources

from aiohttp import web

HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
                               "connect-src 'self'; img-src 'self' data:; base-uri 'none'; "
                               "form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
FILES = {"/lanelock/": ("index.html", "text/html"),
         "/lanelock/page.js": ("page.js", "text/javascript"),
         "/lanelock/page.css": ("page.css", "text/css")}


def _read(name: str) -> bytes:
    return resources.files(__package__).joinpath("page", name).read_bytes()


def _serve(name: str, content_type: str):
    body = _read(name)   # read once, at start: the package's files do not change under it

    async def answer(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type=content_type, charset="utf-8",
                            headers=HEADERS)

    return answer


ROUTES = {path: _serve(name, content_type) for path, (name, content_type) in FILES.items()}
