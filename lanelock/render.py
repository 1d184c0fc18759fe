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
