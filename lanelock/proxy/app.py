"""The per-request decision of `lanelock proxy`.

A generation request (routes.py) takes the lane for exactly as long as the engine answers it: from
the moment it is forwarded until the last byte is relayed, the client hangs up, or the engine
fails. A busy lane: wait (--wait, or the request's X-Lanelock-Wait capped by it), then the fallback
chain (URLs for OpenAI-style paths, @HOST:PORT engines on their own lanes), then 503 with
Retry-After. Every answer to a gated request says X-Lanelock-State (and X-Lanelock-Reason when
deflected or busy). Linger keeps the lane for the same session between its requests, so an agent's
tool-call loop keeps the engine's cache of its conversation.

Never logged: Authorization headers, bodies, the fallback key.
"""

from __future__ import annotations

import asyncio
import json
import math
import time

from aiohttp import web

from .. import asyncturn
from ..gate import (BUSY_WORDS, DEFLECTED, FAIL_OPEN, HELD, REASON_BUSY, UNGATED, Gate,
                    busy_sentence)
from ..holder import words as holder_words
from ..priority import CLASSES, class_named
from . import dialects
from .relay import Unreachable, error_response, relay, request_headers
from .routes import Routes

STATE = "X-Lanelock-State"
REASON = "X-Lanelock-Reason"
WAIT_HEADER = "X-Lanelock-Wait"
PRIORITY_HEADER = "X-Lanelock-Priority"
BUSY = "busy"


class Options:
    def __init__(self, *, fallbacks=(), fallback_model=None, fallback_key=None, wait=0.0,
                 linger=0.0, session_header="X-Lanelock-Session", token=None, cheap_paths=None,
                 quiet=False, verbose=False, max_body=32 << 20, fallback_timeout=60.0,
                 max_priority="interactive", witness=None):
        self.fallbacks = list(fallbacks)
        # fallback_model and fallback_key: {kind or None (every kind): value}
        self.fallback_model = _per_kind(fallback_model)
        self.fallback_key = fallback_key if isinstance(fallback_key, dict) else (
            {None: fallback_key} if fallback_key else {})
        self.fallback_timeout = fallback_timeout   # seconds to a fallback's answer (headers)
        self.wait, self.linger = wait, linger
        self.session_header, self.token = session_header, token
        self.routes = Routes(cheap_paths)
        self.quiet, self.verbose = quiet, verbose
        self.max_body = max_body
        self.max_priority = max_priority   # the highest class a request's header may claim
        self.witness = witness   # (engine URL, interval) to witness the engine, or None


class Lingering:
    """A held turn kept for one session between its requests."""

    __slots__ = ("turn", "session", "timer", "in_use")

    def __init__(self, turn, session: str):
        self.turn, self.session = turn, session
        self.timer = None
        self.in_use = True


class Proxy:
    def __init__(self, gate: Gate, options: Options, say, backend_url: str):
        self.gate, self.options, self.say = gate, options, say
        self.backend_url = backend_url.rstrip("/")
        self.client = None            # aiohttp.ClientSession, made on startup
        self.lingering: Lingering | None = None
        self.failing = False          # inside a fail-open incident: one warning per incident
        self.recent: list[float] = []   # recent hold times of this proxy's turns (Retry-After)
        self.in_flight = 0
        self.waiting = 0              # requests taking the lane now (most of them waiting for it)
        self._idle: asyncio.Event | None = None
        self.ungated = 0              # ungated generation requests (no lane file records them)
        self.gate.warn = self._gate_warning
        self.fallback_gates: dict[str, tuple] = {}   # backend -> fallback_lane.fallback_gate()
        self.witness = None           # the engine's witness (witness.py), when it runs

    # -- warnings ------------------------------------------------------------------------------
    def _gate_warning(self, message: str) -> None:
        if message.startswith("gate unavailable"):
            if self.failing:
                return
            self.failing = True
        self.say.warn(message)

    # -- the handler ---------------------------------------------------------------------------
    def idle(self) -> asyncio.Event:
        """Set while no request is in flight (a shutdown waits for it)."""
        if self._idle is None:
            self._idle = asyncio.Event()
            if not self.in_flight:
                self._idle.set()
        return self._idle

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        self.in_flight += 1
        if self._idle is not None:
            self._idle.clear()
        started = time.monotonic()
        response = None
        try:
            response = await self._handle(request)
            return response
        finally:
            self.in_flight -= 1
            if not self.in_flight and self._idle is not None:
                self._idle.set()
            if self.options.verbose:
                state = response.headers.get(STATE, "-") if response is not None else \
                    request.get("lanelock_state", "-")
                # A stream relayed to its last byte is an answer even if the client hung up
                # before the handler returned (curl closes right after [DONE]).
                status = response.status if response is not None else (
                    request.get("lanelock_status") if request.get("lanelock_done")
                    else "client gone")
                self.say.note(f"proxy: {request.method} {request.raw_path[:200]} {status} "
                              f"{state} {time.monotonic() - started:.3f}s")

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        # Decided on the raw target, forwarded as the raw target: the path judged is the path the
        # engine is asked (routes.py).
        path_qs = request.raw_path
        path = path_qs.partition("?")[0]
        if path == "/lanelock/status" and request.method == "GET":
            return await self._status()
        if path == "/metrics" and request.method == "GET":
            return await self.metrics(request)
        body = await request.read()
        if not self.options.routes.is_gated(request.method, path):
            return await self._forward(request, self.backend_url + path_qs, body, {})
        return await self._gated(request, path_qs, path, body)

    async def metrics(self, request) -> web.Response:
        """lanelock's exposition for this lane, then the engine's own /metrics when it has one
        (llama-server --metrics): one scrape for both."""
        from ..inspection.metrics import LaneCollector, exposition, lanes_fetch

        extra = {self.gate.lane.name: {"ungated": self.ungated}}
        try:
            data = await asyncio.to_thread(
                exposition, LaneCollector(lanes_fetch(self.gate.store, self.gate.lane), extra))
        except ImportError as error:
            return error_response(501, "metrics_unavailable", str(error))
        engine = b""
        try:
            async with self.client.get(self.backend_url + "/metrics") as upstream:
                if upstream.status == 200 and upstream.content_type == "text/plain":
                    engine = await upstream.read()
        except Exception:  # noqa: BLE001 - the engine's metrics are a bonus, never an error
            engine = b""
        body = data + (b"\n" + engine if engine else b"")
        return web.Response(body=body, headers={"Content-Type":
                                                "text/plain; version=0.0.4; charset=utf-8"})

    async def _gated(self, request, path_qs: str, path: str, body: bytes) -> web.StreamResponse:
        fields = _json_fields(body)
        dialect = dialects.of(path)
        request["lanelock_dialect"] = dialect
        session = request.headers.get(self.options.session_header) or \
            dialect.session_of(fields) or (request.remote or "?")
        model = dialect.model_of(fields)
        wait = self._wait_for(request)
        priority = self._priority_for(request)
        reused = self._take_lingering(session)
        turn = reused.turn if reused else self.gate.turn(
            session=session[:200], model=model and model[:200], argv=[request.method, path[:200]],
            wait=wait, labels={"via": "proxy", "client": request.remote or "?",
                               "path": path[:200]},
            askers=_client_of(request), priority=priority)
        status = None
        started = time.monotonic()
        try:
            if reused is None:
                self.waiting += 1
                try:
                    await asyncturn.acquire(turn)
                finally:
                    self.waiting -= 1
            if turn.state == HELD and not turn.nested:
                self.failing = False
            if turn.state in (HELD, UNGATED, FAIL_OPEN):
                if turn.state == UNGATED:
                    self.ungated += 1
                headers = {STATE: turn.state}
                response = await self._forward(request, self.backend_url + path_qs, body, headers)
                status = response.status
                return response
            if turn.state == DEFLECTED:
                return await self._deflected(request, path_qs, body, fields, turn)
            raise asyncio.CancelledError   # a cancelled wait: the client is gone
        finally:
            status = status or request.get("lanelock_status")
            await self._end(turn, session, status, reused, time.monotonic() - started)

    def _wait_for(self, request) -> float | None:
        wait = self.options.wait
        asked = request.headers.get(WAIT_HEADER)
        if asked is not None:
            try:
                seconds = float(asked)
            except ValueError:
                seconds = None
            if seconds is not None and seconds == seconds and seconds >= 0:
                wait = seconds if wait is None else min(seconds, wait)
        return wait

    def _priority_for(self, request) -> str:
        """The request's class: its X-Lanelock-Priority when it names one, capped by
        --max-priority (a client cannot claim more than the proxy allows); else the proxy's."""
        classes = CLASSES
        asked = class_named(request.headers.get(PRIORITY_HEADER))
        if asked is None:
            return self.gate.priority
        return classes[min(classes.index(asked), classes.index(self.options.max_priority))]

    # -- linger -------------------------------------------------------------------------------
    def _take_lingering(self, session: str) -> Lingering | None:
        held = self.lingering
        if held is None or held.in_use or held.session != session or held.turn.state != HELD:
            return None
        if held.timer is not None:
            held.timer.cancel()
            held.timer = None
        held.in_use = True
        return held

    async def _end(self, turn, session, status, reused, elapsed) -> None:
        if turn.state != HELD:
            return
        if not turn.nested:
            self.recent = (self.recent + [elapsed])[-20:]
        linger = self.options.linger
        if linger > 0 and not turn.nested and not turn.lost:
            held = reused or Lingering(turn, session)
            held.in_use = False
            self.lingering = held
            held.timer = asyncio.get_running_loop().call_later(
                linger, lambda: asyncio.ensure_future(self._end_linger(held)))
            return
        await asyncturn.release(turn, status)

    async def _end_linger(self, held: Lingering) -> None:
        if held.in_use or self.lingering is not held:
            return
        self.lingering = None
        await asyncturn.release(held.turn, 0)

    async def close(self) -> None:
        if self.lingering is not None:
            held, self.lingering = self.lingering, None
            if held.timer is not None:
                held.timer.cancel()
            await asyncturn.release(held.turn, 0)

    # -- forwarding ---------------------------------------------------------------------------
    async def _forward(self, request, url: str, body: bytes, state: dict,
                       headers: dict | None = None) -> web.StreamResponse:
        """To the local engine: a failure there is the engine's (502)."""
        if headers is None:
            headers = request_headers(request, drop=self._drop())
        try:
            return await relay(self.client, request, url, body, headers, state)
        except Unreachable as error:
            self.say.warn(f"backend {url.split('?')[0]} unreachable: {error}")
            return error_response(502, "backend_unreachable",
                                  f"the local engine at {self.backend_url} did not answer: {error}",
                                  state)

    async def _deflected(self, request, path_qs, body, fields, turn) -> web.StreamResponse:
        """The fallback chain for a busy lane: the entries that serve the request's dialect, in
        order; one that cannot be reached (refused, no answer within --fallback-timeout) is
        skipped and the next tried. None left: the dialect's busy answer, naming what failed."""
        who = holder_words(turn.holder)
        dialect = request["lanelock_dialect"]
        failures = []
        for index, fallback in enumerate(self.options.fallbacks, 1):
            if not fallback.serves(dialect):
                continue
            if fallback.backend is not None:
                response = await self._local_fallback(request, path_qs, body, fallback, index,
                                                      who, failures)
            else:
                response = await self._url_fallback(request, path_qs, body, fields, fallback,
                                                    index, who, failures)
            if response is not None:
                await asyncturn.settle(turn, "deflected")
                return response
        await asyncturn.settle(turn, "busy")
        failed = "; ".join(failures)
        self.say.note(busy_sentence(who, (f"every fallback failed ({failed})" if failed else
                                          f"no fallback for {request.method} "
                                          f"{path_qs.partition('?')[0][:200]}")
                                    + f": {dialect.busy_status}"))
        message = f"{BUSY_WORDS} ({who})" + (f"; {failed}" if failed else "")
        status, payload = dialects.busy_answer(dialect, REASON_BUSY, message)
        response = web.Response(status=status, body=payload, content_type="application/json")
        response.headers[STATE] = BUSY
        response.headers[REASON] = REASON_BUSY
        response.headers["Retry-After"] = str(await self._retry_after(turn.holder,
                                                                      turn.priority))
        return response

    async def _url_fallback(self, request, path_qs, body, fields, fallback, index, who,
                            failures):
        url = fallback.target(path_qs)
        model = self.options.fallback_model.get(fallback.kind, self.options.fallback_model.get(None))
        if model and fields:
            body = json.dumps({**fields, "model": model}).encode()
        headers = request_headers(request, drop=("authorization", "x-api-key"))
        key = self.options.fallback_key.get(fallback.kind, self.options.fallback_key.get(None))
        name, form = dialects.FALLBACK_KINDS[fallback.kind]["key"]
        if key:
            headers[name] = form.format(key=key)
        elif not self.options.token:   # the client's own credentials, where it sent them
            for credential in ("Authorization", "x-api-key"):
                if credential in request.headers:
                    headers[credential] = request.headers[credential]
        self.say.note(busy_sentence(who, f"deflecting to fallback {index}: {fallback.url}"))
        try:
            return await relay(self.client, request, url, body, headers,
                               {STATE: DEFLECTED, REASON: REASON_BUSY},
                               answer_within=self.options.fallback_timeout)
        except Unreachable as error:
            failures.append(f"fallback {index} {fallback.url} failed: {error}")
            self.say.warn(f"fallback {index} {fallback.url} failed: {error}; trying the next")
            return None

    async def _local_fallback(self, request, path_qs, body, fallback, index, who, failures):
        from ..fallback_lane import busy_fallback, fallback_gate

        if fallback.backend not in self.fallback_gates:
            gate, skip = fallback_gate(self.gate, fallback.backend)
            if gate is None and skip is None:   # not a local lane: its turns are ungated
                gate = self.gate.sibling(fallback.backend)
            self.fallback_gates[fallback.backend] = gate, skip
        gate, skip = self.fallback_gates[fallback.backend]
        if skip:   # run's rule and words (fallback_lane.py)
            self.say.note(f"fallback {index} skipped: {skip}")
            failures.append(f"fallback {index} skipped: {skip}")
            return None
        path = path_qs.partition("?")[0][:200]
        turn = gate.turn(session=f"proxy:{request.remote or '?'}", argv=[request.method, path],
                         labels={"via": "proxy", "client": request.remote or "?"})
        await asyncturn.acquire(turn)
        status = None
        try:
            if turn.state == DEFLECTED:
                skip = busy_fallback(fallback.backend, turn.holder)
                self.say.note(f"fallback {index} skipped: {skip}")
                failures.append(f"fallback {index} @{fallback.backend} is busy")
                return None
            self.say.note(busy_sentence(who, f"deflecting to fallback {index}: "
                                             f"@{fallback.backend}"))
            from ..lanes import origin

            try:
                response = await relay(self.client, request, origin(gate.lane.given) + path_qs,
                                       body, request_headers(request, drop=self._drop()),
                                       {STATE: DEFLECTED, REASON: REASON_BUSY},
                                       answer_within=self.options.fallback_timeout)
            except Unreachable as error:
                failures.append(f"fallback {index} @{fallback.backend} failed: {error}")
                self.say.warn(f"fallback {index} @{fallback.backend} failed: {error}; "
                              "trying the next")
                return None
            status = response.status
            return response
        finally:
            await asyncturn.release(turn, status)

    def _drop(self) -> tuple:
        return ("authorization",) if self.options.token else ()

    async def _retry_after(self, holder: dict | None, priority: str = "normal") -> int:
        """Seconds until this request's class would likely get the lane: a typical turn's length
        (this proxy's recent ones, else the lane's journal) for the holder's turn, less how long
        it has held, plus one for each waiter queued that goes before this class; at least 1.
        The store is read off the loop."""
        typical = _median(self.recent) if self.recent else \
            await asyncio.to_thread(self._journal_typical)
        held_for = (holder or {}).get("held_for") or 0.0
        if typical is None:
            return 1
        ahead = await asyncio.to_thread(self._queued_before, priority)
        return max(1, math.ceil(typical - held_for + typical * ahead))

    def _queued_before(self, priority: str) -> int:
        """Waiters queued now that go before a request of this class (status's queue)."""
        classes = CLASSES
        try:
            [facts] = self.gate.store.survey(self.gate.lane)
        except Exception:  # noqa: BLE001 - an estimate is a nicety
            return 0
        return sum(1 for entry in facts.queue
                   if classes.index(entry["effective_class"]) >= classes.index(priority))

    def _journal_typical(self) -> float | None:
        try:
            events, _ = self.gate.store.events(self.gate.lane, time.time() - 3600)
        except Exception:  # noqa: BLE001 - an estimate is a nicety; 1 s is always honest
            return None
        durations = [event["duration"] for event in events[-200:] if event.get("event") ==
                     "released" and isinstance(event.get("duration"), (int, float))]
        return _median(durations[-20:]) if durations else None

    async def _status(self) -> web.Response:
        from ..inspection.status import statuses

        lanes = await asyncio.to_thread(statuses, self.gate.store, self.gate.lane, True)
        here = {"in_flight": self.in_flight - 1, "taking_the_lane": self.waiting}  # less this one
        if self.witness is not None:   # the witness now: what it saw last, or why it cannot
            here["witness"] = self.witness.now()
        return web.json_response({"lanes": lanes, "proxy": here}, dumps=lambda data: json.dumps(data, indent=2,
                                                                                 sort_keys=True))


def _client_of(request):
    """Who asks for the turn: the client process behind the connection, looked up only if the
    lane is busy (a client handed the holding turn is part of it: handover.py, peer.py)."""
    transport = request.transport
    peer = transport.get_extra_info("peername") if transport is not None else None
    local = transport.get_extra_info("sockname") if transport is not None else None

    def askers():
        if not isinstance(peer, tuple) or not isinstance(local, tuple):
            return []   # not a TCP client (a Unix socket): outside every turn
        from .peer import askers as client_askers

        return client_askers(peer, local)

    return askers


def _per_kind(value) -> dict:
    """{kind: value} from a --fallback-model/--fallback-key value or values: 'KIND=VALUE' for the
    URL fallbacks of one kind, a bare VALUE for all (None: none)."""
    if value is None:
        return {}
    if isinstance(value, dict):
        return dict(value)
    result = {}
    for item in ([value] if isinstance(value, str) else value):
        kind, sep, rest = item.partition("=")
        if sep and kind.lower() in dialects.FALLBACK_KINDS:
            result[kind.lower()] = rest
        else:
            result[None] = item
    return result


def _json_fields(body: bytes) -> dict:
    if not body or body[:1] not in (b"{", b" ", b"\n", b"\r", b"\t"):
        return {}
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return {}
    return data if isinstance(data, dict) else {}


def _median(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
