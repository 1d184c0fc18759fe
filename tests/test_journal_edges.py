"""The journal keeps every turn: a line is written whole or not at all (a full disk's short write
never leaves half a line for the next turn's to glue to), a reader resynchronises after a torn
line, long values are cut field by field (never the JSON text), every field is made printable
where it is shown, and JSON output is valid UTF-8 for strict parsers.

Real turns on a real (full) tmpfs; the forged journals are files a hostile user could write.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import LANE, LANELOCK, STEM, TIMEOUT, environ

PAGE = 4096


def raw(procs, *args, env=None) -> subprocess.CompletedProcess:
    """`lanelock ARGS` with its output as bytes (what a terminal or a strict parser receives)."""
    proc = procs.start([*LANELOCK, *args], env=environ(env), stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE)
    out, err = proc.communicate(timeout=TIMEOUT)
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def history_json(lanelock) -> dict:
    done = lanelock("history", "--json")
    assert done.returncode == 0 and "Traceback" not in done.stderr, done
    return json.loads(done.stdout)


def local_turns_counted(lanelock) -> float:
    """What `metrics` says of the lane's local turns (its counts file, not the journal)."""
    done = lanelock("metrics")
    assert done.returncode == 0, done
    found = re.search(rf'^lanelock_turns_total{{lane="{re.escape(LANE)}",outcome="local"}} (\S+)$',
                      done.stdout, re.M)
    assert found, done.stdout
    return float(found.group(1))


def fill(mount: Path) -> Path:
    """Use up every free page of the tmpfs (dd stops at ENOSPC)."""
    filler = mount / "filler"
    subprocess.run(["dd", "if=/dev/zero", f"of={filler}", "bs=4k"], capture_output=True,
                   timeout=60)
    assert os.statvfs(mount).f_bavail == 0
    return filler


def leave_room(journal: Path, room: int) -> None:
    """Pad the journal with a blank line (readers skip those) so that its last page has exactly
    `room` bytes free: the next line longer than that is cut short once the disk is full."""
    pad = (PAGE - room - journal.stat().st_size) % PAGE or PAGE
    with open(journal, "ab") as handle:
        handle.write(b" " * (pad - 1) + b"\n")
    assert journal.stat().st_size % PAGE == PAGE - room


def every_line_parses(journal: Path) -> list[dict]:
    raw = journal.read_bytes()
    assert raw.endswith(b"\n"), raw[-200:]
    return [json.loads(line) for line in raw.split(b"\n") if line.strip()]


# -- written whole or not at all ----------------------------------------------------------------
def test_a_line_cut_by_a_full_disk_leaves_no_half_line_for_the_next_turn(lanelock, holder, tmpfs,
                                                                         monkeypatch):
    """The holder's `released` line is cut at 40 bytes by a full tmpfs; space is freed; the next
    turn's lines are read whole, and history counts what metrics counts. It used to glue the
    next turn's `acquired` to the torn 40 bytes: both lost, history said 2 turns, metrics 3."""
    mount = tmpfs("size=256k")
    monkeypatch.setenv("LANELOCK_DIR", str(mount / "lanes"))
    assert lanelock("run", "--", "true").returncode == 0
    journal = mount / "lanes" / f"{STEM}.journal"
    held = holder()
    leave_room(journal, 40)
    filler = fill(mount)
    assert held.release() == 0
    assert "journal not written" in held.stderr(), held.stderr()
    filler.unlink()
    after = lanelock("run", "--", "true")
    assert after.returncode == 0 and after.stderr == "", after

    lines = every_line_parses(journal)   # the torn 40 bytes are not left as half a line
    assert [line["event"] for line in lines if line["pid"] == after.pid] == ["acquired", "released"]
    data = history_json(lanelock)
    assert data["unreadable_lines"] == 0
    mine = [event for event in data["events"] if event["pid"] == after.pid]
    assert [event["event"] for event in mine] == ["acquired", "released"]
    assert mine[0]["ended"] == "released"
    assert data["summary"]["local"] == 3 == local_turns_counted(lanelock)


def test_an_acquired_line_cut_by_a_full_disk_is_written_with_the_release(lanelock, holder, tmpfs,
                                                                        monkeypatch):
    """The disk is full when the holder takes the lane; space comes back before it lets go: its
    `acquired` event goes with its `released` one, so history has the whole turn."""
    mount = tmpfs("size=256k")
    monkeypatch.setenv("LANELOCK_DIR", str(mount / "lanes"))
    assert lanelock("run", "--", "true").returncode == 0
    journal = mount / "lanes" / f"{STEM}.journal"
    leave_room(journal, 40)
    filler = fill(mount)
    held = holder()
    filler.unlink()
    assert held.release() == 0
    assert "journal not written" in held.stderr(), held.stderr()
    every_line_parses(journal)
    data = history_json(lanelock)
    mine = [event for event in data["events"] if event["pid"] == held.pid]
    assert [event["event"] for event in mine] == ["acquired", "released"], data["events"]
    assert mine[0]["ended"] == "released"
    assert data["summary"]["local"] == 2 == local_turns_counted(lanelock)


def test_a_reader_resynchronises_after_a_torn_line(lanelock, lock_dir):
    """A torn line a killed writer left (no newline) with another process's line glued to it:
    the torn part is one unreadable line, the line after it is read."""
    assert lanelock("run", "--", "true").returncode == 0
    journal = lock_dir / f"{STEM}.journal"
    whole = journal.read_bytes().splitlines()
    with open(journal, "ab") as handle:
        handle.write(whole[0][:37] + whole[1] + b"\n" + whole[0][:55])   # torn, glued, torn
    data = history_json(lanelock)
    assert [event["event"] for event in data["events"]] == ["acquired", "released", "released"]
    assert data["unreadable_lines"] == 2
    assert lanelock("run", "--", "true").returncode == 0   # glued to the torn tail: read
    data = history_json(lanelock)
    assert [event["event"] for event in data["events"]][-2:] == ["acquired", "released"]
    assert data["unreadable_lines"] == 2


# -- long values ----------------------------------------------------------------------------------
def test_a_long_cjk_label_is_cut_field_by_field_and_the_turn_kept(lanelock, lock_dir):
    """3,000 CJK characters (18 KiB as JSON escapes) as the session: both of the turn's lines are
    read, the session cut, and history counts what metrics counts (it said 2 turns, metrics 3)."""
    label = "語" * 3000
    assert lanelock("run", "--session", label, "--", "true").returncode == 0
    assert lanelock("run", "--", "true").returncode == 0
    assert lanelock("run", "--session", label, "--model", "模" * 3000, "--", "true").returncode == 0
    lines = every_line_parses(lock_dir / f"{STEM}.journal")
    assert len(lines) == 6
    assert max(len(line) for line in (lock_dir / f"{STEM}.journal").read_bytes().split(b"\n")) \
        < 16 * 1024
    data = history_json(lanelock)
    assert data["unreadable_lines"] == 0
    assert data["summary"]["local"] == 3 == local_turns_counted(lanelock)
    first = data["events"][0]
    assert first["session"].startswith("語" * 100) and first["session"].endswith("…")
    assert first["cut"] == ["session"]
    assert data["events"][4]["model"].startswith("模" * 100)
