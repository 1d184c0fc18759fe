"""Forwarding one request and streaming the answer back unchanged.

Hop-by-hop headers are dropped both ways (RFC 9110 7.6.1); everything else goes through as it came:
no decompression (auto_decompress off), no client headers added that the client did not send, and
each chunk of the answer is written the moment it arrives (server-sent events stay live). When the
client goes away, aiohttp cancels the handler (handler_cancellation) and leaving the upstream
context closes the engine's connection, which makes llama-server stop generating.
"""

from __future__ import annotations

import json

from aiohttp import ClientError, web
from aiohttp.payload import BytesPayload

from ..handover import HEADER
from .lost import CUT_WORDS, LaneLost
from .proxied import CUT, STATE

HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
                        "te", "trailer", "trailers", "transfer-encoding", "upgrade",
                        "proxy-connection"})
# What aiohttp's client would otherwise add on its own.
AUTO_HEADERS = ("User-Agent", "Accept", "Accept-Encoding", "Content-Type")
# Never sent on: the hand-over token (turn.headers) names a turn on this machine, nobody else's
# business -- neither the engine's nor a cloud fallback's.
PRIVATE = frozenset({HEADER.lower()})



class Unreachable(Exception):
    """The upstream could not be reached, or failed before it answered."""


def request_headers(request: web.BaseRequest, *, drop=(), set_=None) -> dict:
    connection = {token.strip().lower() for token in
                  request.headers.get("Connection", "").split(",") if token.strip()}
    out = {}
    for name, value in request.headers.items():
        lower = name.lower()
        if lower in HOP_BY_HOP or lower in connection or lower in ("host", "content-length") \
                or lower in PRIVATE or lower in drop:
            continue
        out[name] = value
    out.update(set_ or {})
    return out


def response_headers(upstream) -> list:
    connection = {token.strip().lower() for token in
                  upstream.headers.get("Connection", "").split(",") if token.strip()}
    return [(name, value) for name, value in upstream.headers.items()
            if name.lower() not in HOP_BY_HOP and name.lower() not in connection]


async def relay(session, proxied, url: str, body: bytes, headers: dict, extra: dict,
                answer_within: float | None = None, cut=None, ending=None,
                sent=None) -> web.StreamResponse:
    """Send the request (proxied.Proxied) to url and stream the answer to the client; extra:
    headers of ours. What was relayed is written into proxied (status, state, done, cut) as it
    happens: the turn's record and the -v line read it even when the client hung up midway.
    answer_within: seconds for the answer's status line and headers (a fallback's bound; None
    for the local engine, which may think for minutes before a non-streamed answer). cut: the
    held request's lost.Cut -- LaneLost when it fires before the answer started; after, the
    stream stops where it was (proxied.cut says why). ending: called once (what it returns
    awaited, if anything), just before the bytes that end the answer are written -- the last of
    a Content-Length body, a stream's terminal event, the chunked terminator -- so nothing the
    client does on the answer's end comes before it. sent: called once the request has gone
    (its body written to the connection; at once for a request without one)."""
    import asyncio

    from yarl import URL

    request = proxied.http
    skip = [name for name in AUTO_HEADERS if name not in headers]
    try:
        # encoded=True: the target goes out byte for byte as the client sent it (yarl would
        # otherwise resolve dot segments: the path judged must be the path forwarded).
        if sent is not None and not body:
            sent()
        data = (Sent(body, sent) if sent is not None else body) if body else None
        context = session.request(request.method, URL(url, encoded=True), headers=headers,
                                  data=data, allow_redirects=False, skip_auto_headers=skip)
        entering = context.__aenter__()
        if cut is not None:
            entering = cut.entered(asyncio.ensure_future(entering))
        upstream = await (entering if answer_within is None
                          else asyncio.wait_for(entering, answer_within))
    except asyncio.TimeoutError:
        raise Unreachable(f"no answer within {answer_within:g}s") from None
    except (ClientError, OSError) as error:
        raise Unreachable(unreachable_words(error)) from None
    except asyncio.CancelledError:
        if cut is not None and cut.cut_while_entering():
            raise LaneLost(CUT_WORDS) from None
        raise
    if cut is not None:
        cut.upstream = upstream
        if cut.fired:   # between the headers and now
            cut.fired = False
            cut.fire()
    proxied.status = upstream.status   # the turn's record, even if the client leaves
    proxied.state = extra.get(STATE, "-")
    try:
        response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
        for name, value in response_headers(upstream):
            response.headers.add(name, value)
        for name, value in extra.items():
            response.headers[name] = value
        if "Content-Length" not in response.headers:
            response.enable_chunked_encoding()
        side = "client"
        tail = b""   # the last bytes relayed: has the stream's terminal event gone by?
        left = upstream.content_length   # bytes of a Content-Length body still to relay
        try:
            await response.prepare(request)
            while True:
                side = "engine"
                chunk = await upstream.content.readany()
                if not chunk:
                    break
                side = "client"
                if ending is not None:
                    left = None if left is None else left - len(chunk)
                    if left is not None and left <= 0 or whole((tail + chunk)[-TAIL:]):
                        ending, end = None, ending
                        await _said(end)
                await response.write(chunk)
                tail = (tail + chunk)[-TAIL:]
            if ending is not None:
                await _said(ending)
            await response.write_eof()
        except asyncio.CancelledError:
            # The client hung up (the handler is cancelled) -- an SDK closes a stream at its
            # terminal event, often before the engine's own end (its chunked terminator, a
            # separate write: later on a loaded machine) has reached the proxy. Relayed to that
            # event, the answer is whole.
            proxied.done = whole(tail)
            raise
        except (ClientError, OSError):
            if whole(tail):   # the same, seen as a reset rather than a cancellation
                proxied.done = True
                request.transport and request.transport.close()
                return response
            # The engine failed mid-answer, or the client went away (aiohttp's reset error is
            # both; the side that was being read or written says which), or the lane was lost
            # (lost.Cut): what was relayed stands; close the client's side.
            proxied.cut = CUT["lost"] if cut is not None and cut.fired else CUT[side]
            request.transport and request.transport.close()
            return response
        proxied.done = True
        return response
    finally:
        await context.__aexit__(None, None, None)


class Sent(BytesPayload):
    """A body that says when it has been written to the connection (sent())."""

    def __init__(self, value: bytes, sent):
        super().__init__(value)
        self._sent = sent

    async def write(self, writer) -> None:
        await super().write(writer)
        self._sent()

    async def write_with_length(self, writer, content_length) -> None:
        await super().write_with_length(writer, content_length)
        self._sent()


TAIL = 512   # bytes kept of a relayed answer's end: more than a terminal event takes


async def _said(ending) -> None:
    """ending() called; what it returns awaited, when it returns something (the session it
    names is being looked up: app.py's forward-first turns)."""
    waiting = ending()
    if waiting is not None:
        await waiting


def whole(tail: bytes) -> bool:
    """Does a relayed stream end with its dialect's terminal event? OpenAI's `data: [DONE]`,
    Anthropic's message_stop, Ollama's and llama.cpp's last line ("done": true, "stop": true)."""
    import re

    last = tail.rstrip().rsplit(b"\n\n", 1)[-1].rsplit(b"\n", 1)[-1]
    return last == b"data: [DONE]" or b'"message_stop"' in last or \
        re.search(rb'"(done|stop)"\s*:\s*true', last) is not None


def unreachable_words(error: BaseException) -> str:
    """Why an upstream could not be reached, in lanelock's words: what was tried and why it
    failed ('cannot connect to api.example.com:443: connection refused'), not aiohttp's
    ('Cannot connect to host ... ssl:default [...]')."""
    import aiohttp

    if isinstance(error, aiohttp.ClientConnectorError):
        where = f"{error.host}:{error.port}"
        cause = error.os_error
        if isinstance(error, aiohttp.ClientConnectorDNSError):
            return f"cannot resolve {error.host}: {_cause(cause)}"
        if isinstance(error, aiohttp.ClientConnectorCertificateError):
            return f"{where}: its TLS certificate is not trusted ({_cause(error.certificate_error)})"
        if isinstance(error, aiohttp.ClientConnectorSSLError):
            return f"{where}: the TLS handshake failed ({_cause(cause)})"
        return f"cannot connect to {where}: {_cause(cause)}"
    if isinstance(error, aiohttp.ServerDisconnectedError):
        return "the server closed the connection before it answered"
    if isinstance(error, aiohttp.InvalidURL):
        return f"not a URL it can reach: {error.url}"
    return _cause(error)


def _cause(error) -> str:
    """An OSError's own words, lower-cased as lanelock's lines are ('connection refused')."""
    import os

    number = getattr(error, "errno", None)
    text = (os.strerror(number) if isinstance(number, int) and number > 0 else None) or \
        getattr(error, "strerror", None) or str(error) or type(error).__name__
    return text[:1].lower() + text[1:]


def error_response(status: int, kind: str, message: str, extra: dict | None = None,
                   retry_after: int | None = None) -> web.Response:
    """An OpenAI-style JSON error."""
    body = {"error": {"type": kind, "code": kind, "message": message}}
    response = web.Response(status=status, text=json.dumps(body), content_type="application/json")
    for name, value in (extra or {}).items():
        response.headers[name] = value
    if retry_after is not None:
        response.headers["Retry-After"] = str(retry_after)
    return response
