"""Every setting once: its flag, environment variable, config key, default, check and help.

The precedence is written here and nowhere else: flag > environment > user file > system file >
default. The one exception is the lock root: a user file cannot move it (a per-user root would split
the gate silently), so config.load() leaves a user file's lock_dir out and reports it.

A bad value from the environment or a file (LANELOCK_PRIORITY=bogus, `grace = -1`, an unknown key)
is read as if it were not there -- the setting falls to the next source down, the default in the
end -- with one warning: a typo in a crontab must neither stop the job nor switch the gate off. Only
the settings that say where the gate is (backend, lock_dir, store) have no such safe value: a bad
one refuses (read commands exit 2, `run` fails open with one warning). A bad flag is a usage error.

Read by the gate (Gate), the wrapper (`run`), the lock-root logic, the click options, the fast `run`
parser (run/args.py), `config show` and `config set`. A plain module -- no dataclasses, no typing --
because `lanelock run` imports it in front of every turn.
"""

from __future__ import annotations

import os

from . import config as config_files
from . import exitcodes
from .lanes import DEFAULT_BACKEND


class Setting:
    __slots__ = ("name", "flags", "kind", "env", "default", "check", "help", "metavar", "shown",
                 "read", "safe", "most")

    def __init__(self, name, *, flags=(), kind="text", env=None, default=None, check=None,
                 help="", metavar=None, shown=None, read=None, safe=True, most=None):
        self.name = name
        self.flags = flags        # ("--backend", "-b"): the first is the long name
        self.kind = kind          # how a flag's text is read: see run/args.py
        self.env = env            # environment variable, or None
        self.default = default
        self.check = check        # value -> None or the reason it is bad (config files, config set)
        self.help = help
        self.metavar = metavar
        self.shown = shown        # what `config show` says of a default that is computed
        self.read = read          # value -> the value it means (one spelling), from any source
        self.safe = safe          # a bad value from env or file falls to the default (module doc)
        self.most = most          # the upper bound of an interval or a count (None: none)


from .priority import DEFAULT_AGING, DEFAULT_CLASS
from .setting_checks import (  # noqa: F401 - relative_root, store_problem: read from here
    relative_root, store_problem, _text, _lock_dir, _seconds, _seconds_read, _exit_code,
    _journal_bytes, _choice, _backend, _chains, _listen, _header_name, _cheap_paths, _switch,
    _class, _class_read, _interval, _count, _texts, _texts_read, _fallback, _no_check,
    _env_name, _url, _clients, _clients_read)

DEFAULT_LISTEN = "127.0.0.1:8089"
# A minute: long enough for a client that can wait (a cron job, a batch) to outlast one
# typical local generation, short enough that no header pins a connection and a lane's queue
# for much longer than an SDK's own patience; raise it with --max-wait.
DEFAULT_PROXY_MAX_WAIT = 60
DEFAULT_GRACE = 0.05   # seconds: long enough to ride out a probe, short enough to be invisible
JOURNAL_MAX_BYTES = 1 << 20

TABLE = (
    # backend, lock_dir and store say where the gate is: no other value is safe in place of a
    # bad one (another lane, root or store would be another gate), so a bad one refuses.
    Setting("backend", flags=("--backend", "-b"), env="LANELOCK_BACKEND", default=DEFAULT_BACKEND,
            check=_backend, metavar="BACKEND", safe=False,
            help="The local engine: HOST:PORT, [V6]:PORT or URL."),
    Setting("lock_dir", flags=("--lock-dir",), env="LANELOCK_DIR", check=_lock_dir, metavar="DIR",
            shown="computed", safe=False,
            help="Lock root, an absolute path (default /run/lock/lanelock). Of the config files, only "
                 "the system config file (/etc/lanelock/config.toml) may set it: a root of one "
                 "user's own would be a second gate."),
    Setting("model", flags=("--model", "-m"), env="LANELOCK_MODEL", check=_text, metavar="NAME",
            help="Model label."),
    Setting("session", flags=("--session", "-s"), env="LANELOCK_SESSION", check=_text,
            metavar="LABEL", shown="user@tty; without a terminal user@PROGRAM/PID of the turn's starter, or user@cron",
            help="Session label (default user@tty; without a terminal user@PROGRAM/PID of the "
                 "program that started the turn, or user@cron)."),
    Setting("key_by", flags=("--key-by",), env="LANELOCK_KEY_BY", kind="key-by", default="backend",
            check=_choice("backend", "model"),
            help="Key the lane on the backend or on backend+model."),
    Setting("store", flags=("--store",), env="LANELOCK_STORE", kind="store", check=store_problem,
            metavar="URL", shown="flock under the lock root", safe=False,
            help="postgresql://... lane store for several hosts (default: flock under the lock "
                 "root)."),
    Setting("gate", flags=("--gate/--no-gate",), kind="gate", default="auto",
            check=_choice("auto", "always", "never"),
            help="Force gating on or off, whatever the backend's classification."),
    Setting("wait", flags=("--wait", "-w"), kind="optional-seconds", default=0, check=_seconds,
            read=_seconds_read, metavar="[SECONDS]",
            help="Wait in the lane's queue up to SECONDS (90, 500ms, 5m) for the lane, then fall back; "
                 "a bare --wait waits for ever."),
    Setting("busy_exit_code", flags=("--busy-exit-code", "-E"), kind="exit", default=exitcodes.BUSY,
            check=_exit_code, metavar="N", help="Exit status when busy and no fallback ran."),
    Setting("priority", flags=("--priority",), env="LANELOCK_PRIORITY", kind="priority",
            default=DEFAULT_CLASS, check=_class, read=_class_read, metavar="CLASS",
            help="Who goes first among waiting turns: interactive, normal or batch."),
    Setting("priority_aging", env="LANELOCK_PRIORITY_AGING", default=DEFAULT_AGING,
            check=_seconds, read=_seconds_read,
            help="Seconds a waiting turn's class takes to rise one step (nobody starves; 0: "
                 "never)."),
    Setting("grace", flags=("--grace",), kind="seconds", default=DEFAULT_GRACE, check=_seconds,
            read=_seconds_read, metavar="SECONDS", help="Wait this long in the kernel before deflecting."),
    Setting("kill_after", flags=("--kill-after",), kind="seconds", check=_seconds,
            read=_seconds_read, metavar="SECONDS", shown="off",
            help="SIGKILL the child this long after forwarding it a signal it ignores."),
    Setting("on_lost", flags=("--on-lost",), kind="on-lost", default="continue",
            check=_choice("continue", "stop"), metavar="WHAT",
            help="When the lane store takes the lane away for good mid-turn (a PostgreSQL session "
                 "ended, not a restart): continue, or stop the command (exit 75)."),
    Setting("journal_max_bytes", default=JOURNAL_MAX_BYTES, check=_journal_bytes,
            help="Rotate the journal past this size."),
    Setting("chains", check=_chains, shown="none",
            help="Named fallback chains: [[chains.NAME]] backend = ..., command = ..."),
    # lanelock proxy
    Setting("proxy_listen", flags=("--listen",), default=DEFAULT_LISTEN, check=_listen,
            metavar="HOST:PORT", help="Where the proxy listens (loopback unless --token-env)."),
    # The proxy's own wait and class: `run`'s wait and priority are one command's choice, and a
    # proxy serves many clients (a chat client should go straight to the cloud, a cron one wait).
    Setting("proxy_wait", flags=("--wait", "-w"), kind="optional-seconds", default=0,
            check=_seconds, read=_seconds_read, metavar="[SECONDS]",
            help="How long a request that sends no X-Lanelock-Wait waits for the lane, then falls "
                 "back; a bare --wait waits for ever."),
    Setting("proxy_max_wait", flags=("--max-wait",), kind="optional-seconds",
            default=DEFAULT_PROXY_MAX_WAIT, check=_seconds, read=_seconds_read,
            metavar="[SECONDS]",
            help="The longest X-Lanelock-Wait a request may ask (never less than --wait); a bare "
                 "--max-wait: no limit."),
    Setting("proxy_priority", flags=("--priority",), kind="priority", default=DEFAULT_CLASS,
            check=_class, read=_class_read, metavar="CLASS",
            help="The class of a request that sends no X-Lanelock-Priority: interactive, normal "
                 "or batch."),
    Setting("proxy_linger", flags=("--linger",), kind="seconds", default=0, check=_seconds,
            read=_seconds_read, metavar="SECONDS",
            help="Keep the lane this long after a request for the same session's next one."),
    Setting("proxy_pin_slots", flags=("--pin-slots",), kind="switch", default=False,
            check=_switch,
            help="Send a llama.cpp engine (and llama-swap's) id_slot = the seat - 1 in each held "
                 "completion request that names none, so a session back on its seat finds its "
                 "slot's cache; other engines' requests go as they came."),
    Setting("proxy_session_header", flags=("--session-header",), default="X-Lanelock-Session",
            check=_header_name, metavar="NAME", help="Request header that names the session."),
    Setting("proxy_cheap_paths", check=_cheap_paths,
            shown="/tokenize /detokenize /apply-template /v1/messages/count_tokens "
                  "/v1/responses/input_tokens /api/show",
            help="Paths whose requests never hold the lane (cheap: no generation); every other "
                 "request but GET, HEAD and OPTIONS holds it. A list; replaces the default."),
    Setting("proxy_fallback", flags=("--fallback",), kind="multiple",
            check=_texts(_fallback), read=_texts_read, metavar="[KIND=]URL", shown="none",
            help="Where a busy lane's requests go: a base URL of an API of KIND (openai, the "
                 "default: https://api.example.com/v1; anthropic: https://api.anthropic.com), "
                 "serving that dialect's requests, or @HOST:PORT for another local engine on "
                 "its own lane (every dialect); repeatable, tried in order."),
    Setting("proxy_fallback_model", flags=("--fallback-model",), kind="multiple",
            check=_texts(_no_check), read=_texts_read, metavar="[KIND=]NAME", shown="none",
            help="The model a URL fallback (of KIND, or every kind) is asked for (replaces the "
                 "request's model); repeatable."),
    Setting("proxy_fallback_key_env", flags=("--fallback-key-env",), kind="multiple",
            check=_texts(_no_check), read=_texts_read, metavar="[KIND=]VAR", shown="none",
            help="Environment variable holding the API key of the URL fallbacks (of KIND, or "
                 "every kind): sent as 'Authorization: Bearer' to openai, 'x-api-key' to "
                 "anthropic; never logged; repeatable."),
    Setting("proxy_fallback_timeout", flags=("--fallback-timeout",), kind="interval", default=60,
            check=_interval(None), read=_seconds_read, metavar="SECONDS",
            help="A fallback that has not answered (status and headers) within this long is "
                 "skipped and the next one tried."),
    Setting("proxy_fallback_pass_auth", flags=("--fallback-pass-auth",), kind="switch",
            default=False, check=_switch,
            help="Send a URL fallback with no key of its own the client's credentials "
                 "(Authorization, Cookie, X-Api-Key, api-key); by default they never leave "
                 "the box."),
    Setting("proxy_max_priority", flags=("--max-priority",), kind="priority",
            default="interactive", check=_class, read=_class_read, metavar="CLASS",
            help="The highest class a request's X-Lanelock-Priority header may claim."),
    Setting("proxy_clients", check=_clients, read=_clients_read, shown="none",
            help="Per-client defaults: [[proxy_clients]] session = GLOB and/or program = GLOB, "
                 "with wait, priority, max_wait, max_priority; the first rule that matches a "
                 "request applies."),
    Setting("proxy_token_env", flags=("--token-env",), check=_env_name, metavar="VAR",
            shown="none",
            help="Require 'Authorization: Bearer $VAR' on every request (needed to listen "
                 "beyond loopback)."),
    Setting("proxy_witness", flags=("--witness",), kind="switch", default=True, check=_switch,
            help="Witness the engine: read its account and say when a generation no turn "
                 "covered runs on it (see `lanelock watch`); --no-witness: do not."),
    Setting("proxy_engine", flags=("--engine",), check=_url, metavar="URL",
            shown="the backend's", help="The engine's base URL for the witness (default: the "
                                        "backend's)."),
    Setting("proxy_witness_interval", flags=("--witness-interval",), kind="interval",
            default=0.25, check=_interval(60), read=_seconds_read, metavar="SECONDS", most=60,
            help="Seconds between the witness's looks."),
    Setting("proxy_max_connections", flags=("--max-connections",), kind="count", default=1024,
            check=_count(1 << 20), metavar="N", most=1 << 20,
            help="Connections at once (fewer if the fd limit allows fewer); more wait in the "
                 "listen backlog, and idle ones are closed to make room."),
    Setting("proxy_header_timeout", flags=("--header-timeout",), kind="interval", default=10,
            check=_interval(30), read=_seconds_read, metavar="SECONDS", most=30,
            help="Close a connection that has not sent a complete request header by then; "
                 "answer 408 to a request whose body is not complete as long again after."),
    Setting("proxy_idle_timeout", flags=("--idle-timeout",), kind="interval", default=15,
            check=_interval(None), read=_seconds_read, metavar="SECONDS",
            help="Close a keep-alive connection idle this long."),
    Setting("proxy_quiet", flags=("--quiet", "-q"), kind="switch", default=False, check=_switch,
            help="No notes or warnings from lanelock."),
    Setting("proxy_verbose", flags=("--verbose", "-v"), kind="switch", default=False,
            check=_switch, help="One line per request."),
)
SETTINGS = {setting.name: setting for setting in TABLE}
# The settings `lanelock run` takes as flags (run/args.py and the click command read this).
RUN_FLAGS = ("backend", "lock_dir", "model", "session", "key_by", "store", "gate", "wait",
             "busy_exit_code", "priority", "grace", "kill_after", "on_lost")


# Settings that no longer exist, and what replaced them. A file that still sets one is read with
# a note ("IGNORED"), never refused: a refused file makes every turn fail open, ungated.
RETIRED = {
    "proxy_paths": "every proxy request but GET, HEAD and OPTIONS holds the lane now; list the "
                   "cheap endpoints in proxy_cheap_paths instead",
}


def validate(name: str, value) -> str | None:
    """None when the value is valid for the setting, else the reason."""
    if name in RETIRED:
        return None
    setting = SETTINGS.get(name)
    if setting is None:
        return f"unknown setting {name!r} (known: {', '.join(SETTINGS)})"
    problem = setting.check(value) if setting.check else None
    if problem is None:
        return None
    if setting.check in (_backend, store_problem, _lock_dir):
        return f"bad value for {name!r}: {problem}"
    return f"bad value for {name!r}: {str(value)[:80]!r} (expected {problem})"


def lenient(name: str) -> bool:
    """Whether a file's bad value of this key is left out (read as its default, with a warning)
    rather than refusing the file: every key but those that say where the gate is."""
    setting = SETTINGS.get(name)
    return setting is None or setting.safe


def load_files():
    """The config files as the settings read them (ConfigError for a file refused whole)."""
    return config_files.load(validate, RETIRED, lenient)


class Settings:
    """The effective value of every setting, and where each came from.

    flags: values given on the command line or to the API (None: not given). The config files are
    read once, here; a broken file is config_error (run fails open on it, read commands exit 2),
    and so is a lock root given relative on the command line or in the environment (a file's is
    refused as the file is read). A bad value of a safe setting is passed over (the module's
    doc); warnings() says so."""

    def __init__(self, flags: dict | None = None, *, config=None, config_error=None):
        self.flags = {name: value for name, value in (flags or {}).items() if value is not None}
        if config is None:
            try:
                config = load_files()
            except config_files.ConfigError as error:
                config, config_error = config_files.Config(), str(error)
        self.config = config
        self.config_error = config_error or self._relative_root()

    def _relative_root(self) -> str | None:
        value, source = self.lookup("lock_dir")
        if not value or not isinstance(value, str) or value.startswith("/"):
            return None
        if source == "flag":
            return relative_root(f"--lock-dir {value}", value)
        if source.startswith("env "):
            return relative_root(f"{source[4:]}={value}", value)
        return f"{source}: {relative_root(f'lock_dir = {value!r}', value)}"

    def derive(self, **flags) -> "Settings":
        """Other flags over the same files (a fallback entry's own backend, say)."""
        return Settings(flags, config=self.config, config_error=self.config_error)

    def lookup(self, name: str) -> tuple:
        """(value, source); source is 'flag', 'env NAME', 'user file PATH', 'system file PATH'
        or 'default'. An empty environment variable counts as unset, and so does a bad value
        of a safe setting in the environment (a file's was left out as the file was read)."""
        setting = SETTINGS[name]
        value, source = self._lookup(name, setting)
        if source.startswith("env ") and self._env_problem(setting) is not None:
            value, source = self._below_env(name, setting)
        return (setting.read(value) if setting.read else value), source

    def _lookup(self, name: str, setting: Setting) -> tuple:
        if name in self.flags:
            return self.flags[name], "flag"
        if setting.env:
            value = os.environ.get(setting.env)
            if value:
                return value, f"env {setting.env}"
        return self._below_env(name, setting)

    def _below_env(self, name: str, setting: Setting) -> tuple:
        if name in self.config.values:
            return self.config.values[name], self.config.source(name)
        return setting.default, "default"

    @staticmethod
    def _env_problem(setting: Setting) -> str | None:
        """Why the environment's value of a safe setting is bad (None: it is good, unset, or
        the setting has no safe value to fall to)."""
        text = os.environ.get(setting.env) if setting.env and setting.safe else None
        if not text:
            return None
        return validate(setting.name, setting.read(text) if setting.read else text)

    def get(self, name: str):
        return self.lookup(name)[0]

    def source(self, name: str) -> str:
        return self.lookup(name)[1]

    def warnings(self) -> list[str]:
        """One line per bad value passed over: where it was, why it is bad, what is used."""
        lines = []
        for setting in TABLE:
            problem = self._env_problem(setting)
            if problem:
                lines.append(f"env {setting.env}: {problem}; {self._using(setting.name)}")
        for name, where, problem in self.config.refused:
            using = self._using(name) if name in SETTINGS else "ignored"
            lines.append(f"{where}: {problem}; {using}")
        return lines

    def _using(self, name: str) -> str:
        value, source = self.lookup(name)
        if value is None:
            shown = SETTINGS[name].shown or "unset"
            return f"using the default ({shown})" if source == "default" else f"unset ({source})"
        return f"using {value!r} ({'the default' if source == 'default' else source})"


def effective() -> dict:
    """Every setting's value and source, for `config show` (ConfigError for a broken file)."""
    settings = Settings(config=load_files())
    rows = {}
    for setting in TABLE:
        value, source = settings.lookup(setting.name)
        if setting.name == "lock_dir" and value is None:
            from .paths import default_root

            root = default_root()
            value, source = root.path, f"default: {root.detail}"
        elif value is None and setting.shown:
            source = f"default: {setting.shown}"
        rows[setting.name] = {"value": value, "source": source}
    return {"settings": rows, "files": settings.config.files,
            "ignored": settings.config.ignored + settings.warnings()}


def set_value(key: str, text: str, *, system: bool) -> str:
    """`config set`: validate KEY = TEXT against the table and write it (config.set_value)."""
    return config_files.set_value(key, text, system=system, check=validate, lenient=lenient)
