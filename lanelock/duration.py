"""One way to write an amount of time, for every option, variable and config value that takes one
(--wait, --grace, --kill-after, --linger, the intervals, history --since, priority_aging):
a number of seconds (`90`, `0.5`), or a number and a unit (`500ms`, `30s`, `5m`, `2h`, `1d`, `1w`).

A leaf without imports: `lanelock run` reads it in front of every turn.
"""

from __future__ import annotations

UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
EXAMPLES = "90, 0.5, 500ms, 30s, 5m, 2h, 1d"


def seconds(text) -> float | None:
    """The seconds a duration names ('5' -> 5.0, '5s' -> 5.0, '2h' -> 7200.0), None when the text
    is no duration (a negative number, nan, inf and words included). Case and blanks around the
    number and the unit do not matter ('2 H')."""
    if not isinstance(text, str):
        return None
    word = text.strip().lower()
    unit = next((name for name in ("ms", "s", "m", "h", "d", "w") if word.endswith(name)), "")
    number = word[:len(word) - len(unit)].rstrip()
    whole, dot, fraction = number.partition(".")
    if not (whole + fraction).isdigit() or not (whole + fraction).isascii():
        return None
    return float(number) * UNITS.get(unit, 1.0)


# Something that refused for now (a crowded gate or server, a lost store session) is asked again
# after these pauses: at once at first, then once a second at most, so a long refusal costs a
# few attempts a second, never a busy loop.
BACKOFF = (0.05, 0.1, 0.2, 0.5, 1.0)


def backoff(tries: int) -> float:
    """The pause before asking again after `tries` refusals (0: the first)."""
    return BACKOFF[min(tries, len(BACKOFF) - 1)]
