"""What aiohttp's and asyncio's loggers may say in the proxy's stderr: one `lanelock:` line per
incident, never a request's bytes.

aiohttp logs a malformed request with the parser's error, which quotes the raw line it choked on
(an `Authorization: Bearer ...` among them), and asyncio logs each failed accept() with a
traceback (21 MB in 18 s under a flood of idle connections). Here a record becomes a line naming
what happened (the exception's class, never its text: that is where the bytes are), and the same
kind of trouble is said once per incident: the first time, then again only after QUIET seconds
without it, with how many came meanwhile. LANELOCK_DEBUG=1 lets the records through as they are
(a developer's own requests).
"""

from __future__ import annotations

import logging
import os
import time

QUIET = 60.0   # seconds without a kind of trouble before its next one is a new incident
LOGGERS = ("aiohttp.server", "aiohttp.access", "aiohttp.web", "aiohttp.internal", "asyncio")


class Incidents:
    """Say a kind of trouble once per incident (the chain's rule for an unreachable fallback)."""

    def __init__(self, say, clock=time.monotonic):
        self.say, self.clock = say, clock
        self.last: dict[str, float] = {}    # kind -> when it was last seen
        self.unsaid: dict[str, int] = {}    # kind -> how many since it was last said

    def __call__(self, kind: str, text: str) -> None:
        now = self.clock()
        last = self.last.get(kind)
        self.last[kind] = now
        if last is not None and now - last < QUIET:
            self.unsaid[kind] = self.unsaid.get(kind, 0) + 1
            return
        more = self.unsaid.pop(kind, 0)
        self.say.warn(text + (f" ({more} more in the last incident)" if more else
                              f" (said once per incident: again after {QUIET:g}s without)"))


class OneLine(logging.Handler):
    def __init__(self, incidents: Incidents):
        super().__init__(logging.WARNING)
        self.incidents = incidents

    def emit(self, record: logging.LogRecord) -> None:
        try:
            kind, text = describe(record)
        except Exception:  # noqa: BLE001 - a log line must never break a request
            kind, text = "log", "proxy: an error it could not describe"
        self.incidents(kind, text)


def describe(record: logging.LogRecord) -> tuple[str, str]:
    """(kind, one line) for a record: no request bytes, no exception text."""
    error = record.exc_info[1] if record.exc_info else None
    name = type(error).__name__ if error is not None else None
    if record.name == "aiohttp.server":
        from aiohttp.http_exceptions import HttpProcessingError

        if isinstance(error, HttpProcessingError):
            return "malformed", f"proxy: malformed requests answered 400 (aiohttp: {name})"
        return "internal", (f"proxy: internal error handling a request ({name or 'no exception'}"
                            "; LANELOCK_DEBUG=1 shows the traceback)")
    if record.name == "asyncio" and isinstance(error, OSError):
        return f"asyncio-{error.errno}", f"proxy: {os.strerror(error.errno or 0).lower()}"
    return record.name, f"proxy: {record.name}: {name or 'a message'} (LANELOCK_DEBUG=1 shows it)"


def install(incidents: Incidents) -> None:
    """Route those loggers through incidents, one line each (unless LANELOCK_DEBUG=1)."""
    if os.environ.get("LANELOCK_DEBUG") == "1":
        return
    handler = OneLine(incidents)
    for name in LOGGERS:
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.propagate = False
