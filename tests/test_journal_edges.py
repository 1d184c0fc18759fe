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

from support.cli import LANE, LANELOCK, STEM, TIMEOUT, environ, history_json

PAGE = 4096


def raw(procs, *args, env=None) -> subprocess.CompletedProcess:
    """`lanelock ARGS` with its output as bytes (what a terminal or a strict parser receives)."""
    proc = procs.start([*LANELOCK, *args], env=environ(env), stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE)
    out, err = proc.communicate(timeout=TIMEOUT)
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


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


# -- what reaches the terminal --------------------------------------------------------------------
ESC_PAYLOAD = "\x1b]0;owned\x07\x1b[2J\x9b31m\x1bP+q\x1b\\"
FIELDS = ("event", "time", "lane", "pid", "session", "model", "turn", "reason", "outcome",
          "priority", "ended", "exit_status", "duration", "waited", "wait", "witness", "engine",
          "tokens", "slots", "turns", "via", "client", "of")


def forged_journal(lock_dir: Path, now: float) -> None:
    """Lines with ESC/OSC/C1 in every field a journal line can carry, of every kind of event."""
    lock_dir.mkdir(exist_ok=True)
    bad = ESC_PAYLOAD
    lines = []
    for kind in ("acquired", "released", "deflected", "waited", "fail-open", "abandoned",
                 "unseen", "settled", bad):
        event = {name: bad for name in FIELDS}
        event.update(event=kind, ts=now - 30, monotonic=1.0,
                     holder={"pid": bad, "session": bad, "model": bad, "command": bad,
                             "host": bad, "note": bad, "lanelock": True, "held_for": bad})
        lines.append(event)
    lines.append({"event": "acquired", "ts": now - 20, "pid": 4242, "session": bad,
                  "model": bad, "priority": "normal"})
    (lock_dir / f"{STEM}.journal").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (lock_dir / f"{STEM}.lock").touch()


def assert_no_forged_bytes(output: bytes, ours=rb"\x1b\[[0-9;]*m") -> None:
    """No ESC, BEL or C1 byte the journal brought: only rich's own style codes (SGR), if any."""
    rest = re.sub(ours, b"", output)
    for byte in (b"\x1b", b"\x07", b"\xc2\x9b", b"\x9b"):
        assert byte not in rest, (byte, rest[max(0, rest.find(byte) - 80):rest.find(byte) + 80])


def test_esc_in_every_journal_field_never_reaches_the_terminal_piped(procs, lock_dir):
    import time

    forged_journal(lock_dir, time.time())
    for args in (("history",), ("status",), ("status", "--all")):
        done = raw(procs, *args, env={"NO_COLOR": "1"})
        assert done.returncode in (0, 69), done
        assert b"Traceback" not in done.stderr
        assert_no_forged_bytes(done.stdout + done.stderr)


def test_esc_in_every_journal_field_never_reaches_the_terminal_on_a_tty(lanelock, lock_dir, procs):
    """The rich views (history's table and timeline, status's table) on a terminal."""
    import time

    pexpect = pytest.importorskip("pexpect")
    forged_journal(lock_dir, time.time())
    for args, env in ((["history"], {"NO_COLOR": "1"}), (["history"], {}),
                      (["status"], {"NO_COLOR": "1"}), (["status"], {"COLUMNS": "60"})):
        merged = {**os.environ, "TERM": "xterm", "COLUMNS": "200", "LINES": "40", **env}
        child = pexpect.spawn(sys.executable, ["-m", "lanelock", *args], env=merged, timeout=30,
                              dimensions=(40, int(merged["COLUMNS"])))
        procs.spawns.append(child)
        child.expect(pexpect.EOF)
        child.close()
        output = child.before
        assert b"Traceback" not in output, output
        assert child.exitstatus in (0, 69), output
        if args == ["history"]:
            assert "per minute".encode() in output, output   # the timeline was drawn
        assert_no_forged_bytes(output)


# -- JSON for strict parsers --------------------------------------------------------------------------
def strict(raw: bytes):
    """Parse as a strict parser would: UTF-8 without errors, and no lone surrogate in any string
    (Python's json accepts "\\udcff"; Go's, Rust's serde_json and jq do not)."""
    data = json.loads(raw.decode("utf-8"))

    def walk(value):
        if isinstance(value, str):
            value.encode("utf-8")   # UnicodeEncodeError on a lone surrogate
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(key)
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)

    walk(data)
    return data


def test_json_output_is_valid_utf8_for_strict_parsers(procs, lock_dir, holder):
    """A session given as undecodable bytes (the holder record and the journal keep it as a lone
    surrogate), and forged journal lines holding lone surrogates, \\u escapes and raw bytes."""
    held = holder("--session", os.fsdecode(b"bad\xff\xfe"), "--model", os.fsdecode(b"m\xc3"))
    with open(lock_dir / f"{STEM}.journal", "ab") as handle:
        handle.write(b'{"event": "deflected", "ts": 1.5e9, "pid": 7, "session": "\\ud800x\\udcff",'
                     b' "reason": "\\udfff", "\\udc80key": 1}\n')
        handle.write(b'{"event": "deflected", "ts": 1.5e9, "pid": 8, "session": "raw\xff"}\n')
    for args in (("history", "--json"), ("status", "--json"), ("status", "--all", "--json")):
        done = raw(procs, *args)
        assert done.returncode == 0, done
        data = strict(done.stdout)
        assert data
    history = strict(raw(procs, "history", "--json").stdout)
    sessions = [event.get("session") for event in history["events"]]
    assert "bad\ufffd\ufffd" in sessions and "\ufffdx\ufffd" in sessions, sessions
    status = strict(raw(procs, "status", "--json").stdout)
    assert status["lanes"][0]["holder"]["session"] == "bad\ufffd\ufffd"
    assert held.release() == 0
    # the plain views print them too, without an error
    for args in (("history",), ("status",)):
        done = raw(procs, *args)
        assert done.returncode == 0 and b"Traceback" not in done.stderr, done
        done.stdout.decode("utf-8")


def test_the_proxys_status_json_is_valid_utf8_for_strict_parsers(procs, holder):
    """GET /lanelock/status of a lane whose holder's session is undecodable bytes."""
    from support.proxy import Proxy, request

    held = holder("-b", "127.0.0.1:9", "--session", os.fsdecode(b"bad\xff\xfe"))
    proxy = Proxy(procs, "127.0.0.1:9")
    status, _, body = request(proxy.port, "GET", "/lanelock/status")
    assert status == 200, body
    data = strict(body)
    assert data["lanes"][0]["holder"]["session"] == "bad\ufffd\ufffd"
    assert proxy.stop() == 0
    assert held.release() == 0


def test_metrics_print_no_escape_from_a_forged_counts_file_or_lane_name(procs, lock_dir):
    """The counts file is everyone's to write (0666) and a lock file anyone's to name: a
    deflection reason or a lane name holding ESC/OSC must not reach `lanelock metrics`' reader."""
    lock_dir.mkdir()
    (lock_dir / f"{STEM}.lock").touch()
    (lock_dir / f"{STEM}.counts").write_text(json.dumps({
        "schema": 1, "turns": {"local": 1}, "deflections": {ESC_PAYLOAD: 3, "local_backend_busy": 2}}))
    (lock_dir / f"{ESC_PAYLOAD}-8080.lock").touch()
    for args in (("metrics",), ("metrics", "--all")):
        done = raw(procs, *args)
        assert done.returncode == 0 and b"Traceback" not in done.stderr, done
        assert_no_forged_bytes(done.stdout + done.stderr, ours=rb"^$")
        assert b'reason="local_backend_busy"} 2.0' in done.stdout
