"""SIGHUP: read the config files again, under the same flags, and apply what changed to the next
request -- fallbacks, waits and caps, classes, linger, pinning, per-client rules, cheap paths and
the log's verbosity. A request in flight or waiting keeps the settings it came with (app.py hands
each its options), so nothing is dropped: no stream cut, no wait shortened.

A file that does not parse, or a value the proxy cannot use (a fallback it cannot read, a key's
variable unset), changes nothing: the running settings stay, with one line saying why. What a
running proxy cannot change (its address, its lane and store, its token, its witness, its
connection limits: configured.AT_RESTART) is said, and applied at the next start.
"""

from __future__ import annotations

import time

from ..errors import UsageProblem

KEEPING = "keeping the running settings"


def reload(proxy) -> None:
    """The SIGHUP handler (on the event loop): never raises, whatever the files say."""
    say = proxy.say
    try:
        _reload(proxy)
    except Exception as error:  # noqa: BLE001 - a reload must never end the proxy
        say.warn(f"reload: {type(error).__name__}: {error}; {KEEPING}")


def _reload(proxy) -> None:
    from ..settings import Settings
    from .configured import AT_RESTART, options_of

    say, configured = proxy.say, proxy.configured
    settings = Settings(configured.flags)
    if settings.config_error:
        say.warn(f"reload: {settings.config_error}; {KEEPING}")
        return
    try:
        options = options_of(settings, proxy.gate)
    except UsageProblem as error:
        say.warn(f"reload: {error}; {KEEPING}")
        return
    for line in settings.warnings():
        say.warn(line)
    old = configured.settings
    changed = [name for name in configured.shown() if old.lookup(name) != settings.lookup(name)]
    later = [name for name in changed if name in AT_RESTART]
    _keep_at_restart(proxy.options, options)
    _apply(proxy, options)
    configured.settings, configured.reloaded = settings, time.time()
    now = [name for name in changed if name not in AT_RESTART]
    files = ", ".join(settings.config.files) or "no config file"
    said = f"reloaded {files}: " + (", ".join(now) + " changed" if now else "nothing changed")
    if later:
        said += f"; {', '.join(later)} changed, applied at the next start"
    say.note(said)


def _keep_at_restart(running, options) -> None:
    """What the new options cannot change: the running ones' (the token read at start, the
    witness's thread, the listener's limits)."""
    for name in ("token", "witness", "max_connections", "header_timeout", "idle_timeout",
                 "max_body"):
        setattr(options, name, getattr(running, name))


def _apply(proxy, options) -> None:
    from .pinning import Pinning

    proxy.options = options
    proxy.say.quiet = options.quiet
    proxy.lanes.options = options   # lanes made from now on
    for lane in proxy.lanes:
        lane.chain.options = options
        lane.linger.seconds = options.linger
    if options.pin_slots and proxy.pinning is None:
        proxy.pinning = Pinning(proxy.backend_url, proxy.say)
    elif not options.pin_slots:
        proxy.pinning = None
