"""What `lanelock history` tells a reader, from real turns: the timeline when piped, a minute's
cell as what most of its turns were, and "back on local after deflections" only on a session that
was itself sent away.

Synchronisation is the lane itself (the holder fixture holds until released); the one clock wait
keeps six quick turns inside one wall-clock minute, which the timeline's cells are.
"""

from __future__ import annotations

import re
import sys
import time

import pexpect

from support.cli import TIMELINE, environ, history_json
from support.processes import wait_for

BUSY = 75


def timeline(stdout: str) -> list[str]:
    """The piped timeline's hours: each its 60 cells."""
    return [line[-60:] for line in stdout.splitlines() if TIMELINE.match(line)]


def test_piped_history_draws_the_timeline_in_plain_ascii(lanelock, holder):
    held = holder("--session", "chat")
    assert lanelock("run", "--session", "cron", "--", "true").returncode == BUSY
    assert held.release() == 0

    done = lanelock("history")   # stdout is a pipe
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert done.stdout.isascii() and "\x1b" not in done.stdout   # no colour, any encoding
    hours = timeline(done.stdout)
    assert hours and all(set(cells) <= set("#~x.!") for cells in hours), done.stdout
    assert "x" in "".join(hours)   # the busy turn's minute (1 local, 1 sent away: a tie)
    legend = [line for line in done.stdout.splitlines() if "one cell per minute" in line]
    assert len(legend) == 1 and "# local" in legend[0] and "~ deflected" in legend[0]
    # README: `lanelock history | tail -3` is the last hour's bar, its legend and the summary.
    last_three = done.stdout.splitlines()[-3:]
    assert TIMELINE.match(last_three[0]) and last_three[1] == legend[0], done.stdout
    assert last_three[2].startswith("turns 2 "), done.stdout
    # The label is the hour the journal's turn began in, in local time as every time shown.
    first = history_json(lanelock)["events"][0]["ts"]
    label = time.strftime("%Y-%m-%d %H:00 %Z", time.localtime(first))
    assert any(line.startswith(label + "  ") for line in done.stdout.splitlines()), done.stdout


def _minute(ts: float) -> int:
    return int(ts // 60)


def test_a_minute_of_five_local_turns_and_one_deflection_reads_local(lanelock, holder, procs):
    # Six quick turns (~1.5 s) inside one minute: start with at least 15 s of it left.
    wait_for(lambda: time.time() % 60 < 45, "a minute with room for six turns", timeout=61)
    held = holder("--session", "chat")
    assert lanelock("run", "--session", "cron", "--", "true").returncode == BUSY
    assert held.release() == 0
    for _ in range(4):
        assert lanelock("run", "--session", "chat", "--", "true").returncode == 0

    events = history_json(lanelock)["events"]
    turns = [e for e in events if e["event"] in ("acquired", "deflected")]
    assert [e["event"] for e in turns].count("acquired") == 5 and len(turns) == 6
    released = [e for e in events if e["event"] == "released"]
    assert len({_minute(e["ts"]) for e in turns + released}) == 1, "the turns spanned two minutes"

    minute = _minute(turns[0]["ts"]) % 60
    # On a terminal (rich, NO_COLOR)...
    child = procs.spawn(pexpect.spawn(sys.executable, ["-m", "lanelock", "history"],
                                      env=environ({"NO_COLOR": "1", "COLUMNS": "240",
                                                   "LINES": "60"}), timeout=30,
                                      dimensions=(60, 240), encoding="utf-8"))
    child.expect(pexpect.EOF)
    shown = re.sub(r"\x1b\[[0-9;]*m", "", child.before)
    child.close()
    (bar,) = [line.rstrip()[-60:] for line in shown.splitlines()
              if re.match(r"^\S+ \d\d:00 \S+  [█▒x·!]{60}\s*$", line)]
    assert bar[minute] == "█" and set(bar) - {"█"} == {"·"}, shown

    # ... and piped, the same minute drawn the same way.
    done = lanelock("history")
    (hour,) = timeline(done.stdout)
    assert hour[minute] == "#", (minute, done.stdout)   # 5 local, 1 busy: local
    assert set(hour) - {"#"} == {"."}, done.stdout      # nothing else in the hour


def test_back_on_local_is_said_only_of_a_session_that_was_sent_away(lanelock, holder):
    held = holder("--session", "chat")
    assert lanelock("run", "--session", "cron", "--", "true").returncode == BUSY
    assert held.release() == 0
    # The chat session was never deflected: its next turn is no way back; cron's is.
    assert lanelock("run", "--session", "chat", "--", "true").returncode == 0
    assert lanelock("run", "--session", "cron", "--", "true").returncode == 0
    assert lanelock("run", "--session", "cron", "--", "true").returncode == 0

    data = history_json(lanelock)
    acquired = [(e["session"], e["way_back"]) for e in data["events"] if e["event"] == "acquired"]
    assert acquired == [("chat", False), ("chat", False), ("cron", True), ("cron", False)]
    assert data["summary"]["way_back"] == 1

    lines = lanelock("history").stdout.splitlines()
    (back,) = [line for line in lines if "back on local after deflections" in line]
    assert back.split()[3:6] == ["acquired", "normal", "cron"], back
    assert "way back to local 1x" in lines[-1]
