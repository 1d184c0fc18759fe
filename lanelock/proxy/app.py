"""The per-request decision of `lanelock proxy`: the handlers of its routes.

A generation request (routes.py) takes the lane for exactly as long as the engine answers it: from
the moment it is forwarded until the last byte is relayed, the client hangs up, or the engine
fails. Its class and wait come from its headers, capped by the proxy's (class_and_wait.py; a
malformed one is a 400). A busy lane: wait, then the fallback chain (fallbacks.py), then the
dialect's busy answer with Retry-After (retry.py). An engine that does not answer: the same
chain, then 502. The holder's own request without turn.headers is told so at once
(handover.py). Every answer to a gated request says X-Lanelock-State, the class and wait
applied, and X-Lanelock-Reason when deflected, busy or down. Linger keeps the lane for the same
session between its requests, so an agent's tool-call loop keeps the engine's cache of its
conversation. The first byte waits only for what decides: on a free lane of one seat the lane is
taken and the request forwarded at once, and the turn's record and journal -- and the name of
a client that sent no session -- follow once it has gone, while the engine works (Recording).
A request's state travels as one proxied.Proxied, handed from step to step.

Never logged: Authorization headers, bodies, the fallback key.
"""

from __future__ import annotations

import asyncio
import time

from aiohttp import ClientSession, web

from .. import asyncturn
from ..duration import backoff
from ..errors import GateUnavailable
from ..gate import CANCELLED, DEFLECTED, FAIL_OPEN, HELD, REASON_BUSY, UNGATED, Gate
from ..handover import HEADER
from ..holder import words as holder_words
from ..priority import DEFAULT_CLASS
from . import class_and_wait, dialects, pinning
from .fallbacks import REASON_DOWN, Why
from .finishing import Finishing
from .listener import HEADER_TIMEOUT, IDLE_TIMEOUT, MAX_CONNECTIONS
from .logs import Incidents
from .lost import REASON_LOST, Cut, LaneLost, ProxyWords, unwatch
from .client_process import ClientProcess
from .per_lane import Lanes
from .recording import Recording, client_session, recorded
from .request_model import Disagree
from .proxied import CUT, REASON, SEAT, SLOT, STATE, Timing
from .relay import Unreachable, error_response, relay, request_headers
from .routes import Routes
from .traffic import PROXIED, InFlight

# The turn's fence (the PostgreSQL store's generation of the lane): on the answer and on the
# request forwarded to the engine, for a check there that refuses a stale holder's requests.
# A client's own is never forwarded: only the proxy says it.
FENCE = "X-Lanelock-Fence"
BUSY = "busy"
DOWN = "down"   # the engine refused or dropped the connection: whatever the lane, it ran nothing
GONE = "client_gone"   # the reason of an abandoned wait: the client hung up
DEFAULT_PROXY_MAX_WAIT = 60.0   # the settings' proxy_max_wait default, for the API
# An answer a retry cannot change (the client holds the lane itself; it sent a malformed header):
# the OpenAI and Anthropic SDKs obey this instead of retrying on their own.
NO_RETRY = {"x-should-retry": "false"}
# The aiohttp session every request goes upstream on (the engine, the fallbacks): the app's.
UPSTREAM = web.AppKey("lanelock_upstream", ClientSession)


class ProxyOptions:
    def __init__(self, *, fallbacks=(), fallback_model=None, fallback_key=None, wait=0.0,
                 max_wait=DEFAULT_PROXY_MAX_WAIT, priority=DEFAULT_CLASS,
                 linger=0.0, session_header="X-Lanelock-Session", token=None, cheap_paths=None,
                 quiet=False, verbose=False, max_body=32 << 20, fallback_timeout=60.0,
                 max_priority="interactive", witness=None, fallback_pass_auth=False,
                 max_connections=MAX_CONNECTIONS, header_timeout=HEADER_TIMEOUT,
                 idle_timeout=IDLE_TIMEOUT, pin_slots=False, clients=None):
        self.fallbacks = list(fallbacks)
        # fallback_model and fallback_key: {kind or None (every kind): value}
        self.fallback_model = _per_kind(fallback_model)
        self.fallback_key = fallback_key if isinstance(fallback_key, dict) else (
            {None: fallback_key} if fallback_key else {})
        self.fallback_timeout = fallback_timeout   # seconds to a fallback's answer (headers)
        self.fallback_pass_auth = fallback_pass_auth   # URL fallbacks get the client's credentials
        # Connections (serve.py, listener.py): how many at once, seconds to a complete header,
        # seconds an idle keep-alive connection is kept.
        self.max_connections = max_connections
        self.header_timeout, self.idle_timeout = header_timeout, idle_timeout
        # wait: seconds a request that asks none waits (None: for ever); max_wait: the cap on
        # what one asks, never below wait (class_and_wait.cap_of); priority: the class of one
        # that names none.
        self.wait, self.linger = wait, linger
        self.max_wait = class_and_wait.cap_of(wait, max_wait)
        self.priority = priority
        self.session_header, self.token = session_header, token
        self.routes = Routes(cheap_paths)
        self.quiet, self.verbose = quiet, verbose
        self.max_body = max_body
        self.max_priority = max_priority   # the highest class a request's header may claim
        self.witness = witness   # (engine URL, interval) to witness the engine, or None
        self.pin_slots = pin_slots   # a llama.cpp engine's slot is the seat (pinning.py)
        self.clients = clients   # per-client waits and classes (clients.Rules), or None

    def own_credentials(self) -> tuple:
        """Request headers never sent on to a local engine: the proxy's own token's."""
        return ("authorization",) if self.token else ()


class Proxy:
    """One proxy's state and the handler of every request for the engine (its own answers:
    own.py)."""

    def __init__(self, gate: Gate, options: ProxyOptions, say, backend_url: str):
        self.gate, self.options, self.say = gate, options, say
        self.backend_url = backend_url.rstrip("/")
        self.failing = False          # inside a fail-open incident: one warning per incident
        self.in_flight = InFlight()   # counted by the middleware (traffic.py)
        self.waiting = 0              # requests taking the lane now (most of them waiting for it)
        self.ungated = 0              # ungated generation requests (no lane file records them)
        gate.warn_with(self._gate_warning)
        # Its requests' short questions share one connection per store server (a burst of
        # them at once would be a burst of connections): store/pg/shared.py.
        gate.store.serve_many()
        gate.store.lease_holds()   # each held request's lane is watched (_watch)
        # Each lane's gate, linger, Retry-After and fallback chain (per_lane.py): the backend's
        # lane, and with lanes keyed by model one per model the requests name.
        self.lanes = Lanes(gate, options, say)
        self.witness = None           # the engine's witness (witness.py), when it runs
        self.listener = None          # the listening socket's accept loop (listener.py)
        self.incidents = Incidents(say)   # trouble said once per incident (logs.py)
        self.pinning = pinning.Pinning(self.backend_url, say) if options.pin_slots else None
        self.finishing = Finishing()   # each session's turns whose answers are ending
        self.configured = None   # the settings it runs with, and since when (configured.py)

    # -- warnings ------------------------------------------------------------------------------
    def _gate_warning(self, message: str) -> None:
        if message.startswith("gate unavailable"):
            if self.failing:
                return
            self.failing = True
        self.say.warn(message)

    # -- the routes ----------------------------------------------------------------------------
    # Its own answers (status, health, metrics, the page) are own.py's routes.
    async def handle(self, request: web.Request) -> web.StreamResponse:
        """Every request that is not for the proxy itself: gated or forwarded."""
        return await self._request(request[PROXIED])

    async def _request(self, proxied) -> web.StreamResponse:
        # Decided on the raw target, forwarded as the raw target: the path judged is the path the
        # engine is asked (routes.py).
        body = await self._body(proxied)
        if body is None:
            return await _late_body(proxied, self.options.header_timeout)
        proxied.read_fields(body)
        proxied.options = self.options   # a reload (reload.py) leaves this request as it came
        upstream = proxied.http.app[UPSTREAM]
        if not self.options.routes.is_gated(proxied.method, proxied.path):
            return await self._forward(upstream, proxied)
        return await self._gated(upstream, proxied)

    async def _body(self, proxied) -> bytes | None:
        """The request's body, complete within the header's time again (None: it was not).
        While it comes, its connection may be closed for a new one at the cap (listener.py)."""
        listener, handler = self.listener, proxied.http.protocol
        if listener is not None:
            listener.reading(handler, True)
        try:
            # A timeout scope, not wait_for: no task of its own per request (the first byte).
            async with asyncio.timeout(self.options.header_timeout):
                return await proxied.http.read()
        except TimeoutError:
            return None
        finally:
            if listener is not None:
                listener.reading(handler, False)

    async def metrics(self, upstream) -> web.Response:
        """lanelock's exposition for the lanes this proxy serves (with lanes keyed by model,
        each model's it has served), then the engine's own /metrics when it has one
        (llama-server --metrics): one scrape for both."""
        from ..inspection.metrics import LaneCollector, exposition, snapshot

        extra = {self.gate.lane.name: {"ungated": self.ungated}}
        gates = [lane.gate for lane in self.lanes]

        def fetch():
            return ([found for gate in gates for found in snapshot(gate.store, gate.lane)],
                    self.gate.store.problems())

        try:
            data = await asyncio.to_thread(exposition, LaneCollector(fetch, extra))
        except ImportError as error:
            return error_response(501, "metrics_unavailable", str(error))
        engine = b""
        try:
            async with upstream.get(self.backend_url + "/metrics") as answer:
                if answer.status == 200 and answer.content_type == "text/plain":
                    engine = await answer.read()
        except Exception:  # noqa: BLE001 - the engine's metrics are a bonus, never an error
            engine = b""
        body = data + (b"\n" + engine if engine else b"")
        return web.Response(body=body, headers={"Content-Type":
                                                "text/plain; version=0.0.4; charset=utf-8"})

    # -- a gated request ------------------------------------------------------------------------
    async def _gated(self, upstream, proxied) -> web.StreamResponse:
        request = proxied.http
        dialect = proxied.dialect = dialects.of(proxied.path)
        try:
            asked = proxied.asked = class_and_wait.read(
                request.headers, default_priority=self.options.priority,
                max_priority=self.options.max_priority, default_wait=self.options.wait,
                max_wait=self.options.max_wait)
        except class_and_wait.Malformed as error:
            return self._refused(dialect, error)
        try:
            model = proxied.model = await self.lanes.model_of(upstream, proxied,
                                                              self._asking_headers(request))
        except Disagree as error:
            return self._refused_body(dialect, error)
        lane = proxied.lane = self.lanes.of(model)
        gate = lane.gate
        client = ClientProcess(request, gate.lock_path)
        given = request.headers.get(self.options.session_header) or \
            dialect.session_of(proxied.fields)
        path = proxied.path[:200]
        ended = []   # (session key, event): this request's turn, once its answer is ending

        def new_turn(wait, session):
            return gate.turn(
                session=session[:200], model=model and model[:200],
                argv=[proxied.method, path], wait=wait,
                labels={"via": "proxy", "client": proxied.remote, "path": path},
                askers=_while_held(gate, client.askers), priority=asked.priority,
                fallback=any(fallback.serves(dialect) for fallback in self.options.fallbacks))

        reused = turn = None
        session = given
        if session is None and self.options.clients:   # a rule may ask the session or program
            session = await client_session(client) or proxied.remote
        if session is not None:
            asked, reused = await self._for_session(proxied, client, lane, session, asked)
        if reused is None:
            # Forward first: a free lane of one seat is taken for the request at once, and the
            # request goes; its record and journal are written while the engine works
            # (Recording). There a request's session decides nothing (no seat to keep for it,
            # no turn of it lingering: that one would hold the lane), so a request that names
            # none is taken under its address and named after its client's process meanwhile.
            turn = new_turn(asked.wait, session or proxied.remote)
            if not lane.seated and asyncturn.held_unrecorded(turn):
                proxied.session = session or proxied.remote
                proxied.recording = Recording(turn, proxied, client if session is None else None)
            else:
                turn = None
                if session is None:   # busy, or seats: named first, then taken as any request
                    session = await client_session(client) or proxied.remote
                    asked, reused = await self._for_session(proxied, client, lane, session,
                                                            asked)
        applied = asked.headers()
        if turn is None:
            turn = reused.turn if reused else new_turn(asked.wait, session)
        proxied.turn = turn
        timing = proxied.timing = Timing()
        try:
            if reused is None and proxied.recording is None:
                self.waiting += 1
                try:
                    turn = proxied.turn = await _take(
                        turn, lambda wait: new_turn(wait, proxied.session), asked.wait)
                    if turn.acquisition.seated is not None:
                        lane.seated = turn.acquisition.seated
                except asyncio.CancelledError:
                    await _abandoned(turn)
                    timing.waited = turn.waited   # the -v line says how long it waited
                    raise
                finally:
                    self.waiting -= 1
            timing.waited = turn.waited
            timing.held_from(turn.state)
            if turn.state == HELD and not turn.nested:
                self.failing = False
            if turn.state in (HELD, UNGATED, FAIL_OPEN):
                return await self._held(upstream, proxied, reused, applied,
                                        lambda: self._ending(proxied, ended))
            if turn.state == DEFLECTED:
                return await self._deflected(upstream, proxied, client, applied)
            await _abandoned(turn)
            raise asyncio.CancelledError   # a cancelled wait: the client is gone
        finally:
            cancelled = False
            try:
                await recorded(proxied)
            except asyncio.CancelledError:   # cancelled again: the turn ends all the same
                cancelled = True
            try:
                await self._end(lane, turn, proxied.session, proxied.status, reused,
                                timing.held_until_now(), proxied.ended())
            finally:
                for key, event in ended:
                    self.finishing.done(key, event)
            if cancelled:
                raise asyncio.CancelledError

    async def _for_session(self, proxied, client, lane, session: str, asked) -> tuple:
        """(the class and wait, the turn lingering for it or None) of a request of session:
        its client's rule's, when one matches (clients.py), once the turns of the session
        whose answers are ending have ended -- their seats go first (finishing.py)."""
        proxied.session = session
        if self.options.clients:
            asked = proxied.asked = await self.options.clients.applied(
                self.options, proxied.http.headers, session, client, asked)
        await self.finishing.wait((lane.gate.lane.name, session))
        return asked, lane.linger.take(session)

    def _ending(self, proxied, ended: list):
        """The relay's word that this request's answer is ending (finishing.py), under its
        session's key -- once a forward-first turn is named (then an awaitable: the relay
        waits for the name before the answer's last bytes)."""
        if proxied.recording is not None and not proxied.recording.done():
            async def named():
                await proxied.recording.wait()
                self._ending(proxied, ended)
            return named()
        key = (proxied.lane.gate.lane.name, proxied.session)
        ended.append((key, self.finishing.begin(key)))
        return None

    async def _held(self, upstream, proxied, reused, applied, ending) -> web.StreamResponse:
        """The lane is this request's (or it goes ungated): relayed to the engine, watched for a
        lane its store takes away. ending: called as the answer's last bytes go (a held seat's
        turn: finishing.py)."""
        turn = proxied.turn
        if turn.state == UNGATED:
            self.ungated += 1
        fence = {FENCE: str(turn.fence)} if turn.state == HELD and \
            turn.fence is not None else {}
        on = proxied.seat = _seat_of(turn)
        seat = {SEAT: str(on)} if on is not None else {}
        # The engine gets the fence with its seat: each seat of a lane numbers its own turns,
        # so a check at the engine keeps the largest fence per seat (hosts.md). A client's own
        # of either is never forwarded.
        forwarded = request_headers(proxied.http,
                                    drop=(*self.options.own_credentials(), FENCE.lower(),
                                          SEAT.lower()),
                                    set_={**fence, **seat} if fence else {})
        body = await self._pinned(proxied, on)
        slot = {SLOT: str(proxied.slot)} if proxied.slot is not None else {}
        watch, cut = self._watch(turn, proxied)
        try:
            return await relay(upstream, proxied, self.backend_url + proxied.target,
                               body, forwarded, {STATE: turn.state, **seat, **slot, **fence,
                                                 **applied},
                               cut=cut, ending=ending if turn.state == HELD and not turn.nested
                               else None,
                               sent=proxied.recording and proxied.recording.start)
        except Unreachable as error:
            await unwatch(watch)
            return await self._down(upstream, proxied, reused, error, applied)
        except LaneLost:
            await unwatch(watch)
            return self._lost(proxied, applied)
        finally:
            await unwatch(watch)   # before the turn's release (_end)

    async def _pinned(self, proxied, seat: int | None) -> bytes:
        """The body to send the engine: with --pin-slots, a held seat's request to llama.cpp
        names the seat's slot (pinning.py); every other request's as it came."""
        if self.pinning is None or seat is None or not pinning.pinned_path(proxied.path):
            return proxied.body
        slot = await self.pinning.slot_of(seat, self.witness)
        pinned = None if slot is None else pinning.with_slot(proxied.body, proxied.fields, slot)
        if pinned is None:
            return proxied.body
        proxied.slot = slot   # the answer's X-Lanelock-Slot and the -v line say it
        return pinned

    def _watch(self, turn, proxied) -> tuple:
        """(the lane watch, its cut) of a request that holds a lane its store can take away
        (PostgreSQL; lost.py), started; (None, None) otherwise (a flock lane, a nested turn)."""
        if turn.state != HELD or turn.nested or turn.handle is None or \
                turn.gate.store.watch_fd(turn.handle) is None:
            return None, None
        from ..lanewatch import LaneWatch

        cut = Cut(asyncio.get_running_loop())
        watch = LaneWatch(turn, self.say.warn, ProxyWords(proxied.method, proxied.path),
                          on_lost=cut.threadsafe)
        watch.start()
        return watch, cut

    def _lost(self, proxied, applied) -> web.Response:
        """The lane was lost for good before the engine's answer started: the request was cut
        (the engine's connection closed); the client gets the dialect's error."""
        proxied.cut = CUT["lost"]
        body = dialects.error_answer(proxied.dialect, 503, REASON_LOST,
                                     f"{CUT['lost']}; the request was cut, try again")
        return _answer(503, body, {STATE: proxied.turn.state, REASON: REASON_LOST, **applied})

    def _refused_body(self, dialect, error) -> web.Response:
        """A body two readers read differently (request_model.py): which model the engine
        would run cannot be told, so it runs nothing -- 400 in the client's dialect."""
        body = dialects.error_answer(dialect, 400, "ambiguous_request_body",
                                     f"lanelock cannot tell which model this request names: "
                                     f"{error}", "model")
        return _answer(400, body, NO_RETRY)

    def _asking_headers(self, request) -> dict:
        """The client's credentials, for asking the engine its models (llama-swap's
        /v1/models may need its API key) -- unless they are the proxy's own token."""
        given = request.headers.get("Authorization")
        return {"Authorization": given} if given and not self.options.token else {}

    def _refused(self, dialect, error: class_and_wait.Malformed) -> web.Response:
        """A malformed X-Lanelock-* header: 400 in the client's dialect, naming the header,
        before the lane is asked (the caps said, so the client sees what it may ask)."""
        body = dialects.error_answer(dialect, 400, "invalid_lanelock_header", str(error),
                                     error.header)
        caps = class_and_wait.caps(self.options.max_priority, self.options.max_wait)
        return _answer(400, body, {**caps, **NO_RETRY})

    # -- the turn's end ------------------------------------------------------------------------
    async def _end(self, lane, turn, session, status, reused, held_seconds,
                   ended=None) -> None:
        """A held turn whose request is over: counted for its lane's Retry-After, then kept for
        the session (linger.py) or released with how its answer ended."""
        if turn.state != HELD:
            return
        if not turn.nested:
            lane.retry_after.held(held_seconds)
        if lane.linger.seconds > 0 and not turn.nested and not turn.lost and \
                turn.gate.store.takes_lanes_away:
            # No watch renews it while it lingers: its store must not end it for the silence.
            await asyncio.to_thread(turn.gate.store.rest, turn.handle, lane.linger.seconds)
        if not lane.linger.keep(turn, session, reused):
            await asyncturn.release(turn, status, ended)

    async def close(self) -> None:
        await self.lanes.close()

    # -- forwarding ---------------------------------------------------------------------------
    async def _forward(self, upstream, proxied) -> web.StreamResponse:
        """An ungated request, to the local engine: a failure there is the engine's (502)."""
        url = self.backend_url + proxied.target
        try:
            return await relay(upstream, proxied, url, proxied.body,
                               request_headers(proxied.http,
                                               drop=self.options.own_credentials()), {})
        except Unreachable as error:
            self.incidents("engine-down", f"backend {url.split('?')[0]} unreachable: {error}")
            return error_response(502, "backend_unreachable",
                                  f"the local engine at {self.backend_url} did not answer: {error}",
                                  {STATE: DOWN, REASON: REASON_DOWN})

    async def _down(self, upstream, proxied, reused, error, applied) -> web.StreamResponse:
        """The local engine did not answer (refused, or reset before a byte came back): the lane
        goes at once (nothing runs on it, and no linger keeps it), then the fallback chain; 502
        naming each attempt when none is left."""
        turn = proxied.turn
        await recorded(proxied)   # named and recorded before it is let go
        proxied.status = 502
        proxied.lane.linger.forget(reused)
        await asyncturn.release(turn, 502)
        why = Why.down(f"the local engine at {self.backend_url} did not answer: {error}")
        response, failures = await proxied.lane.chain.walk(upstream, proxied, why, applied)
        if response is not None:
            return response
        failed, said = failures.texts()
        self.incidents("engine-down", why.sentence(
            f"every fallback failed ({said})" if failed else
            f"no fallback for {proxied.method} {proxied.path[:200]}: 502"))
        body = dialects.error_answer(proxied.dialect, 502, REASON_DOWN,
                                     why.words + (f"; {failed}" if failed else ""))
        return _answer(502, body, {STATE: DOWN, REASON: REASON_DOWN, **applied})

    async def _deflected(self, upstream, proxied, client, applied) -> web.StreamResponse:
        """A busy lane: the fallback chain; none left, the dialect's busy answer, naming what
        failed. The holder's own request is told at once what to send instead. A crowded gate
        (out of descriptors or memory: whether the lane is held cannot be read) is answered
        the same way, never forwarded to the engine."""
        turn, dialect = proxied.turn, proxied.dialect
        if client.holds(turn.holder):
            await asyncturn.settle(turn, "busy")
            return self._holds_itself(dialect, turn.holder, client, applied)
        why = (Why.crowded(turn.crowded, turn.reason) if turn.crowded
               else Why.busy(holder_words(turn.holder)))
        response, failures = await proxied.lane.chain.walk(upstream, proxied, why, applied)
        if response is not None:
            await asyncturn.settle(turn, "deflected")
            return response
        await asyncturn.settle(turn, "busy")
        failed, said = failures.texts()
        self.say.note(why.sentence((f"every fallback failed ({said})" if failed else
                                    f"no fallback for {proxied.method} {proxied.path[:200]}")
                                   + f": {dialect.busy_status}"))
        capped = "".join(f"; {sentence}" for sentence in proxied.asked.capped)
        status, payload = dialects.busy_answer(dialect, why.reason,
                                               why.words + (f"; {failed}" if failed else "")
                                               + capped)
        retry = 1 if turn.crowded else await proxied.lane.retry_after.seconds(turn.holder,
                                                                              turn.priority)
        return _answer(status, payload, {STATE: BUSY, REASON: why.reason, **applied,
                                         "Retry-After": str(retry)})

    def _holds_itself(self, dialect, holder: dict, client, applied) -> web.Response:
        """The holding process asked without its turn's headers: waiting would wait for its
        own turn, and a retry cannot help while it holds the lane -- so no Retry-After, and
        the SDKs are told not to retry."""
        session = holder.get("session")
        whose = f"pid {holder['pid']}" + (f", session {session}" if session else "")
        if client.sent is None:
            message = (f"this process holds the lane ({whose}): send turn.headers with the "
                       "request to make it part of the turn")
        else:
            message = (f"this process holds the lane ({whose}), and the {HEADER} it sent names "
                       "another turn: send the holding turn's turn.headers with the request to "
                       "make it part of the turn")
        self.say.note(f"{REASON_BUSY}: {message}")
        status, payload = dialects.busy_answer(dialect, REASON_BUSY, message)
        return _answer(status, payload, {STATE: BUSY, REASON: REASON_BUSY, **applied,
                                         **NO_RETRY})


# The app's Proxy (serve.py's middlewares read it).
PROXY = web.AppKey("lanelock_proxy", Proxy)


def _answer(status: int, body: bytes, headers: dict) -> web.Response:
    # aiohttp knows no phrase for 529 (the Anthropic busy answer): its status line would end
    # in an empty one.
    response = web.Response(status=status, reason=dialects.REASON_PHRASES.get(status),
                            body=body, content_type="application/json")
    for name, value in headers.items():
        response.headers[name] = value
    return response


async def _late_body(proxied, seconds: float) -> web.Response:
    """408 for a body that did not come in time, in the family's shape; the connection closes
    once it is sent (the rest of the body is never read)."""
    dialect = dialects.of(proxied.path)
    body = dialects.error_answer(dialect, 408, "request_timeout",
                                 f"the request body did not arrive within {seconds:g} s of its "
                                 "header (--header-timeout)")
    response = _answer(408, body, {})
    response.force_close()
    await response.prepare(proxied.http)
    await response.write_eof()
    # Closed here, not by aiohttp: it would linger up to 10 s reading the rest of a body that is
    # not coming, the connection's place at the cap held all that time.
    proxied.http.protocol.force_close()
    return response


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


def _seat_of(turn) -> int | None:
    """The seat a held request runs on: its turn's, or for a request that is part of another
    turn (handed over: a `run` turn's command asking through the proxy), that turn's."""
    if turn.seat is not None:
        return turn.seat
    return turn.acquisition.part_of if turn.state == HELD and turn.nested else None


def _while_held(gate, askers):
    """The client's askers for the gate (handover.py), looked up only while a turn holds a seat
    of the lane. On a lane of seats the gate asks them before it tries a seat (one turn must not
    become two), for every request, free lane or not: the lookup reads the descriptors of
    every process of the client's uid (milliseconds, on the event loop). A lane no turn holds has no turn to
    be part of, nor a holder to be: the records say so for the price of reading them. A store
    whose every read is a round trip (PostgreSQL) is asked nothing more."""
    if gate.store.blocking_io:
        return askers

    def asked():
        try:
            holding = gate.store.seats_holding(gate.lane)[0]
        except GateUnavailable:
            holding = None
        return [] if holding == 0 else askers()

    return asked


async def _take(turn, new_turn, wait: float | None):
    """The turn, taken; a crowded one taken again with what is left of wait (None: for ever),
    a new turn each time, until it is not crowded or the wait is over (then it deflects)."""
    deadline = None if wait is None else time.monotonic() + wait
    tries = 0
    while True:
        await asyncturn.acquire(turn)
        if not turn.crowded:
            return turn
        left = None if deadline is None else deadline - time.monotonic()
        pause = backoff(tries)   # what a crowded gate lacks comes back as other requests end
        if left is not None and left <= pause:
            return turn
        tries += 1
        await asyncio.sleep(pause)
        turn = new_turn(None if left is None else left - pause)


async def _abandoned(turn) -> None:
    """A request whose client hung up while it waited for the lane: its wait is journaled as
    abandoned (Turn.abandon), off the loop, and written even if the task is cancelled again."""
    if turn.state == CANCELLED:
        await asyncio.shield(asyncio.to_thread(turn.abandon, GONE))
