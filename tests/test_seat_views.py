"""Every view speaks seats: status (plain, table, --json, --watch), probe, the deflection's words
(run, the API, the proxy's busy answer), history and metrics, on a lane of two seats held by two
real `lanelock run` turns. The count is set with `lanelock seats`, never by writing kept.json.
The seats themselves (taking, waiting, kill -9, env -i, 2 -> 1) are tests/test_seats.py's.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest

from support.cli import LANE, LANELOCK, TIMEOUT, history_json
from support.processes import read_line

# A held command that says its seat: "ready PID SEAT", then holds until told its exit status.
SEATED = ["sh", "-c", 'echo "ready $$ $LANELOCK_SEAT"; read code; exit "${code:-0}"']


def two_seats(lanelock):
    done = lanelock("seats", "-b", LANE, "2")
    assert done.returncode == 0, done.stderr


def seat_of(held) -> int:
    return int(held.ready_line.split()[2])


def both_held(lanelock, holder) -> dict:
    """{seat: the holder on it}: sessions a and b, each on its own seat of two."""
    two_seats(lanelock)
    first = holder("--session", "a", command=SEATED)
    second = holder("--session", "b", command=SEATED)
    seated = {seat_of(first): first, seat_of(second): second}
    assert set(seated) == {1, 2}
    return seated


def status_json(lanelock) -> dict:
    done = lanelock("status", "--json")
    assert done.returncode == 0 and "Traceback" not in done.stderr, done
    (lane,) = json.loads(done.stdout)["lanes"]
    return lane


def test_status_plain_and_json_name_every_holder_with_its_seat(lanelock, holder):
    seated = both_held(lanelock, holder)
    plain = lanelock("status")
    assert plain.returncode == 0, plain.stderr
    line = plain.stdout.splitlines()[0]
    assert line.startswith(f"{LANE}: 2 of 2 seats held: seat 1 held by lanelock turn "
                           f"pid {seated[1].pid} (session "), line
    assert f"; seat 2 held by lanelock turn pid {seated[2].pid} (session " in line, line

    lane = status_json(lanelock)
    assert (lane["state"], lane["verdict"], lane["seats"], lane["held_seats"]) == (
        "held", "held", 2, 2)
    assert (lane["holder"]["pid"], lane["holder"]["seat"]) == (seated[1].pid, 1)
    assert [(row["seat"], row["state"], row["holder"]["pid"], row["holder"]["seat"])
            for row in lane["by_seat"]] == [(1, "held", seated[1].pid, 1),
                                            (2, "held", seated[2].pid, 2)]
    assert sorted((process["seat"], process["pid"]) for process in lane["holders"]) == [
        (1, seated[1].pid), (2, seated[2].pid)]
    assert lane["by_seat"][1]["lock_path"].endswith("/localhost-8080.seats/2.lock")

    seated[1].release()   # one seat free: the lane is still held, by one of two
    lane = status_json(lanelock)
    assert (lane["state"], lane["held_seats"], lane["holder"]["seat"]) == ("held", 1, 2)
    assert lane["message"].startswith(f"1 of 2 seats held (1 free): seat 2 held by lanelock "
                                      f"turn pid {seated[2].pid}"), lane["message"]
    seated[2].release()
    lane = status_json(lanelock)
    assert (lane["state"], lane["verdict"], lane["held_seats"]) == ("free", "released", 0)
    assert lane["message"].startswith("free, all 2 seats: seat 1 last holder pid "), lane
    assert "; seat 2 last holder pid " in lane["message"], lane["message"]


def test_a_one_seat_lane_says_one_seat_and_nothing_more(lanelock, holder):
    held = holder()
    lane = status_json(lanelock)
    assert (lane["seats"], lane["held_seats"], lane["by_seat"]) == (1, 1, [])
    assert "seat" not in lane["holder"] and "seat" not in lane["holders"][0]
    assert lanelock("status").stdout.startswith(f"{LANE}: held by lanelock turn pid {held.pid}")
    assert held.release() == 0


def test_the_table_shows_the_seats_held_and_each_holder(lanelock, holder, procs):
    pexpect = pytest.importorskip("pexpect")
    seated = both_held(lanelock, holder)
    env = {**os.environ, "TERM": "xterm", "COLUMNS": "200", "LINES": "40", "NO_COLOR": "1"}
    child = pexpect.spawn(sys.executable, ["-m", "lanelock", "status"], env=env, timeout=20,
                          dimensions=(40, 200))
    procs.spawns.append(child)
    child.expect(pexpect.EOF)
    child.close()
    shown = re.sub(r"\x1b\[[0-9;]*m", "", child.before.decode().replace("\r", ""))
    assert child.exitstatus == 0 and "Traceback" not in shown, shown
    assert re.search(rf"{re.escape(LANE)}\s*│\s*held 2/2\s*│\s*2 of 2 seats held", shown), shown
    flat = re.sub(r"[│\s]+", " ", shown)
    for seat, held in seated.items():
        assert f"seat {seat} held by lanelock turn pid {held.pid}" in flat, shown


def test_probe_is_busy_naming_both_only_when_both_seats_are_held(lanelock, holder):
    two_seats(lanelock)
    first = holder("--session", "a", command=SEATED)
    free = lanelock("probe")
    assert (free.returncode, free.stdout) == (0, f"free: {LANE}\n"), free
    second = holder("--session", "b", command=SEATED)
    busy = lanelock("probe")
    assert busy.returncode == 1, busy
    assert re.fullmatch(rf"busy: {re.escape(LANE)} held \(2 of 2 seats: pid \d+, session \w, "
                        r"held [\d.]+s; pid \d+, session \w, held [\d.]+s\)\n", busy.stdout), busy
    assert {f"pid {first.pid}", f"pid {second.pid}"} <= set(re.findall(r"pid \d+", busy.stdout))
    assert first.release() == 0
    assert lanelock("probe").returncode == 0
    assert second.release() == 0


def test_the_third_turn_names_both_holders_and_the_journal_keeps_them(lanelock, holder):
    seated = both_held(lanelock, holder)
    third = lanelock("run", "--session", "c", "--", "echo", "ran")
    assert third.returncode == 75 and "ran" not in third.stdout
    said = re.search(r"local_backend_busy: local model in use by another session \(2 of 2 seats: "
                     r"(pid \d+), session (\w), held [\d.]+s; (pid \d+), session (\w), held "
                     r"[\d.]+s\); no fallback, exit 75", third.stderr)
    assert said, third.stderr
    assert said.group(1, 3) == (f"pid {seated[1].pid}", f"pid {seated[2].pid}")
    (deflected,) = [event for event in history_json(lanelock)["events"]
                    if event["event"] == "deflected"]
    assert deflected["holder"]["pid"] == seated[1].pid and "holders" not in deflected["holder"]
    assert [(each["seat"], each["pid"]) for each in deflected["holders"]] == [
        (1, seated[1].pid), (2, seated[2].pid)]
    assert deflected["seats"] == 2
    table = lanelock("history").stdout
    assert re.search(r"held by 2 of 2 seats: pid \d+, session \w, held [\d.]+s; pid \d+", table), \
        table
    for held in seated.values():
        assert held.release() == 0


def test_an_api_turn_deflected_names_both_holders(lanelock, holder, run_cmd):
    seated = both_held(lanelock, holder)
    script = ("from lanelock import Gate\n"
              "from lanelock.holder import words\n"
              "with Gate().turn(session='api') as turn:\n"
              "    print(turn.proceed, [h['pid'] for h in turn.holder['holders']])\n"
              "    print(words(turn.holder))\n")
    done = run_cmd([sys.executable, "-c", script])
    assert done.returncode == 0, done.stderr
    decided, said = done.stdout.splitlines()
    assert decided == f"False [{seated[1].pid}, {seated[2].pid}]"
    assert said.startswith(f"2 of 2 seats: pid {seated[1].pid}, session "), said
    for held in seated.values():
        assert held.release() == 0


def test_history_shows_two_seated_turns_at_once_as_no_overlap(lanelock, holder):
    """Two turns on two seats hold the lane together: each ends with its own release (a second
    turn taking the lane used to mean the first had lost it: 'no release seen')."""
    seated = both_held(lanelock, holder)
    assert seated[1].release() == 0 and seated[2].release(3) == 3
    history = history_json(lanelock)
    acquired = [event for event in history["events"] if event["event"] == "acquired"]
    assert [(event["seat"], event["seats"], event["pid"], event["ended"]) for event in acquired] \
        == [(1, 2, seated[1].pid, "released"), (2, 2, seated[2].pid, "released")]
    summary = history["summary"]
    assert (summary["overlaps"], summary["died"], summary["end_unknown"], summary["holding"]) == (
        0, 0, 0, 0)
    assert summary["busy_fraction"] <= 1.0
    table = lanelock("history").stdout
    rows = [line for line in table.splitlines() if re.match(r"\d{4}-\d\d-\d\d \S+ \S+\s+\w", line)]
    assert any("acquired" in row and "seat 1 of 2" in row for row in rows), table
    assert any("acquired" in row and "seat 2 of 2" in row for row in rows), table
    assert any("released" in row and "seat 2 of 2, held" in row and "exit 3" in row
               for row in rows), table
    assert "overlap" not in table and "no release seen" not in table, table


def test_metrics_have_the_seats_and_the_seats_held(lanelock, holder):
    parser = pytest.importorskip("prometheus_client.parser")
    seated = both_held(lanelock, holder)

    def gauges() -> dict:
        done = lanelock("metrics")
        assert done.returncode == 0, done.stderr
        return {sample.name: sample.value
                for family in parser.text_string_to_metric_families(done.stdout)
                for sample in family.samples if sample.labels.get("lane") == LANE
                and sample.name in ("lanelock_lane_seats", "lanelock_lane_held_seats",
                                    "lanelock_lane_held")}

    assert gauges() == {"lanelock_lane_seats": 2, "lanelock_lane_held_seats": 2,
                        "lanelock_lane_held": 1}
    assert seated[2].release() == 0
    assert gauges() == {"lanelock_lane_seats": 2, "lanelock_lane_held_seats": 1,
                        "lanelock_lane_held": 1}
    assert seated[1].release() == 0
    assert gauges() == {"lanelock_lane_seats": 2, "lanelock_lane_held_seats": 0,
                        "lanelock_lane_held": 0}


def test_watch_follows_the_seats(lanelock, holder, procs):
    two_seats(lanelock)
    first = holder("--session", "a", command=SEATED)
    watch = procs.start([*LANELOCK, "status", "--watch"], stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE)
    assert read_line(watch.stdout, 30).startswith(f"{LANE}: 1 of 2 seats held (1 free): seat ")
    second = holder("--session", "b", command=SEATED)
    while True:   # the refreshes before the second turn say one seat; read until it shows
        line = read_line(watch.stdout, TIMEOUT)
        assert line, "the watch ended"
        if line.startswith(f"{LANE}: 2 of 2 seats held: "):
            break
    assert f"pid {second.pid}" in line and f"pid {first.pid}" in line, line
    watch.send_signal(signal.SIGINT)
    assert watch.wait(timeout=TIMEOUT) == 0
    assert first.release() == 0 and second.release() == 0


VARYING = re.compile(r"(pid )\d+|(held |for )[\d.]+s|(session )\w+|(command )[^)]*")


def _shape(line: str) -> re.Pattern:
    """A documented line as a pattern of what varies between runs: pids, seconds, sessions and
    commands (the rest -- the words -- must be exactly what lanelock prints)."""
    loose = {"pid ": r"\d+", "held ": r"[\d.]+s", "for ": r"[\d.]+s", "session ": r"\w+",
             "command ": r"[^)]*"}
    parts, at = [], 0
    for match in VARYING.finditer(line):
        word = next(group for group in match.groups() if group)
        parts += [re.escape(line[at:match.start()]), re.escape(word), loose[word]]
        at = match.end()
    return re.compile("".join(parts) + re.escape(line[at:]))


def test_the_readme_seated_views_block(lanelock, holder):
    """README's example of a lane of two seats: each command run, each line it shows printed."""
    from support.doc_blocks import block

    text = block("seated-views").text
    both_held(lanelock, holder)
    commands = re.findall(r"^\$ lanelock (.*)\n(.*)$", text, re.M)
    assert [words for words, _ in commands] == ["status", "probe", "run -- ./ask-local.sh"]
    for words, shown in commands:
        args = words.replace("./ask-local.sh", "true").split()
        done = lanelock(*args)
        said = (done.stderr if args[0] == "run" else done.stdout).splitlines()[0]
        said = said.split("; engine")[0]   # nothing on 8080 here, or another test's stand-in
        assert _shape(shown).fullmatch(said), (shown, said)


def test_the_proxys_busy_answer_names_both_holders(lanelock, holder, procs):
    from support.engine import Engine
    from support.proxy import Proxy, raw_request

    engine = Engine(procs, delay=0.01)
    done = lanelock("seats", "-b", engine.backend, "2")
    assert done.returncode == 0, done.stderr
    proxy = Proxy(procs, engine.backend)
    first = holder("-b", engine.backend, "-s", "a", command=SEATED)
    second = holder("-b", engine.backend, "-s", "b", command=SEATED)
    status, headers, body = raw_request(proxy.port, "POST", "/v1/chat/completions")
    assert status == 503 and headers.get("x-lanelock-state") == "busy", (status, body)
    message = json.loads(body)["error"]["message"]
    one, two = sorted((first, second), key=seat_of)
    assert re.match(rf"local model in use by another session \(2 of 2 seats: pid {one.pid}, "
                    rf"session \w, held [\d.]+s; pid {two.pid}, session \w, held [\d.]+s\)",
                    message), message
    assert first.release() == 0 and second.release() == 0
