"""Human and JSON views of the same dicts. JSON keys are stable and documented in the README.

Plain text here (the run path and the small read commands must not pay for rich); the richer views
of status and history import rich lazily, only on a terminal.
"""

from __future__ import annotations

import json
import sys

from .. import say
from ..holder import words as holder_words
from ..say import sanitize


def emit_json(data) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=True) + "\n")


fail = say.error
warn = say.warn


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
    if info["sidecar_path"] is None:   # the lane lives in the store; the lock root is not used
        rows = [rows[0], ("store", f"{info['lock_path']} ({info['store']})")]
    rows.append(("gate", info["store_detail"]))
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


STATE_STYLE = {"held": "bold yellow", "free": "green", "unknown": "red"}


def status(results: list[dict], as_json: bool, *, notes: list[str] | None = None) -> None:
    for note in notes or []:
        warn(note)
    if as_json:
        return emit_json({"lanes": results})
    console = _console()
    if console is None:
        for result in results:
            sys.stdout.write(_status_line(result) + "\n")
        return
    console.print(status_table(results))


def _status_line(result: dict) -> str:
    count = _waiting(result)
    waiting = f" [{count} waiting]" if count else ""
    source = " (probe: /proc/locks unreadable)" if result["kernel_source"] == "probe" else ""
    queued = queue_lines(result)
    if queued:   # one line per lane (scripts read it so): the queue goes inside its brackets
        waiting = f" [{count} waiting: " + "; ".join(queued) + "]"
    engine = engine_words(result.get("engine"), quiet=True)
    engine = f"; {engine}" if engine else ""
    return sanitize(f"{result['lane']}: {result['message']}{waiting}{source}{engine}", 4000)


def engine_words(engine: dict | None, quiet: bool = False) -> str | None:
    """'engine http://127.0.0.1:8080 (llama.cpp): 1 of 2 slots generating; unseen: ...'. quiet
    (the plain line): nothing for an engine that does not answer and that no witness ever
    watched -- a lane with no server behind it, which the JSON still says."""
    if not engine:
        return None
    if quiet and not engine.get("witness") and not engine.get("unseen") \
            and (engine.get("problem") or "").startswith("not answering"):
        return None
    url = engine.get("url") or "?"
    if engine.get("problem"):
        now = f"engine {url}: {engine['problem']}"
    else:
        slots = engine.get("slots")
        of = f" of {slots} slot{'' if slots == 1 else 's'}" if slots is not None else ""
        now = f"engine {url} ({engine.get('kind')}): {engine.get('generating')}{of} generating"
    count, seconds = engine.get("unseen"), engine.get("unseen_seconds")
    last, witness = engine.get("last_unseen") or {}, engine.get("witness")
    if count:
        text = (f"unseen: {count} generation{'' if count == 1 else 's'}"
                f"{f', {seconds:.1f} s' if isinstance(seconds, (int, float)) else ''}")
        if last:
            slots, turns = last.get("slots"), last.get("turns")
            text += (f", last at {last.get('started')} ({last.get('duration')} s, {slots} "
                     f"slot{'' if slots == 1 else 's'} generating, {turns} "
                     f"turn{'' if turns == 1 else 's'} holding)")
        return f"{now}; {text}"
    if count == 0 and witness:
        return f"{now}; unseen: none (witnessed by {witness.get('witness')} pid {witness.get('pid')})"
    return f"{now}; no witness has watched it (lanelock watch, or the proxy)"


def _waiting(result: dict) -> int:
    """Turns waiting: the queue when the store keeps one (the kernel sees only its first)."""
    return len(result.get("queue") or ()) or len(result["waiters"])


def queue_lines(result: dict) -> list[str]:
    """'next: 1. interactive pid 42 (session chat), waited 3.1s' -- the queue in order."""
    lines = []
    for entry in result.get("queue") or ():
        klass = entry["class"]
        if entry["effective_class"] != klass:
            klass = f"{entry['effective_class']} (aged from {klass})"
        where = f" on {entry['host']}" if entry.get("host") and entry["host"] != _here() else ""
        stopped = (f", stopped: those behind it wait until kill -CONT {entry['pid']} (or it ends)"
                   if entry.get("stopped") else "")
        lines.append(f"{entry['position']}. {klass} pid {entry['pid']}{where} "
                     f"(session {entry.get('session') or '?'}), waited {entry['waited']:.1f}s"
                     f"{stopped}")
    return lines


def _here() -> str:
    from ..facts import hostname

    return hostname()


def status_table(results: list[dict]):
    from rich.markup import escape
    from rich.table import Table

    table = Table(show_header=True, header_style="bold", expand=False)
    for column in ("lane", "state", "what the kernel and the sidecar say", "waiting"):
        table.add_column(column)
    for result in results:
        style = STATE_STYLE.get(result["state"], "")
        engine = engine_words(result.get("engine"))
        message = "\n".join([sanitize(result["message"], 2000)] +
                            [sanitize(line, 300) for line in queue_lines(result)] +
                            ([sanitize(engine, 600)] if engine else []))
        table.add_row(escape(sanitize(result["lane"])), f"[{style}]{result['state']}[/{style}]",
                      escape(message), str(_waiting(result) or ""))
    if not results:
        table.add_row("-", "-", "no lanes under the lock root yet", "")
    return table


def watch(fetch, interval: float = 0.5, *, as_json: bool = False, notes=()) -> None:
    """Refresh the status table until ^C (rich Live on a terminal; plain lines otherwise; with
    as_json, JSON lines: one {"time", "lanes"} object per refresh), or until nobody reads stdout
    any more (`| head -1`, `>&-`): that ends the watch quietly, as a finished command."""
    import time

    from ..guard import stdout_gone

    for note in notes:
        warn(note)
    if as_json:
        while True:
            sys.stdout.write(json.dumps({"time": time.time(), "lanes": fetch()}, sort_keys=True)
                             + "\n")
            sys.stdout.flush()
            if stdout_gone(interval):
                return
    console = _console()
    if console is None:
        while True:
            for result in fetch():
                sys.stdout.write(_status_line(result) + "\n")
            sys.stdout.flush()
            if stdout_gone(interval):
                return
    from rich.live import Live

    with Live(status_table(fetch()), console=console, refresh_per_second=4) as live:
        while not stdout_gone(interval):
            live.update(status_table(fetch()))


CELL = {"local": ("█", "green"), "deflected": ("▒", "yellow"), "idle": ("·", "dim"),
        "unseen": ("!", "bold red")}


def history(data: dict, lane: str, as_json: bool, rows: list) -> None:
    from .history import describe

    if as_json:
        return emit_json({"lane": lane, **data})
    summary = data["summary"]
    console = _console()
    lines = []
    for event in data["events"]:
        stamp = local_time(event.get("ts"))
        who = sanitize(f"{event.get('session') or '?'}", 40)
        lines.append((stamp, event["event"], who, str(event.get("pid", "?")),
                      sanitize(describe(event), 200)))
    if console is None:
        for line in lines:
            sys.stdout.write("  ".join(f"{cell:<{width}}" for cell, width in
                                       zip(line, (28, 10, 24, 8, 0))).rstrip() + "\n")
    else:
        from rich.markup import escape
        from rich.table import Table

        table = Table(show_header=True, header_style="bold")
        for column in ("time", "event", "session", "pid", "detail"):
            table.add_column(column)
        for line in lines:
            table.add_row(*(escape(cell) for cell in line))
        console.print(table)
        for label, cells in rows:
            bar = "".join(f"[{CELL[c][1]}]{CELL[c][0]}[/{CELL[c][1]}]" for c in cells)
            console.print(f"{label}  {bar}")
        if rows:
            console.print("           █ local  ▒ deflected  · idle  ! unseen (one cell per "
                          "minute)")
    if data["unreadable_lines"]:
        warn(f"{data['unreadable_lines']} journal line(s) could not be read and were skipped")
    sys.stdout.write(
        f"turns {summary['turns']} ({summary['local']} local, {summary['deflected']} deflected"
        f"{', ' + str(summary['fail_open']) + ' fail-open' if summary['fail_open'] else ''}); "
        f"deflection rate {summary['deflection_rate'] * 100:.0f}%; busy "
        f"{summary['busy_fraction'] * 100:.0f}% of the span; longest hold "
        f"{summary['longest_hold']:.1f}s{_uncounted(summary)}"
        f"{'; ' + str(summary['holding']) + ' still holding' if summary['holding'] else ''}; "
        f"way back to local {summary['way_back']}x{_unseen(summary)}\n")


def _unseen(summary: dict) -> str:
    if not summary.get("unseen"):
        return ""
    count = summary["unseen"]
    return (f"; UNSEEN {count} generation{'' if count == 1 else 's'} "
            f"({summary['unseen_seconds']:.1f}s) the engine ran with no turn holding the lane")


def _uncounted(summary: dict) -> str:
    """The turns busy and the longest hold leave out: they never said when they ended."""
    parts = [f"{count} {one if count == 1 else many}" for count, one, many in (
        (summary["died"], "died turn", "died turns"),
        (summary["end_unknown"], "turn with no known end", "turns with no known end")) if count]
    return f" ({', '.join(parts)} not counted)" if parts else ""


def local_time(ts) -> str:
    """2026-12-03 10:02:03.123 CET: local time with its zone, as `date` shows it (history's
    table, timeline and --since all speak local time)."""
    import time

    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        return "?"
    try:
        moment = time.localtime(ts)
    except (OverflowError, OSError, ValueError):
        return "?"
    return (time.strftime("%Y-%m-%d %H:%M:%S", moment) + f".{int(ts % 1 * 1000):03d} "
            + time.strftime("%Z", moment))


def config(data: dict, as_json: bool) -> None:
    for note in data["ignored"]:
        warn(note)
    if as_json:
        return emit_json(data)
    for key, row in data["settings"].items():
        value = json.dumps(row["value"]) if not isinstance(row["value"], str) else row["value"]
        sys.stdout.write(f"{key:<18} {sanitize(value, 200):<40} # {sanitize(row['source'], 200)}\n")
