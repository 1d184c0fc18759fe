"""`lanelock history`: the per-lane journal, from real turns: concurrent appends that never tear or
lose a line, the way back to local, --since, the summary, garbage lines and rotation.

Synchronisation is never a sleep: a holder's child prints "ready PID" on a pipe and holds until the
test writes its exit status to its stdin.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from support.cli import LANE, LANELOCK, STEM, TIMELINE, TIMEOUT, history_json
from support.processes import ExitWatch, wait_for
from lanelock import locks

BUSY = 75


def journal(lock_dir: Path) -> Path:
    return lock_dir / f"{STEM}.journal"


def journal_lines(path: Path) -> list[dict]:
    """Every line of one journal file, each parsed (a torn or merged line fails here)."""
    if not path.exists():
        return []
    raw = path.read_bytes()
    assert raw == b"" or raw.endswith(b"\n"), "the journal ends in a partial line"
    return [json.loads(line) for line in raw.decode("utf-8").split("\n")[:-1]]


def turn(lanelock, *command: str, expect: int = 0) -> subprocess.CompletedProcess:
    done = lanelock("run", "--", *(command or ("true",)))
    assert done.returncode == expect, done.stderr
    return done


# -- concurrent appends ------------------------------------------------------------------------------
@pytest.mark.parametrize("processes, turns", [
    (4, 10),                                              # 40 turns: the default tier
    pytest.param(8, 25, marks=pytest.mark.slow),          # 200 turns: ~30 s on two busy cores
    pytest.param(8, 50, marks=pytest.mark.slow),          # the 400: ~65 s there
])
def test_concurrent_turns_leave_exactly_the_right_journal_lines(lanelock, procs, lock_dir, tmp_path,
                                                                processes, turns):
    loop = 'read go; for i in $(seq "$1"); do "$0" -m lanelock run -- true; echo "rc $?"; done'
    shells = [procs.start(["sh", "-c", loop, sys.executable, turns], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, stderr=open(tmp_path / f"loop-{n}.stderr", "wb"))
              for n in range(processes)]
    for shell in shells:            # start line: all loops begin together
        shell.stdin.close()
        shell.stdin = None
    codes = []
    for shell in shells:
        out, _ = shell.communicate(timeout=240)
        assert shell.returncode == 0
        codes += out.decode().split()[1::2]
    total = processes * turns
    assert len(codes) == total
    assert set(codes) <= {"0", str(BUSY)}, sorted(set(codes))

    events = journal_lines(journal(lock_dir))             # every line parses as JSON
    assert not Path(f"{journal(lock_dir)}.1").exists()    # far below the rotation size
    kinds = [event["event"] for event in events]
    acquired, deflected, released = (kinds.count(kind) for kind in ("acquired", "deflected", "released"))
    assert acquired + deflected == total
    assert released == acquired
    assert len(events) == 2 * acquired + deflected    # nothing else was written, nothing lost
    assert acquired == codes.count("0") and deflected == codes.count(str(BUSY))
    by_pid: dict[int, list[str]] = {}
    for event in events:
        by_pid.setdefault(event["pid"], []).append(event["event"])
    for pid, sequence in by_pid.items():              # each turn: acquired then released, or deflected
        local = [kind for kind in sequence if kind != "deflected"]
        assert local == ["acquired", "released"] * (len(local) // 2), (pid, sequence)

    summary = history_json(lanelock)["summary"]
    # no fallback: every turn sent away was busy (nothing ran), as the metrics count it
    assert (summary["turns"], summary["local"], summary["busy"], summary["deflected"]) == \
        (total, acquired, deflected, 0)


# -- the way back ------------------------------------------------------------------------------------
def test_a_deflection_then_a_local_turn_is_the_way_back(lanelock, holder, lock_dir):
    held = holder("--session", "holder")
    deflected = lanelock("run", "--session", "cron", "--", "true")
    assert deflected.returncode == BUSY and "local_backend_busy" in deflected.stderr
    assert held.release() == 0
    for _ in range(2):   # the cron session's way back; a second local turn in a row is not another
        assert lanelock("run", "--session", "cron", "--", "true").returncode == 0

    data = history_json(lanelock)
    assert [e["event"] for e in data["events"]] == [
        "acquired", "deflected", "released", "acquired", "released", "acquired", "released"]
    assert [e["way_back"] for e in data["events"] if e["event"] == "acquired"] == [False, True, False]
    deflection = data["events"][1]
    assert deflection["reason"] == "local_backend_busy" and deflection["holder"]["pid"] == held.pid
    assert data["summary"]["way_back"] == 1 and data["summary"]["busy"] == 1   # no fallback ran
    assert data["lane"] == LANE and data["unreadable_lines"] == 0

    done = lanelock("history")
    assert done.returncode == 0 and "\x1b" not in done.stdout
    lines = done.stdout.splitlines()
    assert sum("back on local" in line for line in lines) == 1
    deflection_lines = [line for line in lines if line.split()[3:4] == ["busy"]]
    assert len(deflection_lines) == 1 and f"held by pid {held.pid}" in deflection_lines[0]
    assert "way back to local 1x" in lines[-1]


def test_a_waiting_turn_logs_how_long_it_waited(lanelock, holder, procs, lock_dir):
    held = holder()
    waiter = procs.start([*LANELOCK, "run", "--wait", "--", "true"], stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE)
    lock = lock_dir / f"{STEM}.lock"
    wait_for(lambda: waiter.pid in locks.kernel_view(os.stat(lock)).waiters,
             "the --wait turn to block in flock()")
    assert held.release() == 0
    _, err = waiter.communicate(timeout=TIMEOUT)
    assert waiter.returncode == 0, err

    data = history_json(lanelock)
    mine = [e for e in data["events"] if e["pid"] == waiter.pid]
    assert [e["event"] for e in mine] == ["waited", "acquired", "released"]
    assert mine[0]["waited"] > 0
    assert mine[1]["way_back"] is False   # waiting is not a deflection
    summary = data["summary"]
    assert (summary["turns"], summary["local"], summary["deflected"], summary["way_back"]) == (2, 2, 0, 0)
    done = lanelock("history")
    assert done.returncode == 0
    assert any(line.split()[3:4] == ["waited"] and "waited " in line for line in done.stdout.splitlines())


# -- --since -----------------------------------------------------------------------------------------
def _age(events: list[dict], hours: float) -> list[dict]:
    old = []
    for event in events:
        moment = event["ts"] - hours * 3600
        stamp = datetime.fromtimestamp(moment, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.000Z")
        old.append({**event, "ts": moment, "time": stamp})
    return old


def _iso(hours_ago: float, offset_hours: int = 0) -> str:
    zone = timezone(timedelta(hours=offset_hours))
    return (datetime.now(timezone.utc) - timedelta(hours=hours_ago)).astimezone(zone).isoformat()


def test_since_takes_durations_and_iso_dates(lanelock, lock_dir):
    turn(lanelock)
    recent = journal_lines(journal(lock_dir))
    old = _age(recent, 3)                        # the same turn, three hours earlier
    journal(lock_dir).write_text("".join(json.dumps(e) + "\n" for e in old + recent))

    def count(*since):
        return len(history_json(lanelock, *since)["events"])

    assert count() == 4
    assert count("--since", "1h") == 2 == count("--since", "90m") == count("--since", "3600s")
    assert count("--since", "4h") == 4 == count("--since", "1d") == count("--since", "1w")
    assert count("--since", _iso(2)) == 2                        # offset-aware, UTC
    assert count("--since", _iso(2, offset_hours=5)) == 2        # the same instant, another zone
    assert count("--since", _iso(4, offset_hours=-7)) == 4
    assert count("--since", "2000-01-01") == 4                   # a plain date
    assert count("--since", (datetime.now(timezone.utc) + timedelta(days=2)).date().isoformat()) == 0
    assert history_json(lanelock, "--since", "1h")["summary"]["turns"] == 1


def test_since_reads_the_journals_end_and_finds_every_event_of_the_span(lanelock, lock_dir):
    """`status` asks for the last hour's holds every half second under --watch: the journal's
    end is read back to a line older than the span (a minute's slack for appends that land out
    of time order), not its 2 MiB of days. The older generation (.1), here all garbage, is read
    only when the span reaches into it."""
    turn(lanelock)
    recent = journal_lines(journal(lock_dir))
    days = [event for hours in range(48, 2, -1) for event in _age(recent, hours + 0.5)
            for _ in range(40)]                               # ~1 MiB of two days' turns
    late = _age(recent[:1], 59 / 60) + _age(recent[:1], 1 + 30 / 3600)   # in the span, then
    span = _age(recent, 0.5) + _age(recent, 0.25)                     # 30 s before it
    lines = days + late + span + recent
    journal(lock_dir).write_text("".join(json.dumps(event) + "\n" for event in lines))
    Path(f"{journal(lock_dir)}.1").write_bytes(b"".join(line + b"\n" for line in GARBAGE))

    data = history_json(lanelock, "--since", "1h")
    assert [event["ts"] for event in data["events"]] == \
        sorted(event["ts"] for event in late[:1] + span + recent)   # history: in time order
    assert data["unreadable_lines"] == 0                      # .1 was not read
    whole = history_json(lanelock, "--since", "3d")
    assert len(whole["events"]) == len(lines) and whole["unreadable_lines"] == len(GARBAGE)


@pytest.mark.parametrize("since", ["yesterdayish", "2 hours", "1y", "1e3h", "2026-13-45", "h"])
def test_since_garbage_is_a_usage_error_in_one_line(lanelock, lock_dir, since):
    turn(lanelock)
    done = lanelock("history", "--since", since)
    assert done.returncode == 2 and done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("lanelock:") and "--since" in lines[0], done.stderr


# -- the summary -------------------------------------------------------------------------------------
def test_summary_fields_match_the_journal(lanelock, holder, lock_dir):
    held = holder()
    assert lanelock("run", "--", "true").returncode == BUSY
    assert held.release(0) == 0
    turn(lanelock, "sh", "-c", "exit 4", expect=4)

    lines = journal_lines(journal(lock_dir))
    durations = [e["duration"] for e in lines if e["event"] == "released"]
    window = lines[-1]["ts"] - lines[0]["ts"]
    summary = history_json(lanelock)["summary"]
    assert (summary["turns"], summary["local"], summary["deflected"], summary["busy"],
            summary["fail_open"]) == (3, 2, 0, 1, 0)
    assert summary["busy_rate"] == pytest.approx(1 / 3, abs=1e-4)
    assert summary["deflection_rate"] == 0
    assert summary["longest_hold"] == pytest.approx(max(durations), abs=1e-3)
    assert summary["busy_fraction"] == pytest.approx(min(1.0, sum(durations) / window), abs=2e-3)
    assert 0 < summary["busy_fraction"] <= 1
    assert summary["first"] == lines[0]["time"] and summary["last"] == lines[-1]["time"]
    assert [e["exit_status"] for e in lines if e["event"] == "released"] == [0, 4]

    done = lanelock("history")
    assert done.returncode == 0
    last = done.stdout.splitlines()[-1]
    assert last.startswith("turns 3 (2 local, 0 deflected, 1 busy); deflection rate 0% (a fallback "
                           "ran); busy rate 33% (nothing ran); lane held ")
    assert f"longest hold {summary['longest_hold']:.1f}s" in last


def test_history_of_a_lane_without_a_journal(lanelock, lock_dir):
    data = history_json(lanelock)
    assert data["events"] == [] and data["unreadable_lines"] == 0
    assert (data["summary"]["turns"], data["summary"]["busy_fraction"]) == (0, 0.0)
    done = lanelock("history")
    assert done.returncode == 0 and done.stdout.startswith("turns 0 ")
    assert not lock_dir.exists()   # reading creates nothing


def test_a_fail_open_turn_is_in_the_journal(lanelock, lock_dir, tmp_path):
    turn(lanelock)
    lock = lock_dir / f"{STEM}.lock"
    lock.unlink()
    lock.symlink_to(tmp_path / "elsewhere.lock")
    done = turn(lanelock)
    assert "running without it" in done.stderr
    assert [e["event"] for e in journal_lines(journal(lock_dir))][-1] == "fail-open"
    assert history_json(lanelock)["summary"]["fail_open"] == 1


# -- garbage and rotation ----------------------------------------------------------------------------
def _noise(seed: int) -> bytes:
    data = bytes(b for b in random.Random(seed).randbytes(600) if b not in b"\r\n")
    return data if data.strip() else b"x"


GARBAGE = [
    b"not json at all",
    _noise(1),
    _noise(2),
    b'{"event": "acquired", "ts": 17\xff\xfe',
    b"\xff\xfe\xfd",
    b"[1, 2, 3]",
    b'"a string"',
    b"null",
    b'{"event": 5, "ts": 1}',
    b'{"no_event": true}',
    b'{"event": "acquired", "ts": ',            # a torn line
    b"[" * 100000,
    b'{"event": "acquired", "ts": ' + b"9" * 5000 + b"}",
]


def test_garbage_lines_are_counted_and_skipped(lanelock, lock_dir):
    turn(lanelock)
    with open(journal(lock_dir), "ab") as handle:
        handle.write(b"".join(line + b"\n" for line in GARBAGE) + b"   \n\n")
    turn(lanelock)

    data = history_json(lanelock)
    assert data["unreadable_lines"] == len(GARBAGE)
    assert [e["event"] for e in data["events"]] == ["acquired", "released"] * 2
    assert data["summary"]["turns"] == 2

    done = lanelock("history")
    assert done.returncode == 0 and "Traceback" not in done.stderr
    assert f"{len(GARBAGE)} journal line(s) could not be read" in done.stderr
    assert done.stdout.splitlines()[-1].startswith("turns 2 (2 local, 0 deflected, 0 busy)")


MALFORMED = {
    "no-time": {"event": "acquired", "ts": 1.0},
    "list-pid": {"event": "acquired", "pid": [1], "time": "2026-01-01T00:00:00.000Z"},
    "dict-pid-release": {"event": "released", "pid": {"a": 1}, "time": "2026-01-01T00:00:00.000Z"},
}
MALFORMED_BUGS = {  # each once crashed history (fixed); kept as regressions
    "no-time": "BUG: history.summarise reads events[0]['time'] / events[-1]['time'] with [] : a "
               "journal object with an event and a ts but no time crashes history (KeyError, exit 70)",
    "list-pid": "BUG: history.holds keys open turns by event['pid']: an unhashable pid (a list) "
                "crashes history (TypeError, exit 70)",
    "dict-pid-release": "BUG: history.holds tests `pid in open_turns` with an unhashable pid (a "
                        "dict) on a released event: TypeError, exit 70",
}


@pytest.mark.parametrize("name", list(MALFORMED_BUGS))
@pytest.mark.parametrize("as_json", [True, False], ids=["json", "human"])
def test_parseable_but_malformed_events_do_not_crash_history(lanelock, lock_dir, name, as_json):
    turn(lanelock)
    real = journal_lines(journal(lock_dir))
    event = dict(MALFORMED[name])
    event.setdefault("ts", real[0]["ts"] - 1)
    with open(journal(lock_dir), "a") as handle:
        handle.write(json.dumps(event) + "\n")
    done = lanelock("history", *(["--json"] if as_json else []))
    assert done.returncode == 0, done.stderr
    assert "internal error" not in done.stderr


def _journal_fifo(path: Path, tmp_path: Path) -> None:
    os.mkfifo(path)


def _journal_symlink(path: Path, tmp_path: Path) -> None:
    target = tmp_path / "elsewhere.journal"
    target.write_text('{"event": "acquired", "ts": 1.0, "time": "x"}\n')
    path.symlink_to(target)


def _journal_sparse(path: Path, tmp_path: Path) -> None:
    with open(path, "wb") as handle:
        handle.truncate(50 * 1024 * 1024)


def _journal_directory(path: Path, tmp_path: Path) -> None:
    path.mkdir()


@pytest.mark.parametrize("plant", [_journal_fifo, _journal_symlink, _journal_directory, _journal_sparse],
                         ids=["fifo", "symlink", "directory", "50-megabytes-of-nul"])
@pytest.mark.parametrize("generation", ["", ".1"], ids=["journal", "journal.1"])
def test_a_hostile_journal_file_never_hangs_or_crashes_history(lanelock, lock_dir, tmp_path, plant,
                                                             generation):
    lock_dir.mkdir()
    path = Path(f"{journal(lock_dir)}{generation}")
    plant(path, tmp_path)
    for args in (["--json"], []):
        done = lanelock("history", *args, timeout=30)   # a FIFO must not block the read
        assert done.returncode == 0, done.stderr
        assert "Traceback" not in done.stderr and "internal error" not in done.stderr
        if args:
            assert json.loads(done.stdout)["summary"]["turns"] == 0


def test_rotation_keeps_every_line_across_both_files(lanelock, lock_dir, tmp_path, monkeypatch):
    config = tmp_path / "system.toml"
    config.write_text("journal_max_bytes = 4096\n")
    monkeypatch.setenv("LANELOCK_SYSTEM_CONFIG", str(config))
    rotated = Path(f"{journal(lock_dir)}.1")
    turns = 0
    while not rotated.exists():
        assert turns < 40, "the journal never rotated past 4096 bytes"
        turn(lanelock)
        turns += 1
    for _ in range(3):
        turn(lanelock)
        turns += 1

    older, newer = journal_lines(rotated), journal_lines(journal(lock_dir))
    assert rotated.stat().st_size >= 4096
    assert not Path(f"{journal(lock_dir)}.2").exists()
    assert len(older) + len(newer) == 2 * turns
    assert newer[0]["event"] == "acquired" and older[-1]["event"] == "released"
    events = older + newer
    assert [e["event"] for e in events] == ["acquired", "released"] * turns
    assert [e["monotonic"] for e in events] == sorted(e["monotonic"] for e in events)

    data = history_json(lanelock)
    assert len(data["events"]) == 2 * turns and data["unreadable_lines"] == 0
    assert data["summary"]["turns"] == turns == data["summary"]["local"]


# -- a killed turn is not a long one ------------------------------------------------
def test_a_killed_turn_shows_as_died_and_is_not_the_longest_hold(lanelock, holder, lock_dir):
    """A turn kill -9'd never writes `released`: history used to stretch it to the journal's last
    event (a 1 s turn became "longest hold 10.4 s; busy 100%"). It is died, bounded by the next
    turn that took the lane, and counts in neither the longest hold nor busy."""
    killed = holder("--session", "killed")
    deaths = [ExitWatch(killed.pid), ExitWatch(killed.child_pid)]
    for pid in (killed.pid, killed.child_pid):
        os.kill(pid, signal.SIGKILL)
    for death in deaths:
        death.wait()
    assert killed.wait() == -signal.SIGKILL
    later = holder("--session", "later")   # takes the lane the kernel dropped
    assert later.release() == 0

    data = history_json(lanelock)
    died, taken, released = data["events"]
    assert [e["event"] for e in data["events"]] == ["acquired", "acquired", "released"]
    assert (died["pid"], died["ended"], died["ended_before"]) == (killed.pid, "died", taken["ts"])
    assert (taken["pid"], taken["ended"]) == (later.pid, "released")
    summary = data["summary"]
    assert (summary["local"], summary["died"], summary["holding"]) == (2, 1, 0)
    assert summary["longest_hold"] == pytest.approx(released["duration"], abs=1e-3)   # not the gap
    window = released["ts"] - died["ts"]
    assert summary["busy_fraction"] == pytest.approx(released["duration"] / window, abs=2e-3)
    assert summary["busy_fraction"] < 1

    done = lanelock("history")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    (killed_line,) = [line for line in lines if line.split()[3:7] == ["acquired", "normal", "killed", str(killed.pid)]]
    assert "died without releasing" in killed_line, killed_line
    assert f"longest hold {summary['longest_hold']:.1f}s (1 died turn not counted)" in lines[-1]


def test_a_live_turn_without_a_release_is_still_holding(lanelock, holder):
    held = holder()
    (acquired,) = history_json(lanelock)["events"]
    assert (acquired["pid"], acquired["ended"], acquired["ended_before"]) == (held.pid, "holding", None)
    shown = lanelock("history").stdout.splitlines()
    assert shown[0].split() == ["time", "event", "class", "session", "pid", "detail"]
    assert "still holding" in shown[1] and "1 still holding" in shown[-1], shown
    assert held.release() == 0
    data = history_json(lanelock)
    assert data["events"][0]["ended"] == "released" and data["summary"]["holding"] == 0


def _crafted(case: str, gone_pid: int) -> dict:
    """An `acquired` line whose holder is this test process, seen through what the line says of
    it (start time, boot, host), or a process that has ended."""
    from lanelock.facts import boot_id, hostname, own_start_ticks

    me = {"pid": os.getpid(), "start_ticks": own_start_ticks(), "boot_id": boot_id(),
          "hostname": hostname()}
    return {"running": me,
            "pid-reused": {**me, "start_ticks": own_start_ticks() + 1},
            "previous-boot": {**me, "boot_id": "00000000-0000-0000-0000-000000000000"},
            "pid-gone": {**me, "pid": gone_pid},
            "another-host": {**me, "hostname": "elsewhere.invalid"},
            "old-line-running": {"pid": os.getpid()},
            "old-line-gone": {"pid": gone_pid}}[case]


LIVENESS = {"running": "holding", "pid-reused": "died", "previous-boot": "died", "pid-gone": "died",
            "another-host": "unknown", "old-line-running": "unknown", "old-line-gone": "died"}


@pytest.mark.parametrize("case", LIVENESS, ids=list(LIVENESS))
def test_an_unreleased_turn_is_judged_by_its_holders_liveness(case, lanelock, run_cmd, lock_dir):
    turn(lanelock)
    last = journal_lines(journal(lock_dir))[-1]
    gone = run_cmd(["true"]).pid
    event = {"event": "acquired", "ts": last["ts"] + 1, "time": last["time"], "session": "x",
             **_crafted(case, gone)}
    with open(journal(lock_dir), "a") as handle:
        handle.write(json.dumps(event) + "\n")
    data = history_json(lanelock)
    assert data["events"][-1]["ended"] == LIVENESS[case]
    assert data["summary"]["died"] == (LIVENESS[case] == "died")
    assert data["summary"]["holding"] == (LIVENESS[case] == "holding")


# -- history says what the metrics say ----------------------------------------------
def plain_rows(lanelock, *args) -> list[list[str]]:
    """The plain table's rows, split in words (time is three: date, clock, zone), header and
    summary left out."""
    done = lanelock("history", *args)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split() == ["time", "event", "class", "session", "pid", "detail"], lines
    table = [line for line in lines[1:-1] if not TIMELINE.match(line) and not line.startswith(" ")]
    return [line.split() for line in table]


# A piped timeline's hour: its label, then one ASCII cell per minute (the legend is indented).
def test_history_tells_busy_from_deflected_as_the_metrics_do(lanelock, holder, lock_dir):
    """A turn sent away with nothing to run is busy, one whose fallback ran deflected, as the
    metrics count them: 100 plain 503s once read as a 97% deflection rate. A turn whose every
    fallback failed to start is busy too (a `settled` event after its deflection says so), and
    an old journal's deflection, which says neither, still reads as deflected."""
    held = holder("--session", "holder")
    assert lanelock("run", "-s", "plain", "--", "true").returncode == BUSY
    assert lanelock("run", "-s", "fell", "-f", "true", "--", "true").returncode == 0
    assert lanelock("run", "-s", "nofb", "-f", "/nonexistent/fallback", "--",
                    "true").returncode == BUSY
    assert held.release() == 0

    lines = journal_lines(journal(lock_dir))
    assert [e["event"] for e in lines].count("settled") == 1
    data = history_json(lanelock)
    sent = [(e["session"], e["outcome"]) for e in data["events"] if e["event"] == "deflected"]
    assert sent == [("plain", "busy"), ("fell", "deflected"), ("nofb", "busy")]
    assert "settled" not in [e["event"] for e in data["events"]]
    summary = data["summary"]
    assert (summary["turns"], summary["local"], summary["deflected"], summary["busy"]) == \
        (4, 1, 1, 2)
    counted = json.loads((lock_dir / f"{STEM}.counts").read_text())["turns"]   # the metrics'
    assert (counted["deflected"], counted["busy"]) == (summary["deflected"], summary["busy"])
    rows = plain_rows(lanelock)
    assert [(row[3], row[5]) for row in rows] == [("acquired", "holder"), ("busy", "plain"),
                                                  ("deflected", "fell"), ("busy", "nofb"),
                                                  ("released", "holder")]
    last = lanelock("history").stdout.splitlines()[-1]
    assert last.startswith("turns 4 (1 local, 1 deflected, 2 busy); deflection rate 25% (a "
                           "fallback ran); busy rate 50% (nothing ran); lane held "), last

    old = {key: value for key, value in lines[1].items() if key not in ("outcome", "priority")}
    with open(journal(lock_dir), "a") as handle:   # a line from before outcomes were written
        handle.write(json.dumps({**old, "ts": lines[-1]["ts"] + 1}) + "\n")
    summary = history_json(lanelock)["summary"]
    assert (summary["turns"], summary["deflected"], summary["busy"]) == (5, 2, 2)
    assert plain_rows(lanelock)[-1][3:5] == ["deflected", "-"]   # its class is not known


def test_a_timed_out_wait_is_told_from_a_deflection_and_shows_its_class(lanelock, holder):
    held = holder("--session", "holder")
    assert lanelock("run", "-s", "cron", "--wait", "200ms", "--priority", "batch", "--",
                    "true").returncode == BUSY
    assert held.release() == 0
    data = history_json(lanelock)
    (sent,) = [e for e in data["events"] if e["event"] == "deflected"]
    assert (sent["wait"], sent["priority"], sent["outcome"]) == (0.2, "batch", "busy")
    assert sent["waited"] >= 0.2 and data["summary"]["timed_out"] == 1
    rows = plain_rows(lanelock)
    assert [row[3:6] for row in rows] == [["acquired", "normal", "holder"],
                                          ["busy", "batch", "cron"],
                                          ["released", "normal", "holder"]]
    detail = " ".join(rows[1][7:])
    assert detail.startswith("timed out after waiting 0.") and "(its wait 0.2s); nothing ran" \
        in detail, detail
    assert "; 1 timed out waiting; " in lanelock("history").stdout.splitlines()[-1]


@pytest.mark.parametrize("zone, name", [("Europe/Berlin", "CET"), ("America/New_York", "EST"),
                                        ("UTC", "UTC")])
def test_status_and_history_show_one_moment_in_one_convention(lanelock, zone, name):
    """`history` printed local time while `status` printed UTC for the same release: every
    command shows a person local time with its zone (JSON keeps UTC)."""
    turn(lanelock)
    shown = lanelock("status", env={"TZ": zone}).stdout
    found = re.search(r"released cleanly at (\S+ \S+ \S+) \(exit 0", shown)
    assert found, shown
    released = [row for row in plain_rows(lanelock) if row[3] == "released"]
    done = lanelock("history", env={"TZ": zone})
    (line,) = [line for line in done.stdout.splitlines() if " released " in line]
    assert " ".join(line.split()[:3]) == found.group(1) and found.group(1).endswith(f" {name}")
    assert released   # the same event, whatever the zone of the reader
    stamp = json.loads(lanelock("status", "--json").stdout)["lanes"][0]["last"]["released_at"]
    assert stamp.endswith("Z")   # the data stays UTC
