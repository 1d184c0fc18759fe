"""The proxy's fallbacks (--fallback entries) and their chain: where a request goes when the local
model cannot serve it -- its lane is busy (local_backend_busy), or its engine is down
(local_backend_down: connection refused or reset before a byte of an answer came back).

The entries that serve the request's dialect are tried in order; one that cannot be reached
(refused, no answer within --fallback-timeout) is skipped and the next tried; one that answers,
even with an error, is the answer. A URL fallback is sent the request with its own model and key;
an @HOST:PORT engine is taken on its own lane, and skipped when that is busy. The caller answers
when none is left, naming what failed.

A fallback that cannot be reached is said once per incident: the first failure warns in full
(what was tried, why it failed), later ones only count in the answer and the busy line ("still
unreachable"), and the first answer after it says it answers again. Every request still tries it.
"""

from __future__ import annotations

import json
import time

from .. import asyncturn
from ..gate import DEFLECTED, REASON_BUSY, BUSY_WORDS, busy_sentence
from . import dialects
from .proxied import REASON, STATE
from .relay import Unreachable, relay, request_headers

REASON_DOWN = "local_backend_down"
# A client's credentials, in every spelling the APIs use (request_headers compares lower case).
CREDENTIALS = ("authorization", "proxy-authorization", "cookie", "x-api-key", "api-key")
DOWN_WORDS = "local model not answering"
REASON_CROWDED = "gate_crowded"   # errors.GateCrowded.reason
CROWDED_WORDS = "lanelock's gate is crowded: whether the local model is in use cannot be read now"
REASON_UNTRUSTED = "gate_untrusted"   # errors.GateUntrusted.reason
UNTRUSTED_WORDS = ("lanelock's gate is not to be trusted (another user could remove its files): "
                   "the local model is not used until it is fixed")


class Fallback:
    """--fallback [KIND=]URL (a base URL of an API of that kind: openai, the default, such as
    https://api.openai.com/v1; anthropic, such as https://api.anthropic.com) or --fallback
    @HOST:PORT (another local engine, gated on its own lane; it takes every dialect)."""

    __slots__ = ("text", "url", "backend", "kind")

    def __init__(self, text: str):
        self.text = text.strip()
        self.url = self.backend = self.kind = None
        if self.text.startswith("@"):
            self.backend = self.text[1:]
            return
        kind, sep, rest = self.text.partition("=")
        if sep and kind.lower() in dialects.FALLBACK_KINDS:
            self.kind, self.url = kind.lower(), rest.strip().rstrip("/")
        else:
            self.kind, self.url = "openai", self.text.rstrip("/")

    def serves(self, dialect) -> bool:
        return self.backend is not None or dialect.fallback_kind == self.kind

    def target(self, raw_path_qs: str) -> str | None:
        """The URL a request goes to at this URL fallback (None for an @ engine)."""
        if self.url is None:
            return None
        strip = dialects.FALLBACK_KINDS[self.kind]["strip"]
        path = raw_path_qs[len(strip):] if strip and raw_path_qs.startswith(strip + "/") \
            else raw_path_qs
        return self.url + path


def local_hint(fallback: Fallback, index: int) -> str | None:
    """Said once, at start, of a URL fallback that is a server of this machine: it is used
    ungated -- beside whatever runs on it -- while @HOST:PORT would gate it on its own lane."""
    import ipaddress
    from urllib.parse import urlsplit

    if fallback.url is None:
        return None
    try:
        parts = urlsplit(fallback.url)
        host, port = parts.hostname, parts.port
    except ValueError:
        return None
    if host is None:
        return None
    try:
        local = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        local = False
    if not local:
        return None
    where = f"[{host}]" if ":" in host else host
    port = port or (443 if parts.scheme == "https" else 80)
    return (f"fallback {index} {fallback.url} is a server of this machine, used ungated; "
            f"--fallback @{where}:{port} would gate it on its own lane")


def parse_fallback(text: str) -> Fallback:
    """A Fallback, or ValueError with the reason (a usage error)."""
    fallback = Fallback(text)
    if fallback.backend is not None:
        from ..lanes import lane_for

        lane_for(fallback.backend)   # BackendError (a ValueError) for a malformed one
        return fallback
    from urllib.parse import urlsplit

    parts = urlsplit(fallback.url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        examples = ", ".join(f"{kind}={info['example']}"
                             for kind, info in dialects.FALLBACK_KINDS.items())
        raise ValueError(f"--fallback {text!r}: expected an http(s):// base URL (optionally "
                         f"KIND=URL: {examples}), or @HOST:PORT for another local engine")
    return fallback


class Why:
    """Why the local model cannot serve a request: a reason, and the line each deflection
    prints ('REASON: WORDS (DETAIL); THEN', the busy line of `run` for a busy lane)."""

    __slots__ = ("reason", "detail")

    def __init__(self, reason: str, detail: str):
        self.reason, self.detail = reason, detail

    @classmethod
    def busy(cls, who: str) -> "Why":
        return cls(REASON_BUSY, who)

    @classmethod
    def down(cls, error: str) -> "Why":
        return cls(REASON_DOWN, error)

    @classmethod
    def crowded(cls, error: str, reason: str = REASON_CROWDED) -> "Why":
        return cls(reason, error)   # gate_untrusted too: the gate is there, not to be believed

    @property
    def words(self) -> str:
        said = {REASON_BUSY: BUSY_WORDS, REASON_CROWDED: CROWDED_WORDS,
                REASON_UNTRUSTED: UNTRUSTED_WORDS}.get(self.reason, DOWN_WORDS)
        return f"{said} ({self.detail})"

    def sentence(self, then: str | None = None) -> str:
        if self.reason == REASON_BUSY:
            return busy_sentence(self.detail, then)
        return f"{self.reason}: {self.words}" + (f"; {then}" if then else "")


class Attempts(list):
    """What failed on the way, in full (the client's answer); said: the same for the proxy's
    log, where a fallback already known to be unreachable is only "still unreachable"."""

    def __init__(self):
        super().__init__()
        self.said: list[str] = []

    def add(self, full: str, said: str | None = None) -> None:
        self.append(full)
        self.said.append(said or full)

    def texts(self) -> tuple[str, str]:
        """(every failure in full, as the log says them), each one line ('' when none)."""
        return "; ".join(self), "; ".join(self.said)


class Chain:
    """The fallbacks of one proxy (options.fallbacks), tried for a request the local model
    cannot serve. gate: the proxy's, whose sibling lanes an @HOST:PORT fallback takes; say: the
    proxy's notes and warnings."""

    def __init__(self, gate, options, say):
        self.gate, self.options, self.say = gate, options, say
        self.gates: dict[str, tuple] = {}   # backend -> fallback_lane.fallback_gate()
        self.down: dict[str, float] = {}    # fallback -> since when it cannot be reached

    def _unreachable(self, name: str, error, failures: "Attempts") -> None:
        """name could not be reached: warn at the incident's start only."""
        if name not in self.down:
            self.down[name] = time.monotonic()
            self.say.warn(f"{name} unreachable: {error}; trying the next (said once: "
                                "every request still tries it, and a line says when it answers "
                                "again)")
            failures.add(f"{name} failed: {error}")
        else:
            failures.add(f"{name} failed: {error}", f"{name} still unreachable")

    def _answered(self, name: str) -> None:
        since = self.down.pop(name, None)
        if since is not None:
            self.say.note(f"{name} answers again (unreachable for "
                                f"{time.monotonic() - since:.1f}s)")

    async def walk(self, upstream, proxied, why: Why, extra: dict):
        """(the first fallback's answer or None, the failures on the way). upstream: the
        proxy's aiohttp ClientSession; proxied: the request (proxied.Proxied); extra: lanelock's
        headers on a fallback's answer (the class and wait applied)."""
        failures = Attempts()
        answer_headers = {STATE: DEFLECTED, REASON: why.reason, **extra}
        # The request's own options: those in force when it came, whatever a reload said since.
        options = proxied.options or self.options
        for index, fallback in enumerate(options.fallbacks, 1):
            if not fallback.serves(proxied.dialect):
                continue
            if fallback.backend is not None:
                response = await self._local(upstream, proxied, fallback, index, why, failures,
                                             answer_headers, options)
            else:
                response = await self._url(upstream, proxied, fallback, index, why, failures,
                                           answer_headers, options)
            if response is not None:
                proxied.fallback = f"fallback {index} {fallback.text}"   # the -v line says it
                return response, failures
        return None, failures

    async def _url(self, upstream, proxied, fallback, index, why, failures, answer_headers,
                   options):
        say = self.say
        url = fallback.target(proxied.target)
        body = proxied.body
        model = options.fallback_model.get(fallback.kind, options.fallback_model.get(None))
        if model and proxied.fields:
            body = json.dumps({**proxied.fields, "model": model}).encode()
        # The client's credentials are the local engine's (its --api-key, a cookie of the
        # box): never sent to another host unless asked (--fallback-pass-auth). A configured key
        # replaces them; the proxy's own token is never passed on.
        key = options.fallback_key.get(fallback.kind, options.fallback_key.get(None))
        passed = options.fallback_pass_auth and not key
        drop = CREDENTIALS if not passed else (("authorization",) if options.token else ())
        headers = request_headers(proxied.http, drop=drop)
        name, form = dialects.FALLBACK_KINDS[fallback.kind]["key"]
        if key:
            headers[name] = form.format(key=key)
        say.note(why.sentence(f"deflecting to fallback {index}: {fallback.url}"))
        name = f"fallback {index} {fallback.url}"
        try:
            response = await relay(upstream, proxied, url, body, headers, answer_headers,
                                   answer_within=options.fallback_timeout)
        except Unreachable as error:
            self._unreachable(name, error, failures)
            return None
        self._answered(name)
        return response

    async def _local(self, upstream, proxied, fallback, index, why, failures, answer_headers,
                     options):
        from ..fallback_lane import busy_fallback, fallback_gate

        say = self.say
        if fallback.backend not in self.gates:
            # With lanes keyed by model, the engine's lane of the same model as the busy one's.
            model = self.gate.model
            gate, skip = fallback_gate(self.gate, fallback.backend, model)
            if gate is None and skip is None:   # not a local lane: its turns are ungated
                gate = self.gate.sibling(fallback.backend, model=model, no_model_said=True)
            self.gates[fallback.backend] = gate, skip
        gate, skip = self.gates[fallback.backend]
        if skip:   # run's rule and words (fallback_lane.py)
            say.note(f"fallback {index} skipped: {skip}")
            failures.add(f"fallback {index} skipped: {skip}")
            return None
        turn = gate.turn(session=f"proxy:{proxied.remote}",
                         argv=[proxied.method, proxied.path[:200]],
                         labels={"via": "proxy", "client": proxied.remote})
        await asyncturn.acquire(turn)
        status = None
        try:
            if turn.state == DEFLECTED:
                skip = busy_fallback(fallback.backend, turn.holder)
                say.note(f"fallback {index} skipped: {skip}")
                failures.add(f"fallback {index} @{fallback.backend} is busy")
                return None
            say.note(why.sentence(f"deflecting to fallback {index}: @{fallback.backend}"))
            from ..lanes import origin

            try:
                response = await relay(upstream, proxied, origin(gate.lane.given) + proxied.target,
                                       proxied.body,
                                       request_headers(proxied.http,
                                                       drop=options.own_credentials()),
                                       answer_headers,
                                       answer_within=options.fallback_timeout)
            except Unreachable as error:
                self._unreachable(f"fallback {index} @{fallback.backend}", error, failures)
                return None
            self._answered(f"fallback {index} @{fallback.backend}")
            status = response.status
            return response
        finally:
            await asyncturn.release(turn, status)

