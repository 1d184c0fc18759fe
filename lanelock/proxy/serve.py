"""Running `lanelock proxy`: checks before listening, the server, and a bounded shutdown.

- Loopback unless told otherwise: a non-loopback --listen needs --token-env, and then every request
  must carry `Authorization: Bearer TOKEN` (the proxy can spend a cloud key: it must never be an
  open relay).
- Bounded input: request bodies (413) and header fields (431) past the limits are refused.
- Bounded connections (listener.py): the soft fd limit raised to the hard one, at most
  --max-connections at once (fewer if the fd limit says so; the rest wait in the listen backlog,
  idle ones make room), a complete request header within --header-timeout of connecting, an idle
  keep-alive connection closed after --idle-timeout; aiohttp's and asyncio's own log lines are
  one line per incident, never a request's bytes (logs.py).
- SIGTERM/SIGINT: stop accepting, let in-flight answers finish for up to SHUTDOWN seconds, then
  close; a lingering lane is let go. kill -9 frees the lane at once (the kernel, as always).
  SIGHUP: the config files read again (reload.py).
- Its lines start with their time (say.py), unless journald stamps them; the start line says the
  lane's seats and whether requests are pinned to the engine's slots.
"""

from __future__ import annotations

import asyncio
import hmac
import os
import signal

from .. import exitcodes
from ..errors import UsageProblem

SHUTDOWN = 10.0   # seconds from SIGTERM to exit, streams in flight included
CANCEL = 2.0       # of which the last are for cancelling what has not finished
MAX_FIELD = 16 * 1024      # one header line
MAX_HEADERS = 64 * 1024    # all of them
PARSER_LIMIT = 128 * 1024  # aiohttp's own limits, above ours, so that ours answer 431 first
MAX_FIELDS = 256           # header fields in one request
# aiohttp refuses more than 128 header fields with a plain-text 400 of its own: its limit goes far
# above ours (a field costs at least 5 bytes, so this many is past 64 KiB) for ours to answer 431.
PARSER_MAX_HEADERS = MAX_HEADERS


def start(flags: dict):
    """`lanelock proxy` with these flags (None: not given) over the config files: (the Proxy,
    host, port, its Say), everything checked before a socket is opened (UsageProblem: exit 2)."""
    from ..say import Say, journald_stamps
    from ..settings import Settings
    from .configured import Configured, gate_of, options_of

    settings = Settings(flags)
    say = Say(bool(settings.get("proxy_quiet")), stamped=not journald_stamps())
    gate = gate_of(settings, say)
    options = options_of(settings, gate)
    proxy, host, port = build(gate, options, say, settings.get("proxy_listen"),
                              settings.get("proxy_token_env"))
    proxy.configured = Configured(flags, settings)
    return proxy, host, port, say


def build(gate, options, say, listen: str, token_env: str | None):
    """(Proxy, host, port): everything checked before a socket is opened (UsageProblem: exit 2)."""
    from .app import Proxy

    from ..lanes import listen_address

    host, port, loopback = listen_address(listen)
    if token_env:
        token = os.environ.get(token_env)
        if not token:
            raise UsageProblem(f"--token-env {token_env}: the variable is unset or empty")
        options.token = token
    elif not loopback:
        raise UsageProblem(f"--listen {listen} is not a loopback address: the proxy would be an "
                           "open relay; give --token-env VAR (clients then send "
                           "'Authorization: Bearer $VAR'), or listen on 127.0.0.1")
    from ..lanes import origin
    from .fallbacks import local_hint

    for index, fallback in enumerate(options.fallbacks, 1):
        hint = local_hint(fallback, index)
        if hint:
            say.note(hint)
    # The engine's origin (request paths are appended to it), its host as the lane reads it.
    return Proxy(gate, options, say, origin(gate.lane.given)), host, port


def malformed(request):
    """A 400 in the family's shape for a request no engine should be sent, else None: a target
    that is not a path (absolute form 'http://host/...', '*'; the engine's URL is built by
    appending it), a header that is not UTF-8 ('Authorization: Bearer \\xff' cannot be compared
    with the token nor sent on). Judged before the token: it says nothing of it."""
    from . import dialects

    target = request.raw_path
    if not target.startswith("/"):
        return _bad_request(dialects.of("/"), "the request target must be a path starting with "
                            "'/' (origin form), not an absolute URL: this is not a forward proxy")
    for name, value in request.raw_headers:
        try:
            name.decode("ascii"), value.decode("utf-8")
        except UnicodeDecodeError:
            shown = name.decode("ascii", "replace")[:64]
            return _bad_request(dialects.of(target.partition("?")[0]),
                                f"header {shown!r} is not valid UTF-8", shown)
    return None


def _bad_request(dialect, message: str, param: str | None = None):
    from aiohttp import web

    from .dialects import error_answer

    return web.Response(status=400, body=error_answer(dialect, 400, "invalid_request_error",
                                                     message, param),
                        content_type="application/json")


PAGE = "/lanelock/"   # the proxy's own page and its data: a browser may sign in with Basic


def authorised(request, token: str) -> bool:
    """Does the request carry the token? 'Authorization: Bearer TOKEN' (RFC 7235: the scheme in
    any case, the token as it is); under /lanelock/ also Basic with the token as the password
    (any user name), which is what a browser can send for the page."""
    import base64
    import binascii

    scheme, _, given = request.headers.get("Authorization", "").strip().partition(" ")
    scheme, given = scheme.lower(), given.strip()
    if scheme == "basic" and request.raw_path.startswith(PAGE):
        try:
            given = base64.b64decode(given, validate=True).decode("utf-8").partition(":")[2]
        except (binascii.Error, UnicodeDecodeError):
            return False
    elif scheme != "bearer":
        return False
    return hmac.compare_digest(given.encode(), token.encode())


def make_app(proxy):
    """The aiohttp app: the guard, then the in-flight count and the access log (middlewares);
    one route per path -- the proxy's status, the metrics, and every other target."""
    from aiohttp import ClientSession, ClientTimeout, DummyCookieJar, web

    from . import traffic
    from .app import PROXY, UPSTREAM

    @web.middleware
    async def guard(request, handler):
        proxy = request.app[PROXY]
        refused = malformed(request)
        if refused is not None:
            return refused
        total = sum(len(name) + len(value) + 4 for name, value in request.raw_headers)
        if total > MAX_HEADERS or len(request.raw_headers) > MAX_FIELDS or any(
                len(name) + len(value) > MAX_FIELD for name, value in request.raw_headers):
            from .relay import error_response

            return error_response(431, "request_header_fields_too_large",
                                  f"request headers are limited to {MAX_FIELDS} fields, "
                                  f"{MAX_FIELD} bytes a field and {MAX_HEADERS} in all")
        if proxy.options.token is not None and not authorised(request, proxy.options.token):
            from .relay import error_response

            # A browser asks for the page's password (the token) when told how: Basic.
            challenge = {"WWW-Authenticate": 'Basic realm="lanelock proxy"'} \
                if request.raw_path.startswith(PAGE) else None
            return error_response(401, "unauthorized", "this lanelock proxy needs "
                                  "'Authorization: Bearer TOKEN' (its --token-env)", challenge)
        listener = proxy.listener
        if listener is not None:
            listener.started(request.protocol)
        try:
            return await handler(request)
        except web.HTTPRequestEntityTooLarge:
            from .relay import error_response

            return error_response(413, "request_too_large",
                                  f"request bodies are limited to {proxy.options.max_body} bytes")
        finally:
            if listener is not None:
                listener.ended(request.protocol)

    access = traffic.middleware(proxy.in_flight, proxy.say, lambda: proxy.options.verbose)
    app = web.Application(middlewares=[guard, access], client_max_size=proxy.options.max_body,
                          handler_args={"max_field_size": PARSER_LIMIT,
                                        "max_line_size": PARSER_LIMIT,
                                        "max_headers": PARSER_MAX_HEADERS,
                                        "keepalive_timeout": proxy.options.idle_timeout})
    app[PROXY] = proxy
    # One route per path. The proxy's own answer only their raw spelling (a target the router
    # resolves to them, /lanelock/%73tatus, goes to the engine: own.py); another method falls
    # through to the catch-all (the router tries later routes when only the method differs).
    from . import own

    own.add(app)
    app.router.add_route("*", "/{tail:.*}", proxy.handle)

    async def upstream(app):
        # force_close: a new loopback connection per request. On a reused keep-alive connection
        # the client's delayed ACK meets an engine that writes without TCP_NODELAY (Nagle) and
        # holds the first streamed event ~40 ms; a fresh connection costs ~0.1 ms -- opened
        # before the request comes (spare.py).
        from yarl import URL

        from .spare import SpareConnector

        engine = URL(proxy.backend_url)
        # No cookie jar: a cookie one client's answer set (a hostname's engine or fallback: a
        # CDN's) must not go with another client's request -- and nothing is looked up in a
        # jar per request.
        app[UPSTREAM] = ClientSession(
            auto_decompress=False, timeout=ClientTimeout(total=None, sock_connect=10),
            cookie_jar=DummyCookieJar(),
            connector=SpareConnector((engine.raw_host, engine.port), limit=0, force_close=True))
        yield
        await app[PROXY].close()
        await app[UPSTREAM].close()

    app.cleanup_ctx.append(upstream)
    return app


async def serve(proxy, host: str, port: int, say) -> int:
    from aiohttp import web

    from . import logs
    from .listener import Listener, connection_cap, raise_fd_limit

    logs.install(proxy.incidents)
    soft = raise_fd_limit()
    options = proxy.options
    cap = connection_cap(options.max_connections, soft)
    runner = web.AppRunner(make_app(proxy), handler_cancellation=True, access_log=None,
                           shutdown_timeout=CANCEL / 2)
    await runner.setup()
    # Handled from before the proxy says anything: a SIGTERM as soon as it is listening (or its
    # witness has spoken) ends it as every later one does, not by the signal's default action.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signo in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signo, stop.set)
    from .reload import reload

    loop.add_signal_handler(signal.SIGHUP, reload, proxy)
    listener = proxy.listener = Listener(runner.server, host, port, cap=cap,
                                         header_timeout=options.header_timeout,
                                         incidents=proxy.incidents)
    try:
        await listener.start()
    except OSError as error:
        await runner.cleanup()
        # asyncio's strerror repeats the address: the errno's own words are enough
        why = os.strerror(error.errno) if error.errno else (error.strerror or error)
        say.error(f"cannot listen on {host}:{port}: {why}")
        return exitcodes.CANNOT_LISTEN
    bound = listener.address
    shown = f"[{bound[0]}]" if ":" in str(bound[0]) else bound[0]
    say.note(f"proxy listening on http://{shown}:{bound[1]} for {proxy.backend_url} "
             f"(lane {proxy.gate.lane.name}{'' if proxy.gate.gated else ', ungated'})"
             f"{start_words(proxy, await asyncio.to_thread(_seats, proxy.gate))}")
    if cap < options.max_connections:
        say.warn(f"at most {cap} connections at once, not {options.max_connections}: the "
                 f"file descriptor limit is {soft} (raise it: LimitNOFILE=, ulimit -Hn)")
    witness = _witness(proxy, say)
    await stop.wait()
    say.note("proxy stopping: no new connections; letting answers in flight finish")
    try:
        await stop_within(runner, proxy, SHUTDOWN)
    finally:
        if witness is not None:
            await asyncio.to_thread(witness.close, 1.0)
    return 0


def start_words(proxy, seats: int | None) -> str:
    """What the start line says after the lane: its seats and whether requests are pinned to
    the engine's slots ('' for an ungated lane)."""
    if not proxy.gate.gated:
        return ""
    if proxy.lanes.keyed:
        said = "each model's lane its own seats"
    elif seats is None:
        said = "seats unknown (the store cannot say)"
    else:
        said = f"{seats} seat{'' if seats == 1 else 's'}"
    pinned = ("each request pinned to its seat's engine slot (--pin-slots)"
              if proxy.options.pin_slots else "not pinned")
    return f": {said}, {pinned}"


def _seats(gate) -> int | None:
    """The lane's seat count for the start line (None: the store cannot say)."""
    from ..errors import GateUnavailable
    from ..seat_count import read

    try:
        return read(gate) if gate.gated else None
    except GateUnavailable:
        return None


def _witness(proxy, say):
    """The engine's witness, in a thread of its own (its looks never wait on the event loop)."""
    if proxy.options.witness is None:
        return None
    from ..witness_models import witness_for

    url, interval = proxy.options.witness
    proxy.witness = witness_for(proxy.gate, url, interval=interval, tell=say.note, name="proxy")
    return proxy.witness.start()


async def stop_within(runner, proxy, bound: float) -> None:
    """Stop listening, let requests in flight finish, and be gone within `bound` seconds in all
    (aiohttp's own cleanup waits its timeout for the handlers, then again for cancelled ones:
    past a unit's TimeoutStopSec with a stream in flight). What is still running
    at the end is cancelled: its client's connection closes and its lane is let go."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + bound
    if proxy.listener is not None:
        await proxy.listener.stop()
    if proxy.in_flight.count:
        try:
            await asyncio.wait_for(proxy.in_flight.idle().wait(),
                                   max(0.0, deadline - loop.time() - CANCEL))
        except asyncio.TimeoutError:
            pass
    runner._shutdown_timeout = CANCEL / 2   # noqa: SLF001 - aiohttp waits twice this at most
    try:
        await asyncio.wait_for(runner.cleanup(), max(0.1, deadline - loop.time()))
    except asyncio.TimeoutError:
        pass
