"""Human and JSON views of the same dicts. JSON keys are stable and documented in the README.

Plain text here (the run path and the small read commands must not pay for rich); the richer views
of status and history import rich lazily, only on a terminal.
"""

from __future__ import annotations

import json
import sys

from .gate import holder_words, sanitize


def emit_json(data) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=True) + "\n")


def fail(message: str) -> None:
    sys.stderr.write(f"lanelock: {sanitize(message)}\n")


def warn(message: str) -> None:
    sys.stderr.write(f"lanelock: warning: {sanitize(message)}\n")


def where(info: dict, as_json: bool) -> None:
    for warning in info["warnings"]:
        warn(warning)
    if as_json:
        return emit_json(info)
    rows = [
        ("lane", f"{info['lane']} ({info['scope']}{'' if info['gated'] else ', ungated'})"),
        ("lock", info["lock_path"]),
        ("sidecar", info["sidecar_path"]),
        ("journal", info["journal_path"]),
        ("root", f"{info['root']} [{info['root_source']}: {info['root_detail']}]"),
    ]
    for name, value in rows:
        sys.stdout.write(f"{name:<8} {value}\n")


def probe(result: dict, as_json: bool) -> None:
    if as_json:
        return emit_json(result)
    state = result["state"]
    if state == "busy":
        sys.stdout.write(f"busy: {result['lane']} held ({holder_words(result.get('holder'))})\n")
    elif state == "ungated":
        sys.stdout.write(f"ungated: {result['lane']} is not a local lane\n")
    else:
        sys.stdout.write(f"free: {result['lane']}\n")


def _console():
    """A rich console on a terminal (NO_COLOR and TERM=dumb respected), else None for plain text."""
    import os

    if not sys.stdout.isatty() or os.environ.get("TERM") == "dumb":
        return None
    from rich.console import Console

    return Console(highlight=False, no_color=bool(os.environ.get("NO_COLOR")))


def duel_step(step: dict) -> None:
    console = _console()
    mark = "ok" if step["ok"] else "FAIL"
    text = f"{step['step']:<18} {sanitize(step['detail'], 400)}"
    if console is None:
        sys.stdout.write(f"[{mark:>4}] {text}\n")
        sys.stdout.flush()
    else:
        from rich.markup import escape

        style = "green" if step["ok"] else "bold red"
        console.print(f"[{style}]{'✓' if step['ok'] else '✗'}[/{style}] {escape(text)}")


def duel(result: dict, as_json: bool) -> None:
    if as_json:
        return emit_json(result)
    paths = {"duel": result["expected_lock_path"], **result["lock_paths"]}
    sys.stdout.write("lock paths:\n")
    for role, path in paths.items():
        sys.stdout.write(f"  {role:<5} {path}\n")
    verdict = result["result"] + (f": {result['reason']}" if result["reason"] else "")
    console = _console()
    if console is None:
        sys.stdout.write(verdict + "\n")
    else:
        from rich.markup import escape

        style = "bold green" if result["result"] == "PASS" else "bold red"
        console.print(f"[{style}]{escape(verdict)}[/{style}]")
