"""The proxy's options from the settings table -- flags over the files over the defaults, as every
setting (settings.py) -- read at start, and again on SIGHUP (reload.py).

Every option of `lanelock proxy` is a setting named proxy_OPTION (dashes to underscores; a
repeatable one a TOML array; --no-witness is proxy_witness = false), so a service unit can carry
nothing on its ExecStart but `lanelock proxy`. serve.start() reads them once and builds the
proxy; options_of() is one reading, which reload.py makes again; shown() is what /lanelock/status says of
them -- never a secret: the token and the keys are named by their variables, and a fallback URL's
user and password are left out.
"""

from __future__ import annotations

import os
import time

from ..errors import UsageProblem

# Settings a running proxy cannot change: the socket, the lane and the gate it was built on, its
# witness's thread and the listener's limits. A reload that changes one says so; a restart applies
# it.
AT_RESTART = ("proxy_listen", "backend", "key_by", "store", "lock_dir", "priority_aging",
              "proxy_token_env",
              "proxy_witness", "proxy_engine", "proxy_witness_interval",
              "proxy_max_connections", "proxy_header_timeout", "proxy_idle_timeout")


class Configured:
    """What the proxy was configured with: the flags (kept: a reload reads the files under the
    same flags), the settings read last, and when."""

    def __init__(self, flags: dict, settings):
        self.flags, self.settings = flags, settings
        self.started = time.time()
        self.reloaded: float | None = None

    def shown(self) -> dict:
        """{setting: {value, source}} of every proxy setting (config show's shape), secrets out."""
        from .. import settings as table

        rows = {}
        for setting in table.TABLE:
            if setting.name.startswith("proxy_") or setting.name in (
                    "backend", "key_by", "store", "lock_dir", "priority_aging"):
                value, source = self.settings.lookup(setting.name)
                rows[setting.name] = {"value": _public(setting.name, value), "source": source}
        return rows


def gate_of(settings, say):
    """The proxy's gate, as the read commands make one: a broken config file is a usage error.
    With lanes keyed by model, each request's own model keys its lane (per_lane.py): a proxy with
    no model of its own is no mistake, and says nothing of it."""
    from ..gate import Gate
    from ..lanes import BackendError

    try:
        gate = Gate(None, settings=settings, warn=say.warn, no_model_said=True)
    except BackendError as error:
        raise UsageProblem(str(error)) from None
    if gate.config_error:
        raise UsageProblem(gate.config_error)
    return gate


def options_of(settings, gate):
    """The ProxyOptions one reading of the settings says (UsageProblem names a bad value: a
    fallback, a key's variable, the engine's URL)."""
    from .app import ProxyOptions
    from .clients import Rules
    from .fallbacks import parse_fallback

    def seconds(name):   # None: for ever (a bare --wait, --max-wait)
        value = settings.get(name)
        return None if value == float("inf") else float(value or 0)

    try:
        fallbacks = [parse_fallback(text) for text in settings.get("proxy_fallback") or ()]
    except ValueError as error:
        raise UsageProblem(_from(settings, "proxy_fallback", str(error))) from None
    return ProxyOptions(
        fallbacks=fallbacks, fallback_model=settings.get("proxy_fallback_model"),
        fallback_key=fallback_keys(settings) or None,
        wait=seconds("proxy_wait"), max_wait=seconds("proxy_max_wait"),
        priority=settings.get("proxy_priority"), max_priority=settings.get("proxy_max_priority"),
        linger=float(settings.get("proxy_linger")),
        session_header=settings.get("proxy_session_header"),
        cheap_paths=settings.get("proxy_cheap_paths"), quiet=bool(settings.get("proxy_quiet")),
        verbose=bool(settings.get("proxy_verbose")),
        fallback_timeout=float(settings.get("proxy_fallback_timeout")),
        fallback_pass_auth=bool(settings.get("proxy_fallback_pass_auth")),
        max_connections=int(settings.get("proxy_max_connections")),
        header_timeout=float(settings.get("proxy_header_timeout")),
        idle_timeout=float(settings.get("proxy_idle_timeout")),
        pin_slots=bool(settings.get("proxy_pin_slots")),
        witness=_witness(settings, gate), clients=Rules(settings.get("proxy_clients")))


def fallback_keys(settings) -> dict:
    """{kind or None (every kind): key} from proxy_fallback_key_env's variables, read from the
    proxy's environment (UsageProblem: one is unset or empty)."""
    from .dialects import FALLBACK_KINDS

    keys = {}
    for given in settings.get("proxy_fallback_key_env") or ():
        kind, sep, name = given.partition("=")
        kind = kind.lower() if sep and kind.lower() in FALLBACK_KINDS else None
        name = name if kind else given
        key = os.environ.get(name)
        if not key:
            raise UsageProblem(_from(settings, "proxy_fallback_key_env",
                                     f"--fallback-key-env {given}: the variable is unset or "
                                     "empty"))
        keys[kind] = key
    return keys


def _witness(settings, gate):
    """(the engine's URL, the interval) for the proxy's witness, or None (--no-witness, or a
    lane no turn holds)."""
    if not settings.get("proxy_witness") or not gate.gated:
        return None
    from ..witness import engine_url, parse_engine

    engine = settings.get("proxy_engine")
    url = parse_engine(engine) if engine is not None else engine_url(gate.lane)
    if url is None:
        raise UsageProblem(f"{gate.lane.name} is on another machine: give --engine URL")
    return url, float(settings.get("proxy_witness_interval"))


def _from(settings, name: str, problem: str) -> str:
    """A bad value's problem, with where it came from when that is not the command line."""
    source = settings.source(name)
    return problem if source == "flag" else f"{source}: {name}: {problem}"


def _public(name: str, value):
    """A setting's value as /lanelock/status may show it: a URL without its user and password,
    nor its query (a store's ?password=, a key in a query string)."""
    if name == "proxy_fallback" and isinstance(value, list):
        return [_no_userinfo(text) for text in value]
    if name in ("proxy_engine", "backend", "store") and isinstance(value, str):
        return _no_userinfo(value)
    return value


def _no_userinfo(text: str) -> str:
    head, sep, rest = text.partition("://")
    if not sep:
        return text
    authority, slash, path = rest.partition("/")
    return f"{head}://{authority.rpartition('@')[2]}{slash}{path.partition('?')[0]}"
