"""The checks of the settings table (settings.py): value -> None when valid, else the reason a
person reads ("expected ..."). Plain functions, imported by `lanelock run` with the table: nothing
heavy here, and the few that need more (a backend's form, a listen address) import it when asked.
"""

from __future__ import annotations

from . import duration

# -- checks: value -> None when valid, else the reason -------------------------------------------
def _text(value) -> str | None:
    if isinstance(value, str) and 0 < len(value) <= 4096 and "\x00" not in value:
        return None
    return "a non-empty string of at most 4096 characters"


def relative_root(shown: str, value: str) -> str:
    """Why a relative lock root is refused (LANELOCK_DIR=locks would be one gate per working
    directory, each turn alone in its own)."""
    why = f"{shown} is relative: the lock root must be an absolute path (one gate for every " \
          "working directory)"
    if value.startswith("~"):
        why += "; ~ is not expanded (a root that followed HOME would be one gate per user)"
    return why


def _lock_dir(value) -> str | None:
    if _text(value):
        return f"{str(value)[:80]!r} is not a path: the lock root must be an absolute path"
    return None if value.startswith("/") else relative_root(repr(value[:80]), value)


def _seconds(value) -> str | None:
    value = _seconds_read(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 86400 * 365:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
        return "a number of seconds, not negative"
    return f"a duration from 0 to one year: {duration.EXAMPLES}"


def _seconds_read(value):
    """A duration written as text ('30s', '2m', '90') as seconds; anything else as it is."""
    if isinstance(value, str):
        number = duration.seconds(value)
        return value if number is None else number
    return value


def _exit_code(value) -> str | None:
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 255:
        return None
    return "an exit status from 0 to 255"


def _journal_bytes(value) -> str | None:
    if isinstance(value, int) and not isinstance(value, bool) and 4096 <= value <= 1 << 34:
        return None
    return "a size in bytes from 4096 to 16 GiB"


def _choice(*allowed):
    def check(value) -> str | None:
        return None if value in allowed else " or ".join(repr(word) for word in allowed)
    return check


def _backend(value) -> str | None:
    problem = _text(value)
    if problem:
        return "HOST:PORT, [V6]:PORT or a URL"
    from .lanes import BackendError, lane_for

    try:
        lane_for(value)
    except BackendError as error:
        return str(error)
    return None


def store_problem(value) -> str | None:
    """Why a store URL is not one lanelock can use (None: it is). Only the form is judged here; a
    well-formed store that cannot be reached fails open at the turn."""
    if _text(value):
        return "a postgresql:// URL"
    scheme, sep, rest = value.partition("://")
    if not sep or scheme.lower() not in ("postgresql", "postgres"):
        shown = scheme if sep else value
        return (f"unsupported lane store {shown[:40]!r}: only postgresql://USER@HOST/DB is "
                "supported (leave it unset for the flock store under the lock root)")
    if any(ch.isspace() for ch in value):
        return "a store URL cannot contain white space"
    return None


def _chains(value) -> str | None:
    message = "named fallback chains: [[chains.NAME]] with command = ... and optional backend = ..."
    if not isinstance(value, dict):
        return message
    for entries in value.values():
        if not isinstance(entries, list):
            return message
        for entry in entries:
            if not isinstance(entry, dict) or set(entry) - {"backend", "command"}:
                return message
            command = entry.get("command")
            if not (_text(command) is None or (isinstance(command, list) and command
                                               and all(_text(word) is None for word in command))):
                return message
            if "backend" in entry and _backend(entry["backend"]):
                return f"chain entry backend {entry['backend']!r}: {_backend(entry['backend'])}"
    return None


def _listen(value) -> str | None:
    if _text(value):
        return "HOST:PORT"
    from .errors import UsageProblem
    from .lanes import listen_address

    try:
        listen_address(value)
    except UsageProblem as error:
        return str(error)
    return None


def _header_name(value) -> str | None:
    import re

    if isinstance(value, str) and re.fullmatch(r"[A-Za-z0-9!#$%&'*+.^_`|~-]{1,128}", value):
        return None
    return "an HTTP header name"


def _cheap_paths(value) -> str | None:
    if isinstance(value, list) and all(
            isinstance(path, str) and path.startswith("/") and len(path) < 512 for path in value):
        return None
    return "a list of paths, each starting with /"


from .priority import CLASSES, class_named  # noqa: E402 - a leaf


def _switch(value) -> str | None:
    return None if isinstance(value, bool) else "true or false"


def _class(value) -> str | None:
    return None if class_named(value) else " or ".join(repr(name) for name in CLASSES)


def _class_read(value):
    return class_named(value) or value   # a class in any case; anything else stays, to be refused

def _interval(most):
    """More than 0 seconds, at most `most` (None: up to a year)."""
    def check(value) -> str | None:
        value = _seconds_read(value)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and \
                0 < value <= (most if most is not None else 86400 * 365):
            return None
        return f"a duration of more than 0 and at most {most if most is not None else 'a year'}" \
            f"{'s' if most is not None else ''}: {duration.EXAMPLES}"
    return check


def _count(most):
    def check(value) -> str | None:
        if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= most:
            return None
        return f"a whole number from 1 to {most}"
    return check


def _texts(check_one):
    """A list of strings (a lone string is a list of one), each valid for check_one."""
    def check(value) -> str | None:
        values = [value] if isinstance(value, str) else value
        if not isinstance(values, list) or not values:
            return "a list of strings"
        for one in values:
            problem = _text(one) or check_one(one)
            if problem:
                return f"{problem}; not {str(one)[:80]!r}"
        return None
    return check


def _texts_read(value):
    return [value] if isinstance(value, str) else value


def _fallback(value: str) -> str | None:
    """--fallback's form: @HOST:PORT, or [KIND=]http(s)://HOST... (the proxy knows the kinds and
    says an unknown one when it starts)."""
    from urllib.parse import urlsplit

    if value.startswith("@"):
        return _backend(value[1:])
    kind, sep, rest = value.partition("=")
    url = rest if sep and kind.isalpha() else value
    try:
        parts = urlsplit(url.strip())
    except ValueError:
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        return "an http(s):// base URL ([KIND=]URL), or @HOST:PORT for another local engine"
    return None


def _no_check(value) -> str | None:
    return None


def _env_name(value) -> str | None:
    import re

    if isinstance(value, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,127}", value):
        return None
    return "the name of an environment variable"


def _url(value) -> str | None:
    if _text(value) is None and value.strip().lower().startswith(("http://", "https://")):
        return None
    return "an http(s):// URL"


def _clients(value) -> str | None:
    """[[proxy_clients]]: each rule a table naming a session glob, a program glob or both, and
    what it sets (proxy/clients.py reads them)."""
    message = ("[[proxy_clients]] tables, each with session = GLOB and/or program = GLOB, and "
               "any of wait, priority, max_wait, max_priority")
    if not isinstance(value, list) or not all(isinstance(rule, dict) for rule in value):
        return message
    for rule in value:
        if set(rule) - CLIENT_KEYS or not {"session", "program"} & set(rule):
            return message
        for key in ("session", "program"):
            if key in rule and (_text(rule[key]) or len(rule[key]) > 256):
                return f"{key} {str(rule[key])[:80]!r}: a glob of at most 256 characters"
        for key in ("wait", "max_wait"):
            if key in rule and _seconds(rule[key]):
                return f"{key} {str(rule[key])[:80]!r}: {_seconds(rule[key])}"
        for key in ("priority", "max_priority"):
            if key in rule and _class(rule[key]):
                return f"{key} {str(rule[key])[:80]!r}: {_class(rule[key])}"
    return None


CLIENT_KEYS = {"session", "program", "wait", "priority", "max_wait", "max_priority"}


def _clients_read(value):
    """Each rule's durations as seconds and classes in one spelling."""
    if not isinstance(value, list):
        return value
    rules = []
    for rule in value:
        if isinstance(rule, dict):
            rule = dict(rule)
            for key in ("wait", "max_wait"):
                if key in rule:
                    rule[key] = _seconds_read(rule[key])
            for key in ("priority", "max_priority"):
                if key in rule:
                    rule[key] = _class_read(rule[key])
        rules.append(rule)
    return rules
