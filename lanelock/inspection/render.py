"""Human and JSON views of the same dicts. JSON keys are stable and documented in docs/json.md.

Plain text here (the run path and the small read commands must not pay for rich); the richer views
of status and history import rich lazily, only on a terminal.
"""

from __future__ import annotations

import json
import sys

from .. import say
from ..facts import shown_time
from ..priority import CLASSES
from ..holder import words as holder_words
from ..say import sanitize


def emit_json(data) -> None:
    sys.stdout.write(json.dumps(valid_text(data), indent=2, sort_keys=True) + "\n")


def valid_text(data):
    """data with every lone surrogate (an undecodable byte of an argument or a file, or a
    "\\udcff" escape in a journal line) replaced by U+FFFD: json.dumps writes one as a \\u
    escape that strict parsers (Go, serde_json, jq) reject."""
    if isinstance(data, str):
        try:
            data.encode("utf-8")
            return data
        except UnicodeEncodeError:
            return "".join("\ufffd" if "\ud800" <= ch <= "\udfff" else ch for ch in data)
    if isinstance(data, dict):
        return {valid_text(key): valid_text(value) for key, value in data.items()}
    if isinstance(data, (list, tuple)):
        return [valid_text(item) for item in data]
    return data


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


def status(results: list[dict], as_json: bool, *, notes: list[str] | None = None,
           none: str = "no lanes yet") -> None:
    """none: what to say when there are no lanes (status --all on a new root)."""
    for note in notes or []:
        warn(note)
    if as_json:
        return emit_json({"lanes": results})
    console = _console()
    if console is None:
        for result in results:
            sys.stdout.write(_status_lines(result))
        if not results:
            sys.stdout.write(none + "\n")
        return
    console.print(status_table(results, none, console.width))


def _status_lines(result: dict) -> str:
    """The lane's line, then one indented line per waiter in the queue's order."""
    count = _waiting(result)
    waiting = f" [{count} waiting]" if count else ""
    source = " (probe: /proc/locks unreadable)" if result["kernel_source"] == "probe" else ""
    engine = engine_words(result.get("engine"), quiet=True)
    engine = f"; {engine}" if engine else ""
    lines = [sanitize(f"{result['lane']}: {result['message']}{waiting}{source}{engine}", 4000)]
    lines += [f"  {sanitize(line, 600)}" for line in queue_lines(result)]
    return "".join(line + "\n" for line in lines)


def engine_words(engine: dict | None, quiet: bool = False) -> str | None:
    """'engine http://127.0.0.1:8080 (llama.cpp): 1 of 2 slots generating; unseen: ...'. quiet
    (the plain line): an engine that refuses the connection and that no witness ever watched
    is 'engine: nothing answers on HOST:PORT' -- a wrong port, or a server not started, must not
    read as a quiet lane."""
    if not engine:
        return None
    if quiet and not engine.get("witness") and not engine.get("unseen") \
            and "refused" in (engine.get("problem") or "").lower():
        return f"engine: nothing answers on {_host_port(engine.get('url'))}"
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
            text += (f", last at {shown_time(last.get('started'))} ({last.get('duration')} s, {slots} "
                     f"slot{'' if slots == 1 else 's'} generating, {turns} "
                     f"turn{'' if turns == 1 else 's'} holding)")
        return f"{now}; {text}"
    if count == 0 and witness:
        return f"{now}; unseen: none (witnessed by {witness.get('witness')} pid {witness.get('pid')})"
    return f"{now}; no witness has watched it (lanelock watch, or the proxy)"


def _host_port(url: str | None) -> str:
    from urllib.parse import urlsplit

    try:
        return urlsplit(url).netloc or str(url)
    except (TypeError, ValueError):
        return str(url)


def _waiting(result: dict) -> int:
    """Turns waiting: the queue when the store keeps one (the kernel sees only its first)."""
    return len(result.get("queue") or ()) or len(result["waiters"])


def queue_lines(result: dict) -> list[str]:
    """'1. interactive pid 42 (session chat), waited 3.1s, the lane in about 4s' -- the queue in
    order, one line per waiter."""
    from .waiters import line

    return [line(row) for row in result.get("queue") or ()]


NARROW = 80   # columns below which status stacks each lane's facts instead of a wide table


def status_table(results: list[dict], none: str = "no lanes yet", width: int = NARROW):
    """The lanes' table, then one table per queue (a row per waiter); on a terminal narrower
    than NARROW, each lane's facts stacked and one line per waiter (a wide table there cut the
    lane's name and every word to a column of letters)."""
    from rich.console import Group
    from rich.markup import escape
    from rich.table import Table

    from . import waiters

    if width < NARROW:
        return Group(*(_status_stacked(result) for result in results)) if results else escape(none)
    table = Table(show_header=True, header_style="bold", expand=False)
    # The lane's name is never cut (it is what a reader looks for): the words wrap instead.
    width = max((len(sanitize(result["lane"])) for result in results), default=4)
    table.add_column("lane", no_wrap=True, min_width=min(width, 60))
    table.add_column("state", no_wrap=True)
    table.add_column("what the kernel and the sidecar say", overflow="fold")
    table.add_column("waiting", no_wrap=True)
    for result in results:
        style = STATE_STYLE.get(result["state"], "")
        engine = engine_words(result.get("engine"))
        message = "\n".join([sanitize(result["message"], 2000)] +
                            ([sanitize(engine, 600)] if engine else []))
        table.add_row(escape(sanitize(result["lane"])),
                      f"[{style}]{result['state']}{_seats_cell(result)}[/{style}]",
                      escape(message), str(_waiting(result) or ""))
    if not results:
        table.add_row("-", "-", escape(none), "")
    queues = [waiters.table(result["lane"], result["queue"]) for result in results
              if result.get("queue")]
    return Group(table, *queues) if queues else table


def _seats_cell(result: dict) -> str:
    """' 2/2' beside the state: seats held of the lane's count, on a lane of several seats."""
    if len(result.get("by_seat") or ()) < 2:
        return ""
    return f" {result.get('held_seats', 0)}/{result.get('seats')}"


def _status_stacked(result: dict):
    """One lane on a narrow terminal: its facts one under the other, then a line per waiter."""
    from rich.markup import escape
    from rich.table import Table

    grid = Table.grid(padding=(0, 1))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column(overflow="fold")
    style = STATE_STYLE.get(result["state"], "")
    grid.add_row("lane", escape(sanitize(result["lane"])))
    grid.add_row("state", f"[{style}]{result['state']}{_seats_cell(result)}[/{style}]")
    grid.add_row("says", escape(sanitize(result["message"], 2000)))
    engine = engine_words(result.get("engine"))
    if engine:
        grid.add_row("engine", escape(sanitize(engine, 600)))
    if result.get("queue"):
        grid.add_row("waiting", str(_waiting(result)))
        for row, line in zip(result["queue"], queue_lines(result)):
            grid.add_row("", f"[yellow]{escape(line)}[/yellow]" if row.get("stopped")
                         else escape(line))
    return grid


def watch(fetch, interval: float = 0.5, *, as_json: bool = False, notes=(),
          none: str = "no lanes yet") -> None:
    """Refresh the status table until ^C (rich Live on a terminal; plain lines otherwise; with
    as_json, JSON lines: one {"time", "lanes"} object per refresh), or until nobody reads stdout
    any more (`| head -1`, `>&-`): that ends the watch quietly, as a finished command."""
    import time

    from ..guard import stdout_gone

    for note in notes:
        warn(note)
    if as_json:
        while True:
            sys.stdout.write(json.dumps(valid_text({"time": time.time(), "lanes": fetch()}),
                                        sort_keys=True) + "\n")
            sys.stdout.flush()
            if stdout_gone(interval):
                return
    console = _console()
    if console is None:
        while True:
            results = fetch()
            for result in results:
                sys.stdout.write(_status_lines(result))
            if not results:
                sys.stdout.write(none + "\n")
            sys.stdout.flush()
            if stdout_gone(interval):
                return
    from rich.live import Live

    with Live(status_table(fetch(), none, console.width), console=console,
              refresh_per_second=4) as live:
        while not stdout_gone(interval):
            live.update(status_table(fetch(), none, console.width))


CELL = {"local": ("█", "green"), "deflected": ("▒", "yellow"), "busy": ("x", "red"),
        "idle": ("·", "dim"), "unseen": ("!", "bold red")}
# The piped timeline's cells: ASCII, so a pipe into grep, a log or a mail keeps the bars whatever
# the reader's encoding (and an ASCII-only stdout never fails on them).
PLAIN_CELL = {"local": "#", "deflected": "~", "busy": "x", "idle": ".", "unseen": "!"}


HISTORY_COLUMNS = (("time", 27), ("event", 9), ("class", 11), ("session", 24), ("pid", 8),
                   ("detail", 0))


def history(data: dict, lane: str, as_json: bool, rows: list) -> None:
    from .history import describe, outcome

    if as_json:
        return emit_json({"lane": lane, **data})
    summary = data["summary"]
    console = _console()
    lines = []
    for event in data["events"]:
        # Every cell made printable: any local user can write the journal, and its fields
        # (pid and event too) must never reach the terminal as escape sequences.
        stamp = shown_time(event.get("ts"))
        who = sanitize(f"{event.get('session') or '-'}", 40)
        klass = event.get("priority") if event.get("priority") in CLASSES else "-"
        lines.append((sanitize(stamp, 40), sanitize(outcome(event), 20), klass, who,
                      sanitize(event.get("pid", "-"), 20), sanitize(describe(event), 200)))
    if console is None:
        if lines:
            lines.insert(0, tuple(name for name, _ in HISTORY_COLUMNS))
        for line in lines:
            sys.stdout.write("  ".join(f"{cell:<{width}}" for cell, (_, width) in
                                       zip(line, HISTORY_COLUMNS)).rstrip() + "\n")
        for label, cells in rows:
            sys.stdout.write(f"{sanitize(label, 40)}  {''.join(PLAIN_CELL[c] for c in cells)}\n")
        if rows:
            sys.stdout.write("           # local  ~ deflected  x busy  . idle  ! unseen (one cell "
                             "per minute: what most of its turns were)\n")
    else:
        from rich.markup import escape
        from rich.table import Table

        table = Table(show_header=True, header_style="bold")
        for column, _ in HISTORY_COLUMNS:
            table.add_column(column)
        for line in lines:
            table.add_row(*(escape(cell) for cell in line))
        console.print(table)
        for label, cells in rows:
            bar = "".join(f"[{CELL[c][1]}]{CELL[c][0]}[/{CELL[c][1]}]" for c in cells)
            console.print(f"{label}  {bar}")
        if rows:
            console.print("           █ local  ▒ deflected  x busy  · idle  ! unseen (one cell "
                          "per minute: what most of its turns were)")
    if data["unreadable_lines"]:
        warn(f"{data['unreadable_lines']} journal line(s) could not be read and were skipped")
    timed_out = summary["timed_out"]
    sys.stdout.write(
        f"turns {summary['turns']} ({summary['local']} local, {summary['deflected']} deflected, "
        f"{summary['busy']} busy"
        f"{', ' + str(summary['fail_open']) + ' fail-open' if summary['fail_open'] else ''}); "
        f"deflection rate {summary['deflection_rate'] * 100:.0f}% (a fallback ran); busy rate "
        f"{summary['busy_rate'] * 100:.0f}% (nothing ran)"
        f"{f'; {timed_out} timed out waiting' if timed_out else ''}; lane held "
        f"{summary['busy_fraction'] * 100:.0f}% of the span; longest hold "
        f"{summary['longest_hold']:.1f}s{_uncounted(summary)}"
        f"{'; ' + str(summary['holding']) + ' still holding' if summary['holding'] else ''}; "
        f"way back to local {summary['way_back']}x{_unseen(summary)}{_ungated(summary)}\n")


def _ungated(summary: dict) -> str:
    """'; UNGATED 12.3s under holders whose store session ended; 1 overlap (8.1s, 1 still
    running)' -- only when there was any."""
    if not summary.get("ungated_seconds") and not summary.get("overlaps"):
        return ""
    text = (f"; UNGATED {summary.get('ungated_seconds') or 0:.1f}s under holders whose store "
            "session ended")
    count = summary.get("overlaps") or 0
    if count:
        open_ = summary.get("overlaps_open") or 0
        text += (f"; {count} overlap{'' if count == 1 else 's'} "
                 f"({summary.get('overlap_seconds') or 0:.1f}s"
                 f"{f', {open_} still running' if open_ else ''})")
    return text


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


def config(data: dict, as_json: bool) -> None:
    for note in data["ignored"]:
        warn(note)
    if as_json:
        return emit_json(data)
    rows = [(key, sanitize(row["value"] if isinstance(row["value"], str) else
                           json.dumps(row["value"]), 200), sanitize(row["source"], 200))
            for key, row in data["settings"].items()]
    # Columns as wide as the longest key and the longest value up to 40 (a longer one pushes only
    # its own comment along).
    keys = max((len(key) for key, _, _ in rows), default=0)
    values = max((len(value) for _, value, _ in rows if len(value) <= 40), default=0)
    for key, value, source in rows:
        sys.stdout.write(f"{key:<{keys}} {value:<{values}} # {source}\n")
