"""The stop points (lanelock/turn/stops.py): LANELOCK_DEBUG_PAUSE=STEP stops a process taking an
API turn at that named step, the lane as the step's doc says, and the turn goes on when continued.
The steps are the documented ones (README, man page)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from support.processes import wait_stopped
from lanelock.turn import stops

ROOT = Path(__file__).resolve().parent.parent

TURN = """
from lanelock import Gate
with Gate("127.0.0.1:8080").turn(session="stopped") as turn:
    print(turn.state, flush=True)
"""


def test_the_stop_points_are_the_documented_steps():
    assert stops.STEPS == ("before-acquire", "after-acquire", "during-release")
    readme = (ROOT / "docs" / "running.md").read_text()
    man = (ROOT / "man" / "lanelock.1").read_text()
    for step in stops.STEPS:
        assert f"`{step}`" in readme, step
        assert step.replace("-", "\\-") in man, step


def events(lanelock, pid: int) -> list[str]:
    done = lanelock("history", "--json")
    return [event["event"] for event in json.loads(done.stdout)["events"]
            if event.get("pid") == pid]


@pytest.mark.parametrize("step", stops.STEPS)
def test_an_api_turn_stops_at_each_step_and_goes_on(step, lanelock, procs):
    lanelock("run", "--", "true")   # the lane's files exist: history and probe read them
    proc = procs.start([sys.executable, "-c", TURN], stdout=subprocess.PIPE, text=True,
                       env=dict(os.environ, **{stops.VARIABLE: step}))
    wait_stopped(proc.pid)
    probe = json.loads(lanelock("probe", "--json").stdout)["state"]
    # before-acquire: the lock opened, not tried; after it, held until the release ends.
    assert probe == ("free" if step == stops.BEFORE_ACQUIRE else "busy"), step
    seen = events(lanelock, proc.pid)
    if step == stops.DURING_RELEASE:   # the release is recorded, the lock still held
        assert seen == ["acquired", "released"], seen
    else:   # no holder record, no journal yet
        assert seen == [], seen
    os.kill(proc.pid, signal.SIGCONT)
    assert proc.stdout.readline().strip() == "held"
    assert proc.wait() == 0
    assert json.loads(lanelock("probe", "--json").stdout)["state"] == "free"
