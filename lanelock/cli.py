"""Click commands: parse, call, render. No logic of its own lives here."""

from __future__ import annotations

import os
import sys

import click

from . import __version__, exitcodes
from .completion import complete_backend
from .priority import SPELLED

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


def _setting_help(setting) -> str:
    extra = []
    if setting.env:
        extra.append(f"env {setting.env}")
    if setting.default is not None and setting.kind != "gate":
        extra.append(f"default {setting.default}")
    return setting.help + (f" ({'; '.join(extra)})" if extra else "")


class Seconds(click.FloatRange):
    """A duration, 0 or more: seconds (90, 0.5) or a number and a unit (500ms, 30s, 5m, 2h, 1d),
    as every option, variable and file value that takes one reads it (duration.py). The fast
    `run` parser (run/args.py) reads plain seconds and leaves the rest to this."""

    def __init__(self, flag: str, optional: bool = False):
        super().__init__(min=0)
        self.flag, self.optional = flag, optional

    def convert(self, value, param, ctx):
        from .duration import EXAMPLES, seconds

        if isinstance(value, float):
            return value
        number = seconds(value)
        if number is not None:
            return number
        if str(value).strip().startswith("-") and seconds(str(value).strip()[1:]) is not None:
            self.fail(f"{value} is negative: SECONDS must be 0 or more", param, ctx)
        word = str(value).strip().lower()   # a word that may be the command's: --wait echo hi
        hint = (f"; {self.flag}'s value is optional: write {self.flag}=SECONDS, or end "
                f"lanelock's options with -- before the command") if self.optional and not (
            any(ch.isdigit() for ch in word) or word in ("nan", "inf", "infinity")) else ""
        self.fail(f"{value!r} is not a duration (SECONDS: {EXAMPLES}){hint}", param, ctx)


def setting_option(name: str):
    """The click option of a setting, from the settings table (run/args.py reads the same)."""
    from .settings import SETTINGS

    setting = SETTINGS[name]
    kwargs = {"default": None, "help": _setting_help(setting)}
    if setting.metavar:
        kwargs["metavar"] = setting.metavar
    kind = setting.kind
    if kind == "key-by":
        kwargs["type"] = click.Choice(["backend", "model"])
    elif kind == "on-lost":
        kwargs["type"] = click.Choice(["continue", "stop"])
    elif kind == "priority":
        kwargs["type"] = click.Choice(list(SPELLED), case_sensitive=False)
    elif kind == "seconds":
        kwargs["type"] = Seconds(setting.flags[0])
    elif kind == "optional-seconds":
        kwargs.update(type=Seconds(setting.flags[0], optional=True), is_flag=False,
                      flag_value=float("inf"))
    elif kind == "exit":
        kwargs["type"] = click.IntRange(0, 255)
    elif kind == "interval":
        kwargs["type"] = Interval(setting.flags[0], setting.most)
    elif kind == "count":
        kwargs["type"] = click.IntRange(1, setting.most)
    elif kind == "multiple":   # () when not given: the files' list, then the default
        kwargs.update(multiple=True, default=())
    if name == "backend":
        kwargs["shell_complete"] = complete_backend
    if kind == "gate":
        return click.option("--gate/--no-gate", "gate", **kwargs)
    if kind == "switch":   # --NAME/--no-NAME (and its short flag); None: the setting's own value
        flag = setting.flags[0]
        return click.option(f"{flag}/--no-{flag[2:]}", *setting.flags[1:], name, **kwargs)
    return click.option(*setting.flags, name, **kwargs)


def lane_options(function):
    """The options every command uses to name a lane."""
    for name in ("store", "key_by", "model", "lock_dir", "backend"):
        function = setting_option(name)(function)
    return function


def run_options(function):
    """`run`'s options: the settings it takes, then the ones of its own (run/args.py RUN_ONLY)."""
    from .run.args import RUN_ONLY

    for spellings, parameter, kind, metavar, help_text in reversed(RUN_ONLY):
        kwargs = {"help": help_text}
        if kind == "multiple":
            kwargs.update(multiple=True, metavar=metavar)
        elif kind == "flag":
            kwargs["is_flag"] = True
        else:
            kwargs.update(default=None, metavar=metavar)
        function = click.option(*spellings, parameter, **kwargs)(function)
    for name in ("gate", "on_lost", "kill_after", "grace", "busy_exit_code", "priority", "wait",
                 "session"):
        function = setting_option(name)(function)
    return lane_options(function)


def make_gate(backend, lock_dir, model, key_by, gate=None, grace=None, warn=None, store=None,
              settings=None, reading=False, **place):
    """The Gate of the lane the flags name; reading: only its Place (place.py), for a command
    that reads the lane and takes no turn."""
    from .errors import UsageProblem
    from .lanes import BackendError

    if reading:
        from .place import Place as Kind
    else:
        from .gate import Gate as Kind
    try:
        kwargs = {"warn": warn, **place} if warn else place
        return Kind(backend, model=model, key_by=key_by, lock_dir=lock_dir, gate=gate,
                    grace=grace, store=store, settings=settings, **kwargs)
    except (BackendError, UsageProblem) as error:
        raise click.UsageError(str(error)) from None


def strict_gate(*args, **kwargs):
    """A gate (or with reading=True a Place) for read commands: a broken config is a usage error
    (exit 2), not fail-open."""
    gate = make_gate(*args, **kwargs)
    if gate.config_error:
        raise click.UsageError(gate.config_error)
    return gate


def strict_place(*args, **kwargs):
    return strict_gate(*args, reading=True, **kwargs)


@click.group(context_settings=CONTEXT)
@click.version_option(__version__, "--version", prog_name="lanelock")
def cli():
    """Hold a local model's lane for exactly one turn; everyone else takes the fallback.

    A cross-process flock(2) gate per backend (host:port): `lanelock run -- CMD` holds it while
    CMD runs; a second session finds it busy and deflects to its fallback.
    """


@cli.command(context_settings={**CONTEXT, "allow_interspersed_args": False})
@run_options
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def run(**params):
    """Run COMMAND holding the backend's lane; deflect to a fallback when it is busy."""
    from .errors import UsageProblem
    from .run.args import Request
    from .run.wrapper import start

    try:
        return start(Request(**params))
    except UsageProblem as error:
        raise click.UsageError(str(error)) from None


@cli.command(context_settings=CONTEXT)
@lane_options
@click.option("--json", "json_", is_flag=True, help="Print the result as JSON.")
def probe(backend, lock_dir, model, key_by, store, json_):
    """Is the lane free? Exit 0 free, 1 busy, 2 error. Takes and drops the lock at once."""
    from .inspection import render

    result = strict_gate(backend, lock_dir, model, key_by, store=store).probe()
    render.probe(result, json_)
    return exitcodes.PROBE_BUSY if result["state"] == "busy" else exitcodes.OK


@cli.command(context_settings=CONTEXT)
@lane_options
@click.option("--json", "json_", is_flag=True, help="Print the paths as JSON.")
def where(backend, lock_dir, model, key_by, store, json_):
    """Print the lock file, the sidecar and how the lock root was chosen."""
    from .inspection import render

    render.where(strict_place(backend, lock_dir, model, key_by, store=store).where(), json_)
    return exitcodes.OK


@cli.command(context_settings=CONTEXT)
@lane_options
@click.option("--all", "all_lanes", is_flag=True, help="Every lane under the lock root.")
@click.option("--json", "json_", is_flag=True, help="Print the facts as JSON.")
@click.option("--watch", is_flag=True, help="Refresh a live view until ^C or until nothing reads "
                                            "it (with --json: one JSON object per line per "
                                            "refresh).")
def status(backend, lock_dir, model, key_by, store, all_lanes, json_, watch):
    """Who holds the lane, from the kernel's /proc/locks, cross-checked with the sidecar.

    Never takes the lock. Exit 0 whatever the lane's state; 69 when a turn could not take the
    gate (it would run ungated); 2 on a usage error.
    """
    from .errors import GateUnavailable
    from .inspection import render
    from .inspection.status import no_lanes, statuses

    if all_lanes and backend:
        raise click.UsageError("--all and --backend exclude each other")
    gate = strict_place(backend, lock_dir, model, key_by, store=store)
    notes = lane_notes(gate, all_lanes)
    # --all lists the lanes that exist; whether a new one could be made is the store's to say.
    broken = gate.store.problems() if all_lanes else []
    notes += broken

    def fetch():
        return statuses(gate.store, None if all_lanes else gate.lane, engine=True)

    if not all_lanes and gate.gated:
        try:
            notes += _other_keyings(gate)
        except GateUnavailable:
            pass

    if watch:
        try:
            render.watch(fetch, as_json=json_, notes=notes, none=no_lanes(gate))
            return exitcodes.OK   # its reader went away: not an error
        except KeyboardInterrupt:
            return exitcodes.OK
    results = fetch()
    from .inspection.status import left_out_note
    from .models_command import add_to_status, status_lines

    notes += left_out_note(gate.store) if all_lanes else []

    shown = add_to_status(gate.store, results)
    render.status(results, json_, notes=notes, none=no_lanes(gate))
    if shown and not json_:
        sys.stdout.write(status_lines(shown))
    ungated = broken or (gate.gated or all_lanes) and any(
        result["gate"] == "unavailable" for result in results)
    return exitcodes.GATE_UNAVAILABLE if ungated else exitcodes.OK


def lane_notes(gate, all_lanes: bool = False) -> list[str]:
    """What a reader of one lane's status, history or metrics should know first: config lines
    not applied, and a backend that has no lane at all (its zeros mean "never gated")."""
    notes = list(gate.config.ignored)
    if not gate.gated and not all_lanes:
        notes.append(f"{gate.lane.name} is not a local lane: turns on it are never gated")
    return notes


def _other_keyings(place) -> list[str]:
    """Lanes of the same backend keyed another way (--key-by model) that are in use now (held,
    or with turns waiting): separate gates, which a user looking at one of them should know
    about while they run beside it. An idle one is not: its lock file stays for ever (never
    unlinked), and a warning about it could never be cleared. The store lists its lanes' names;
    only those of this backend are judged."""
    from .inspection.status import statuses
    from .lanes import lane_named

    base = place.lane.name.partition("#")[0]
    names = [name for name in place.store.lane_names()
             if name.partition("#")[0] == base and name != place.lane.name]
    others = [status for name in names for status in statuses(place.store, lane_named(name))
              if status["state"] == "held" or status.get("queue")]
    if not others:
        return []
    listed = ", ".join(f"{lane['lane']} ({lane['state']})" for lane in others)
    return [f"the same backend has lanes keyed another way (--key-by), each its own gate that "
            f"does not exclude this one: {listed}"]


@cli.command(context_settings=CONTEXT)
@lane_options
@click.option("--json", "json_", is_flag=True, help="Print the count as JSON.")
@click.argument("count", required=False)
def seats(backend, lock_dir, model, key_by, store, json_, count):
    """How many turns may hold the lane at once: print it, or set it to COUNT (1-256, or auto:
    the engine's own slot count). Kept with the lane, so every process reads the same one."""
    from . import seat_count
    from .errors import GateUnavailable, UsageProblem
    from .inspection import render

    try:
        wanted = None if count is None else seat_count.parse(count)
    except UsageProblem as error:
        raise click.UsageError(str(error)) from None
    place = strict_place(backend, lock_dir, model, key_by, store=store)
    if not place.gated:
        raise click.UsageError(f"{place.lane.name} is not a local lane: its turns are never "
                               "gated, it has no seats")
    try:
        if wanted is None:
            result = {"lane": place.lane.name, "seats": seat_count.read(place)}
        else:
            answered = None
            if wanted == "auto":
                from .engine_slots import auto_count

                wanted, answered = auto_count(place)   # GateUnavailable: it cannot tell
                if not json_:   # what was believed, said before the count is set from it
                    click.echo(f"{place.lane.name}: {answered}")
            result = seat_count.set_count(place, wanted)
            if answered:
                result["answered"] = answered
    except GateUnavailable as error:
        render.fail(str(error))
        return exitcodes.GATE_UNAVAILABLE
    if json_:
        render.emit_json(result)
    elif count is None:
        click.echo(result["seats"])
    else:
        click.echo(seat_count.words(result))
    return exitcodes.OK


@cli.command(context_settings=CONTEXT)
@lane_options
@click.option("--since", metavar="WHEN", default=None,
              help="Only events since a duration ago (30m, 2h, 1d) or an ISO date.")
@click.option("--json", "json_", is_flag=True, help="Print the events and summary as JSON.")
def history(backend, lock_dir, model, key_by, store, since, json_):
    """The lane's journal: local turns, deflections, waits, the way back."""
    from .inspection import history as lane_history
    from .inspection import render

    gate = strict_place(backend, lock_dir, model, key_by, store=store)
    try:
        cutoff = lane_history.parse_since(since)
    except lane_history.SinceError as error:
        raise click.UsageError(str(error)) from None
    for note in lane_notes(gate):
        render.warn(note)
    data = lane_history.from_events(*gate.store.events(gate.lane, cutoff))
    rows = lane_history.timeline(data["events"]) if not json_ else []
    render.history(data, gate.lane.name, json_, rows)
    return exitcodes.OK


@cli.command(context_settings=CONTEXT)
@lane_options
@click.option("--all", "all_lanes", is_flag=True, help="Every lane the store knows.")
@click.option("--textfile", metavar="DIR", default=None,
              help="Write DIR/lanelock.prom atomically (node_exporter's textfile collector) "
                   "instead of printing.")
def metrics(backend, lock_dir, model, key_by, store, all_lanes, textfile):
    """The lanes in the Prometheus text format: holders and waiters now, turns and hold times
    so far (counters that never go backwards)."""
    from .inspection import render

    if all_lanes and backend:
        raise click.UsageError("--all and --backend exclude each other")
    try:
        from .inspection.metrics import (LaneCollector, counts_problems, exposition, lanes_fetch,
                                         write_textfile)
        import prometheus_client  # noqa: F401
    except ImportError:
        raise click.UsageError("metrics need prometheus-client: pip install '.[metrics]' in "
                               "lanelock's checkout (or pip install prometheus-client)") from None
    if textfile is not None and not os.path.isdir(textfile):
        raise click.UsageError(f"--textfile {textfile}: not a directory")
    gate = strict_place(backend, lock_dir, model, key_by, store=store)
    for note in lane_notes(gate, all_lanes):
        render.warn(note)
    scraped = lanes_fetch(gate.store, None if all_lanes else gate.lane)()
    from .inspection.status import left_out_note

    for note in (left_out_note(gate.store) if all_lanes else []) + counts_problems(scraped[0]):
        render.warn(note)
    data = exposition(LaneCollector(lambda: scraped))
    if textfile is None:
        sys.stdout.write(data.decode())
        return exitcodes.OK
    try:
        write_textfile(textfile, data)
    except OSError as error:
        render.fail(f"cannot write {textfile}: {error.strerror or error}")
        return exitcodes.USAGE
    return exitcodes.OK


class Interval(Seconds):
    """A duration of more than 0, at most `most` seconds (a minute unless said; None: no
    bound), as --help shows it."""

    def __init__(self, flag: str, most: float | None = 60.0):
        super().__init__(flag)
        self.min_open, self.max = True, most

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if number <= 0 or (self.max is not None and number > self.max):
            bound = "" if self.max is None else f" and at most {self.max:g}"
            self.fail(f"{value} is out of range: SECONDS must be more than 0{bound}",
                      param, ctx)
        return number


def _engine_url(place, engine: str | None) -> str:
    from .errors import UsageProblem
    from .witness import engine_url, parse_engine

    try:
        url = parse_engine(engine) if engine is not None else engine_url(place.lane)
    except UsageProblem as error:
        raise click.UsageError(str(error)) from None
    if url is None:
        raise click.UsageError(f"{place.lane.name} is on another machine: give --engine URL")
    return url


@cli.command(context_settings=CONTEXT)
@lane_options
@click.option("--engine", metavar="URL", default=None,
              help="The engine's base URL (default: http://HOST:PORT of the backend).")
@click.option("--interval", metavar="SECONDS", type=Interval("--interval"), default=0.25,
              show_default=True, help="Seconds between looks at the engine's account.")
@click.option("--quiet", "-q", is_flag=True, help="No notes from lanelock (errors still print).")
def watch(backend, lock_dir, model, key_by, store, engine, interval, quiet):
    """Witness the engine: every generation it runs is a turn the gate saw, or it says so.

    Reads the engine's own account (llama.cpp /slots or /metrics, llama-swap /running, vLLM and
    SGLang /metrics) and holds it against the lane; an unseen generation is journaled, counted
    and said on stderr. Runs until SIGTERM or ^C. Exit 0; 69 when the engine cannot be witnessed
    (Ollama); 2 on a usage error.
    """
    from .say import Say
    from .watch import watch as run_watch

    # Keyed by model with no model: each model's generations against its own lane
    # (witness_models.py), nothing to warn about.
    place = strict_place(backend, lock_dir, model, key_by, store=store, no_model_said=True)
    if not place.gated:
        raise click.UsageError(f"{place.lane.name} is not a local lane: no turn ever holds it, "
                               "so there is nothing to witness against")
    return run_watch(place, _engine_url(place, engine), interval, Say(quiet))


# `lanelock proxy`'s options: every one a setting (proxy_OPTION in a config file), in this order.
PROXY_OPTIONS = ("proxy_listen", "backend", "proxy_fallback", "proxy_fallback_model",
                 "proxy_fallback_key_env", "proxy_fallback_timeout", "proxy_fallback_pass_auth",
                 "proxy_wait", "proxy_max_wait", "proxy_priority", "proxy_max_priority",
                 "proxy_linger", "proxy_session_header", "proxy_pin_slots", "proxy_token_env",
                 "key_by", "store", "lock_dir", "proxy_witness", "proxy_engine",
                 "proxy_witness_interval", "proxy_max_connections", "proxy_header_timeout",
                 "proxy_idle_timeout", "proxy_quiet", "proxy_verbose")


def proxy_options(function):
    for name in reversed(PROXY_OPTIONS):
        function = setting_option(name)(function)
    return function


@cli.command(context_settings=CONTEXT)
@proxy_options
def proxy(**flags):
    """Serve the lane to HTTP clients: a loopback proxy that holds the lane per generation request.

    Point a client's base URL at it (http://127.0.0.1:8089/v1). A busy lane sends the request to
    --fallback, or answers 503 with Retry-After. Every option is also a config key (proxy_OPTION;
    SIGHUP reads the files again). Needs aiohttp: pip install '.[proxy]' in lanelock's checkout.
    """
    import asyncio

    from .errors import UsageProblem

    try:
        import aiohttp  # noqa: F401
    except ImportError:
        raise click.UsageError("the proxy needs aiohttp: pip install '.[proxy]' in lanelock's "
                               "checkout (or pip install aiohttp)") from None
    from .proxy.serve import serve, start

    # Not given: None, so the files' value counts (a repeatable option's (), an empty --lock-dir).
    flags = {name: None if value in ((), "") else list(value) if isinstance(value, tuple)
             else value for name, value in flags.items()}
    try:
        app, host, port, say = start(flags)
    except UsageProblem as error:
        raise click.UsageError(str(error)) from None
    return asyncio.run(serve(app, host, port, say))


@cli.command(context_settings=CONTEXT)
@setting_option("store")
@setting_option("lock_dir")
@setting_option("backend")
@click.option("--json", "json_", is_flag=True, help="Print the map as JSON.")
@click.argument("words", nargs=-1,
                metavar="[share LANE MODEL... | unshare MODEL... | alias ALIAS MODEL]")
def models(backend, lock_dir, store, json_, words):
    """Which models of the backend share a lane, with lanes keyed by model (--key-by model).

    Models that swap on one GPU share a lane; models on two GPUs do not. `share LANE MODEL...`
    puts models on the lane BACKEND#LANE, `unshare MODEL...` gives each its own again, `alias
    ALIAS MODEL` puts the engine's other name for MODEL on MODEL's lane. Kept with
    the lanes: every process, HOME and user reads the same map. Exit 0; 2 on a usage error; 69
    when the store cannot keep or read it.
    """
    from .errors import GateUnavailable, UsageProblem
    from .models_command import command
    from .say import error

    place = strict_place(backend, lock_dir, None, None, store=store, no_model_said=True)
    try:
        return command(place, list(words), json_)
    except UsageProblem as problem:
        raise click.UsageError(str(problem)) from None
    except GateUnavailable as problem:
        error(str(problem))
        return exitcodes.GATE_UNAVAILABLE


@cli.group(context_settings=CONTEXT)
def config():
    """Show, set and locate the TOML configuration."""


@config.command("show", context_settings=CONTEXT)
@click.option("--json", "json_", is_flag=True, help="Print the settings as JSON.")
def config_show(json_):
    """The effective configuration and where each value came from."""
    from . import config as config_files
    from .inspection import render
    from .settings import effective

    try:
        data = effective()
    except config_files.ConfigError as error:
        raise click.UsageError(str(error)) from None
    render.config(data, json_)
    return exitcodes.OK


@config.command("set", context_settings=CONTEXT)
@click.argument("key")
@click.argument("value")
@click.option("--system", is_flag=True, help="Write the system file (/etc/lanelock/config.toml).")
def config_set(key, value, system):
    """Validate KEY = VALUE (TOML syntax; bare words are strings) and write it."""
    from . import config, settings

    try:
        path = settings.set_value(key, value, system=system)
    except config.ConfigError as error:
        raise click.UsageError(str(error)) from None
    click.echo(f"{key} set in {path}")
    return exitcodes.OK


@config.command("path", context_settings=CONTEXT)
@click.option("--json", "json_", is_flag=True, help="Print the paths as JSON.")
def config_path(json_):
    """The system and per-user config files, and whether they exist."""
    import os

    from . import config as settings
    from .inspection import render

    files = {"system": settings.system_file(), "user": settings.user_file()}
    data = {name: {"path": path, "exists": bool(path) and os.path.exists(path)}
            for name, path in files.items()}
    if json_:
        render.emit_json(data)
    else:
        for name, info in data.items():
            click.echo(f"{name:<7} {info['path']}{'' if info['exists'] else ' (absent)'}")
    return exitcodes.OK


def _pairs(values: tuple[str, ...], option: str) -> dict[str, str]:
    pairs = {}
    for value in values:
        name, sep, text = value.partition("=")
        if not sep or not name:
            raise click.UsageError(f"{option} takes KEY=VALUE, not {value!r}")
        pairs[name] = text
    return pairs


@cli.command(context_settings={**CONTEXT, "allow_interspersed_args": False})
@click.option("--backend", "-b", metavar="BACKEND", default=None, help="The lane to duel on.")
@click.option("--lock-dir", metavar="DIR", default=None, help="Lock root for every turn.")
@click.option("--store", metavar="URL", default=None, help="Duel on a postgresql:// lane store.")
@click.option("--hold", type=Seconds("--hold"), default=1.0, show_default=True,
              metavar="SECONDS", help="How long A keeps the lane busy (at least until B and C "
                                      "have deflected).")
@click.option("--fallback", metavar="CMD", default=None,
              help="What B and C run when deflected (default: a stand-in that only reports).")
@click.option("--users", metavar="U1,U2", default=None,
              help="Run B and C as these users (root only): one gate across users.")
@click.option("--profile-env", multiple=True, metavar="KEY=VALUE",
              help="Extra environment for B, the profile-like session (repeatable).")
@click.option("--cron-env", multiple=True, metavar="KEY=VALUE",
              help="Extra environment for C, as a crontab would set it (repeatable).")
@click.option("--json", "json_", is_flag=True, help="Print the report as JSON.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def duel(backend, lock_dir, store, hold, fallback, users, profile_env, cron_env, json_, command):
    """Prove the gate with real processes: A holds, B and C (cron-like) deflect, the way back.

    COMMAND, if given, is what A runs while it holds the lane (e.g. a curl to the backend).
    Exit 0 PASS, 1 FAIL.
    """
    import os

    from .inspection import render
    from .run import words
    from .testing.duel import LANE_MODEL, Duel

    user_list = [name for name in (users or "").split(",") if name]
    if user_list and os.geteuid() != 0:
        raise click.UsageError("--users needs root (the duel switches to those users)")
    if user_list:
        import pwd

        for name in user_list:
            try:
                pwd.getpwnam(name)
            except KeyError:
                raise click.UsageError(f"--users: no such user {name!r}") from None
    try:   # split as `run --fallback` splits it (bash's quoting, no shell run)
        fallback_argv = words.split(fallback) if fallback else []
    except ValueError as error:
        raise click.UsageError(f"--fallback {fallback!r}: {error}") from None
    gate = strict_gate(backend, lock_dir, LANE_MODEL, "model", store=store)
    contest = Duel(gate, hold=hold, command=list(command), users=user_list, lock_dir=lock_dir,
                   store=store,
                   fallback=fallback_argv,
                   profile_env=_pairs(profile_env, "--profile-env"),
                   cron_env=_pairs(cron_env, "--cron-env"),
                   on_step=None if json_ else render.duel_step)
    try:
        result = contest.run()
    except KeyboardInterrupt:
        contest.cleanup()
        raise
    render.duel(result, json_)
    return exitcodes.OK if result["result"] == "PASS" else exitcodes.FAILED


@cli.command(context_settings=CONTEXT)
@click.argument("shell", type=click.Choice(["bash", "zsh", "fish"]))
@click.option("--complete", "line", metavar="LINE", default=None, hidden=True,
              help="What the script asks on TAB: the candidates for LINE, the command line up to "
                   "the cursor.")
@click.option("--word", default=None, hidden=True,
              help="(bash) The part of the current word that bash replaces.")
def completion(shell, line, word):
    """Print the completion script for SHELL (bash, zsh or fish).

    \b
    bash: lanelock completion bash > ~/.local/share/bash-completion/completions/lanelock
    zsh:  lanelock completion zsh > ~/.zfunc/_lanelock  (with ~/.zfunc on $fpath before compinit)
    fish: lanelock completion fish > ~/.config/fish/completions/lanelock.fish
    """
    from .completion import answer, script

    sys.stdout.write(script(shell) if line is None else answer(shell, line, word))
    return exitcodes.OK


_NEGATIVE = __import__("re").compile(r"-\d+(\.\d*)?|-\.\d+")


def _glued_dash_value(ctx, argv: list[str]) -> click.BadParameter | None:
    """What is wrong with a value glued to an option whose value is optional, when it starts
    with a dash (`--wait=-nan`, `-w-1`, `-qw-nan`): click puts a glued value back among the
    words, where a dash makes it options (a bare --wait, then "No such option '-n'"). Judged as
    the value the user wrote; None when no such word is there or the value is one."""
    if ctx is None:
        return None
    for word in argv[:argv.index("--") if "--" in argv else len(argv)]:
        for param, value in _glued_values(ctx.command.params, word):
            if value.startswith("-") and isinstance(param.type, Seconds) and param.type.optional:
                try:   # judged as any glued value: no hint to glue it
                    Seconds(param.type.flag).convert(value, param, ctx)
                except click.BadParameter as error:
                    return error
    return None


def _glued_values(params, word: str):
    """(option, value) for a value glued to an option in one word: --name=value, -nvalue, or
    -fnvalue after short flags."""
    if word.startswith("--"):
        name, equals, value = word.partition("=")
        yield from ((param, value) for param in params if equals and name in param.opts)
        return
    short = {spelling[1]: param for param in params for spelling in param.opts
             if len(spelling) == 2 and spelling[0] == "-"}
    for index in range(1, len(word)):
        param = short.get(word[index])
        if param is None:
            return
        if not getattr(param, "is_flag", False) or getattr(param, "_flag_needs_value", False):
            yield param, word[index + 1:]
            return


def main(argv: list[str] | None = None) -> int:
    """Entry point: one-line `lanelock:` errors with documented codes, never a traceback."""
    from .guard import guarded, output_status

    status = guarded(lambda: _click_main(argv))
    command = (sys.argv[1:] if argv is None else list(argv))[:1]
    if command == ["run"]:   # run's own lines never change what runs or its status
        return status
    # probe's 1 means busy: an output that failed is its error status instead
    return output_status(status, exitcodes.USAGE if command == ["probe"] else
                         exitcodes.OUTPUT_FAILED)


def _click_main(argv: list[str] | None):
    from . import guard
    from .errors import GateUnavailable

    try:
        return cli.main(args=argv, prog_name="lanelock", standalone_mode=False)
    except click.exceptions.NoArgsIsHelpError as error:   # bare `lanelock`, `lanelock config`
        from . import say

        say.usage_help(error.format_message())
        return exitcodes.USAGE
    except click.NoSuchOption as error:
        lost = _glued_dash_value(error.ctx, sys.argv[1:] if argv is None else argv)
        if lost is not None:
            return guard.usage(lost.format_message(), error.ctx.command_path)
        if _NEGATIVE.fullmatch(error.option_name or ""):
            error.message = (f"{error.option_name} is a negative number, not an option: seconds "
                             "and counts are 0 or more")
        return guard.usage(error.format_message(), error.ctx.command_path if error.ctx else "")
    except click.UsageError as error:
        return guard.usage(error.format_message(), error.ctx.command_path if error.ctx else "")
    except GateUnavailable as error:   # a read command could not read the lane: one line, 2
        from . import say

        say.error(str(error))
        return exitcodes.USAGE
    except click.ClickException as error:
        from . import say

        say.error(error.format_message())
        return error.exit_code
    except click.exceptions.Exit as error:
        return error.exit_code
    except click.Abort:   # click's name for a KeyboardInterrupt (it has printed a newline)
        return guard.die_of_sigint()
