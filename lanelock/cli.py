"""Click commands: parse, call, render. No logic of its own lives here."""

from __future__ import annotations

import sys

import click

from . import __version__, exitcodes

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


def complete_backend(ctx, param, incomplete):
    """Offer the lanes that already exist under the lock root."""
    from .paths import resolve_root
    import os

    try:
        names = os.listdir(resolve_root(ctx.params.get("lock_dir"), None).path)
    except OSError:
        return []
    from .key import name_from_stem

    lanes = {name_from_stem(name[:-5].split("~", 1)[0]) for name in names if name.endswith(".lock")}
    return sorted(lane for lane in lanes if lane and lane.startswith(incomplete))


def lane_options(function):
    """The options every command uses to name a lane."""
    function = click.option("--store", metavar="URL", default=None,
                            help="postgresql://... lane store for several hosts (env "
                                 "LANELOCK_STORE; default: flock under the lock root).")(function)
    function = click.option("--key-by", type=click.Choice(["backend", "model"]), default=None,
                            help="Key the lane on the backend (default) or backend+model.")(function)
    function = click.option("--model", "-m", metavar="NAME", default=None,
                            help="Model label (env LANELOCK_MODEL).")(function)
    function = click.option("--lock-dir", metavar="DIR", default=None,
                            help="Lock root (env LANELOCK_DIR; default /run/lock/lanelock).")(function)
    function = click.option("--backend", "-b", metavar="BACKEND", default=None,
                            shell_complete=complete_backend, help="HOST:PORT, [V6]:PORT or URL (env LANELOCK_BACKEND; "
                                 "default 127.0.0.1:8080).")(function)
    return function


def make_gate(backend, lock_dir, model, key_by, gate=None, grace=None, warn=None, store=None):
    from .gate import Gate
    from .key import BackendError

    try:
        kwargs = {"warn": warn} if warn else {}
        return Gate(backend, model=model, key_by=key_by, lock_dir=lock_dir, gate=gate,
                    grace=grace, store=store, **kwargs)
    except BackendError as error:
        raise click.UsageError(str(error)) from None


def strict_gate(*args, **kwargs):
    """A gate for read commands: a broken config is a usage error (exit 2), not fail-open."""
    gate = make_gate(*args, **kwargs)
    if gate.config_error:
        raise click.UsageError(gate.config_error)
    return gate


@click.group(context_settings=CONTEXT)
@click.version_option(__version__, "--version", prog_name="lanelock")
def cli():
    """Hold a local model's lane for exactly one turn; everyone else takes the fallback.

    A cross-process flock(2) gate per backend (host:port): `lanelock run -- CMD` holds it while
    CMD runs; a second session finds it busy and deflects to its fallback.
    """


@cli.command(context_settings={**CONTEXT, "allow_interspersed_args": False})
@lane_options
@click.option("--session", "-s", metavar="LABEL", default=None,
              help="Session label (env LANELOCK_SESSION; default user@tty or user@cron).")
@click.option("--fallback", "-f", "fallbacks", metavar="CMD", multiple=True,
              help="Fallback command when busy; repeatable, tried in order. '@BACKEND CMD' binds "
                   "it to a backend, skipped when that lane is busy.")
@click.option("--chain", metavar="NAME", default=None, help="Use a fallback chain from the config.")
@click.option("--wait", "-w", type=click.FloatRange(min=0), is_flag=False,
              flag_value=float("inf"), default=None, metavar="[SECONDS]",
              help="Block in the kernel until the lane is free (up to SECONDS), then fall back.")
@click.option("--busy-exit-code", "-E", type=click.IntRange(0, 255), default=None,
              help="Exit status when busy and no fallback ran (default 75).")
@click.option("--grace", type=click.FloatRange(min=0), default=None, metavar="SECONDS",
              help="Wait this long in the kernel before deflecting (default 0.05).")
@click.option("--kill-after", type=click.FloatRange(min=0), default=None, metavar="SECONDS",
              help="SIGKILL the child this long after forwarding it a signal it ignores.")
@click.option("--gate/--no-gate", "gate_override", default=None,
              help="Force gating on or off, whatever the backend's classification.")
@click.option("--quiet", "-q", is_flag=True, help="No notes or warnings from lanelock.")
@click.option("--verbose", "-v", is_flag=True, help="Report the wait time and the lock path.")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def run(**params):
    """Run COMMAND holding the backend's lane; deflect to a fallback when it is busy."""
    from .run.wrapper import UsageProblem, start

    try:
        return start(params)
    except UsageProblem as error:
        raise click.UsageError(str(error)) from None


@cli.command(context_settings=CONTEXT)
@lane_options
@click.option("--json", "json_", is_flag=True, help="Print the result as JSON.")
def probe(backend, lock_dir, model, key_by, store, json_):
    """Is the lane free? Exit 0 free, 1 busy, 2 error. Takes and drops the lock at once."""
    from .inspection import render
    from .paths import GateUnavailable

    gate = strict_gate(backend, lock_dir, model, key_by, store=store)
    try:
        result = gate.probe()
    except GateUnavailable as error:
        render.fail(str(error))
        return exitcodes.USAGE
    render.probe(result, json_)
    return exitcodes.PROBE_BUSY if result["state"] == "busy" else exitcodes.OK


@cli.command(context_settings=CONTEXT)
@lane_options
@click.option("--json", "json_", is_flag=True, help="Print the paths as JSON.")
def where(backend, lock_dir, model, key_by, store, json_):
    """Print the lock file, the sidecar and how the lock root was chosen."""
    from .inspection import render

    render.where(strict_gate(backend, lock_dir, model, key_by, store=store).where(), json_)
    return exitcodes.OK


@cli.command(context_settings=CONTEXT)
@lane_options
@click.option("--all", "all_lanes", is_flag=True, help="Every lane under the lock root.")
@click.option("--json", "json_", is_flag=True, help="Print the facts as JSON.")
@click.option("--watch", is_flag=True, help="Refresh a live view until ^C.")
def status(backend, lock_dir, model, key_by, store, all_lanes, json_, watch):
    """Who holds the lane, from the kernel's /proc/locks, cross-checked with the sidecar.

    Never takes the lock. Exit 0 whatever the lane's state; 2 on a usage error.
    """
    from .inspection import render
    from .inspection.status import lane_stems, lane_status

    if all_lanes and backend:
        raise click.UsageError("--all and --backend exclude each other")
    gate = strict_gate(backend, lock_dir, model, key_by, store=store)
    root = gate.root.path
    notes = list(gate.config.ignored)
    if not gate.gated and not all_lanes:
        notes.append(f"{gate.lane.name} is not a local lane: turns on it are never gated")

    def fetch():
        if gate.store.kind == "postgresql":
            return gate.store.lane_statuses(None if all_lanes else gate.lane.name)
        if all_lanes:
            return [lane_status(root, stem) for stem in lane_stems(root)]
        return [lane_status(root, gate.lane.stem, gate.lane.name)]

    if watch and not json_:
        try:
            render.watch(fetch)
        except KeyboardInterrupt:
            return exitcodes.OK
    render.status(fetch(), json_, notes=notes)
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

    from .paths import GateUnavailable

    gate = strict_gate(backend, lock_dir, model, key_by, store=store)
    try:
        cutoff = lane_history.parse_since(since)
    except lane_history.SinceError as error:
        raise click.UsageError(str(error)) from None
    if gate.store.kind == "postgresql":
        try:
            data = lane_history.from_events(gate.store.events(gate.lane.name, cutoff), 0)
        except GateUnavailable as error:
            render.fail(str(error))
            return exitcodes.USAGE
    else:
        data = lane_history.load(gate.journal_path, cutoff)
    rows = lane_history.timeline(data["events"]) if not json_ else []
    render.history(data, gate.lane.name, json_, rows)
    return exitcodes.OK


@cli.group(context_settings=CONTEXT)
def config():
    """Show, set and locate the TOML configuration."""


@config.command("show", context_settings=CONTEXT)
@click.option("--json", "json_", is_flag=True, help="Print the settings as JSON.")
def config_show(json_):
    """The effective configuration and where each value came from."""
    from . import config as settings
    from .inspection import render

    try:
        data = settings.effective()
    except settings.ConfigError as error:
        raise click.UsageError(str(error)) from None
    render.config(data, json_)
    return exitcodes.OK


@config.command("set", context_settings=CONTEXT)
@click.argument("key")
@click.argument("value")
@click.option("--system", is_flag=True, help="Write the system file (/etc/lanelock/config.toml).")
def config_set(key, value, system):
    """Validate KEY = VALUE (TOML syntax; bare words are strings) and write it."""
    from . import config as settings

    try:
        path = settings.set_value(key, value, system=system)
    except settings.ConfigError as error:
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
@click.option("--hold", type=click.FloatRange(min=0), default=1.0, show_default=True,
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
    import shlex

    from .inspection import render
    from .testing.duel import Duel

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
    gate = strict_gate(backend, lock_dir, None, None, store=store)
    contest = Duel(gate, hold=hold, command=list(command), users=user_list, lock_dir=lock_dir,
                   store=store,
                   fallback=shlex.split(fallback) if fallback else [],
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


def main(argv: list[str] | None = None) -> int:
    """Entry point: one-line `lanelock:` errors with documented codes, never a traceback."""
    from .guard import guarded

    return guarded(lambda: _click_main(argv))


def _click_main(argv: list[str] | None):
    from . import guard

    try:
        return cli.main(args=argv, prog_name="lanelock", standalone_mode=False)
    except click.UsageError as error:
        return guard.usage(error.format_message(), error.ctx.command_path if error.ctx else "")
    except click.ClickException as error:
        sys.stderr.write(f"lanelock: {error.format_message()}\n")
        return error.exit_code
    except click.exceptions.Exit as error:
        return error.exit_code
    except click.Abort:   # click's name for a KeyboardInterrupt (it has printed a newline)
        return guard.die_of_sigint()
