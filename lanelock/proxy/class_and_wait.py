"""What a gated request asks of the gate: its class (X-Lanelock-Priority) and how long it will
wait (X-Lanelock-Wait), each capped by the proxy's own (--max-priority, --max-wait); a request
that asks neither gets the proxy's defaults (--priority, --wait). The default wait is not the
cap: most clients (a chat) should go straight to the fallback, and one that can wait (a cron job)
asks.

A header that names no class, or no number of seconds, is refused (400, in the client's dialect,
naming the header) before the lane is asked: read as the default, a typo would silently change who
goes first or how long a client waits. A value above the cap is no mistake -- the proxy decides
how much a client may claim -- so it is capped, and every gated answer says what was applied and
what the caps are, in headers named like the request's -- and a busy answer's body says a capped
header too, since a client reading only the body would not know why it did not wait:

  X-Lanelock-Priority, X-Lanelock-Wait           the class and the seconds applied
  X-Lanelock-Max-Priority, X-Lanelock-Max-Wait   the proxy's caps ('inf': no limit)
"""

from __future__ import annotations

import math

from ..priority import CLASSES, SPELLED, class_named

WAIT_HEADER = "X-Lanelock-Wait"
PRIORITY_HEADER = "X-Lanelock-Priority"
MAX_WAIT_HEADER = "X-Lanelock-Max-Wait"
MAX_PRIORITY_HEADER = "X-Lanelock-Max-Priority"


class Malformed(ValueError):
    """A request header lanelock reads that says nothing it can apply."""

    def __init__(self, header: str, value: str, expected: str):
        super().__init__(f"{header}: {value[:100]!r} is not {expected}")
        self.header = header


class Asked:
    """The class and wait (seconds; None: as long as it takes) applied to one request."""

    __slots__ = ("priority", "wait", "_caps", "capped")

    def __init__(self, priority: str, wait: float | None, caps: dict, capped: tuple = ()):
        self.priority, self.wait, self._caps = priority, wait, caps
        self.capped = capped   # sentences, one per header the proxy capped

    def headers(self) -> dict:
        """What every gated answer says about it (the caps included)."""
        return {PRIORITY_HEADER: self.priority, WAIT_HEADER: seconds_text(self.wait),
                **self._caps}


def caps(max_priority: str, max_wait: float | None) -> dict:
    """The caps' response headers, which a refused request is told too."""
    return {MAX_PRIORITY_HEADER: max_priority, MAX_WAIT_HEADER: seconds_text(max_wait)}


def cap_of(default_wait: float | None, max_wait: float | None) -> float | None:
    """The wait cap in force: --max-wait, never below --wait (None: no limit) -- a proxy told
    to make every request wait 120 s lets a request ask for as much."""
    if default_wait is None or max_wait is None:
        return None
    return max(default_wait, max_wait)


def read(headers, *, default_priority: str, max_priority: str,
         default_wait: float | None, max_wait: float | None) -> Asked:
    """The request's class and wait from its headers (absent: the proxy's own), capped.
    Malformed when one is present and says nothing usable."""
    capped = []
    priority = default_priority
    given = headers.get(PRIORITY_HEADER)
    if given is not None:
        priority = class_named(given)
        if priority is None:
            raise Malformed(PRIORITY_HEADER, given, "a class: " + ", ".join(SPELLED))
    if given is not None and CLASSES.index(priority) > CLASSES.index(max_priority):
        capped.append(f"{PRIORITY_HEADER}: {given.strip()[:40]} was capped to {max_priority} "
                      "(the proxy's --max-priority)")
    priority = CLASSES[min(CLASSES.index(priority), CLASSES.index(max_priority))]
    wait = default_wait
    given = headers.get(WAIT_HEADER)
    if given is not None:
        asked = _seconds(given)
        if asked is None:
            raise Malformed(WAIT_HEADER, given, "a number of seconds, 0 or more ('inf': as "
                                                "long as the proxy's --max-wait allows)")
        wait = asked if max_wait is None else min(asked, max_wait)
        if wait < asked:
            capped.append(f"{WAIT_HEADER}: {given.strip()[:40]} was capped to "
                          f"{seconds_text(wait)} s (the proxy's --max-wait)")
    if wait is not None and math.isinf(wait):
        wait = None
    return Asked(priority, wait, caps(max_priority, max_wait), tuple(capped))


def _seconds(text: str) -> float | None:
    try:
        value = float(text.strip())
    except ValueError:
        return None
    return value if value >= 0 else None   # nan and negatives compare False


def seconds_text(seconds: float | None) -> str:
    return "inf" if seconds is None or math.isinf(seconds) else f"{seconds:g}"
