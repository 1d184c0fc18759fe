"""`lanelock duel` end to end: real processes, different environments, one gate."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pexpect
import psutil
import pytest

from support.cli import environ
from support.roots import remove_lane_files
from support.ports import free_port


def leftover_duelists(lock_dir: str | None) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if "lanelock.duelist" not in " ".join(proc.info["cmdline"] or []):
                continue
            if lock_dir is None or proc.environ().get("LANELOCK_DIR") == lock_dir:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def test_duel_passes_and_reports_one_lock_path(lanelock, tmp_path, monkeypatch):
    monkeypatch.setenv("LANELOCK_DIR", str(tmp_path / "root"))
    done = lanelock("duel", "--json", "--hold", "0.2")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["result"] == "PASS" and report["reason"] is None
    paths = set(report["lock_paths"].values()) | {report["expected_lock_path"]}
    assert paths == {str(tmp_path / "root" / "localhost-8080~lanelock-duel.lock")}
    assert set(report["lock_paths"]) == {"A", "B", "C", "D"}
    assert report["handoff_ms"] is not None and report["handoff_ms"] >= 0
    assert [s["step"] for s in report["steps"] if not s["ok"]] == []
    assert lanelock("probe").returncode == 0
    assert leftover_duelists(str(tmp_path / "root")) == []


def test_the_duel_writes_into_a_lane_of_its_own_not_the_users(lanelock, tmp_path, monkeypatch):
    """The README's first command proves the root every process computes, beside the user's lane:
    after it, the user's lane has no history and no counts, and the duel runs while it is held."""
    monkeypatch.setenv("LANELOCK_DIR", str(tmp_path / "root"))
    held = lanelock("run", "-s", "user-turn", "--", "true")   # the user's turn, before the duel
    assert held.returncode == 0, held.stderr
    done = lanelock("duel", "--json", "--hold", "0")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["lane"] == "localhost:8080#lanelock-duel", report["lane"]
    assert report["expected_lock_path"] == str(tmp_path / "root" / "localhost-8080~lanelock-duel.lock")
    events = json.loads(lanelock("history", "--json").stdout)["events"]
    assert {event.get("session") for event in events} == {"user-turn"}, events
    metrics = lanelock("metrics").stdout
    assert 'lanelock_turns_total{lane="localhost:8080",outcome="deflected"} 0.0' in metrics, metrics
    assert 'lanelock_turns_total{lane="localhost:8080",outcome="local"} 1.0' in metrics, metrics


def test_duel_witness_sees_a_direct_request_and_not_a_gated_turn(lanelock, tmp_path, monkeypatch):
    """The step the seed never had: `lanelock watch` over a stand-in engine (llama.cpp's /slots)
    reports a request sent straight to it while the lane is free, and not a turn through run;
    on a root of its own, so the duel's lane and the user's engine are never touched."""
    monkeypatch.setenv("LANELOCK_DIR", str(tmp_path / "root"))
    done = lanelock("duel", "--json", "--hold", "0")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    steps = {step["step"]: step for step in report["steps"]}
    assert steps["witness: unseen"]["ok"] and steps["witness: covered"]["ok"], steps
    assert "unseen generation on localhost:" in report["witness"]["unseen_reported"]
    assert "while no turn held the lane" in report["witness"]["unseen_reported"]
    assert report["witness"]["gated_reported"] == []
    names = {path.name.partition(".")[0] for path in (tmp_path / "root").iterdir()}
    # the witness's lane: the duel's work dir; the seats step's lane: its own, its count set back
    assert names == {"localhost-8080~lanelock-duel", "localhost-8080~lanelock-duel-seats", "kept",
                     ""}
    assert json.loads((tmp_path / "root" / "kept.json").read_text()) == {}


def test_duel_seats_two_turns_hold_together_and_the_third_deflects_naming_both(
        lanelock, tmp_path, monkeypatch):
    """The seats step, on a lane of its own with two seats: S1 and S2 hold at once on seats 1
    and 2, S3 deflects and its line names both holders; the count is set back to 1 after."""
    monkeypatch.setenv("LANELOCK_DIR", str(tmp_path / "root"))
    done = lanelock("duel", "--json", "--hold", "0")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    steps = {step["step"]: step for step in report["steps"]}
    assert steps["seats: two hold"]["ok"] and steps["seats: S3 deflects"]["ok"], steps
    seats = report["seats"]
    assert seats["lane"] == "localhost:8080#lanelock-duel-seats"
    assert sorted(seats["seats"].values()) == ["1", "2"]   # two seats, whichever came first
    assert "2 of 2 seats: " in seats["deflection"], seats
    assert "session duel-S1" in seats["deflection"] and "session duel-S2" in seats["deflection"]
    backend = ["-b", "localhost:8080", "--key-by", "model", "--model", "lanelock-duel-seats"]
    assert lanelock("seats", *backend).stdout == "1\n"
    assert lanelock("probe", *backend).returncode == 0
    assert leftover_duelists(str(tmp_path / "root")) == []


def test_duel_human_report_ends_with_pass(lanelock, tmp_path, monkeypatch):
    monkeypatch.setenv("LANELOCK_DIR", str(tmp_path))
    done = lanelock("duel", "--hold", "0")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.rstrip().splitlines()[-1] == "PASS"
    for role in ("A", "B", "C", "D"):
        assert f"  {role} " in done.stdout


def test_duel_on_the_default_root(lanelock, default_root, lock_roots):
    """No LANELOCK_DIR: the default root, computed alike by A, B (other HOME) and C (env -i)."""
    backend = f"127.0.0.1:{free_port()}"
    done = lanelock("duel", "--json", "--hold", "0", "--backend", backend, timeout=120)
    report = json.loads(done.stdout)
    # A throwaway lane on a random port in the real root: nobody else can be using it, so this
    # test (and only this test) removes its files, once the teardown check has seen it free.
    lock_roots.after(lambda: remove_lane_files(report["expected_lock_path"]))
    seats_lane = report["expected_lock_path"].replace("~lanelock-duel.lock",
                                                      "~lanelock-duel-seats.lock")
    lock_roots.after(lambda: remove_lane_files(seats_lane))   # the seats step's own lane
    assert done.returncode == 0, report
    assert report["root_source"] == "default"
    assert report["expected_lock_path"].startswith(f"{default_root}/")
    assert len(set(report["lock_paths"].values())) == 1


def test_a_split_root_fails_loudly_with_both_paths(lanelock, tmp_path, monkeypatch):
    monkeypatch.setenv("LANELOCK_DIR", str(tmp_path / "shared"))
    other = tmp_path / "elsewhere"
    done = lanelock("duel", "--json", "--hold", "0", "--profile-env", f"LANELOCK_DIR={other}")
    assert done.returncode == 1
    report = json.loads(done.stdout)
    assert report["result"] == "FAIL"
    assert "two gates" in report["reason"]
    assert str(other / "localhost-8080~lanelock-duel.lock") in report["reason"]
    assert str(tmp_path / "shared" / "localhost-8080~lanelock-duel.lock") in report["reason"]
    assert lanelock("probe").returncode == 0
    assert leftover_duelists(str(tmp_path / "shared")) == []
    assert leftover_duelists(str(other)) == []


def test_a_user_config_cannot_split_the_gate(lanelock, tmp_path, monkeypatch):
    """A per-user config that sets lock_dir is ignored, so the duel still passes."""
    monkeypatch.setenv("LANELOCK_DIR", str(tmp_path / "shared"))
    user_config = tmp_path / "user.toml"
    user_config.write_text(f'lock_dir = "{tmp_path / "private"}"\n')
    done = lanelock("duel", "--json", "--hold", "0", "--profile-env", f"LANELOCK_CONFIG={user_config}")
    assert done.returncode == 0, done.stdout
    assert json.loads(done.stdout)["result"] == "PASS"


def test_duel_runs_a_given_command_as_the_holder(lanelock, tmp_path, monkeypatch):
    monkeypatch.setenv("LANELOCK_DIR", str(tmp_path / "root"))
    marker = tmp_path / "generated"
    done = lanelock("duel", "--json", "--hold", "0", "--", "sh", "-c",
                f'echo "$LANELOCK_STATE" > {marker}')
    assert done.returncode == 0, done.stdout + done.stderr
    assert marker.read_text().strip() == "held"


def test_ctrl_c_leaves_nothing_running_and_the_lane_free(lanelock, tmp_path, monkeypatch, procs):
    root = str(tmp_path / "root")
    monkeypatch.setenv("LANELOCK_DIR", root)
    child = procs.spawn(pexpect.spawn(sys.executable, ["-m", "lanelock", "duel", "--hold", "60"],
                                      env=environ(), timeout=60, encoding="utf-8"))
    child.expect("A holds the lane")
    child.sendintr()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 130 or child.signalstatus == signal.SIGINT
    assert leftover_duelists(root) == []
    assert lanelock("probe").returncode == 0


def test_users_need_root_or_exist(lanelock, tmp_path, monkeypatch):
    monkeypatch.setenv("LANELOCK_DIR", str(tmp_path))
    done = lanelock("duel", "--users", "no-such-user-xyz,other")
    assert done.returncode == 2
    assert done.stderr.startswith("lanelock: ") and "Traceback" not in done.stderr


def _python_usable_by(user: str) -> bool:
    probe_run = subprocess.run(["runuser", "-u", user, "--", sys.executable, "-c", "import lanelock"],
                               capture_output=True, cwd="/")
    return probe_run.returncode == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="--users needs root")
def test_duel_across_users(lanelock, tmp_path, monkeypatch):
    users = [u for u in ("nobody", "daemon") if _user_exists(u)]
    if len(users) < 2 or not all(_python_usable_by(u) for u in users):
        pytest.skip("this Python (or its packages) is not readable by other users here")
    root = tmp_path / "root"
    tmp_path.chmod(0o755)
    monkeypatch.setenv("LANELOCK_DIR", str(root))
    done = lanelock("duel", "--json", "--hold", "0", "--users", ",".join(users))
    assert done.returncode == 0, done.stdout


def _user_exists(name: str) -> bool:
    import pwd

    try:
        pwd.getpwnam(name)
        return True
    except KeyError:
        return False


@pytest.mark.slow   # the default tier's time: the slow tier (CI) runs it
def test_duel_fallback_is_split_as_run_splits_it(lanelock, tmp_path, monkeypatch):
    """`duel --fallback` reads its command as `run --fallback` does (bash's quoting, $'…'
    included), and a malformed one is a usage error: one line, exit 2, never a traceback."""
    monkeypatch.setenv("LANELOCK_DIR", str(tmp_path / "root"))
    out = tmp_path / "fallback-saw"
    done = lanelock("duel", "--json", "--hold", "0", "--fallback",
                    f"sh -c 'printf %s \"$1\" > \"$0\"' {out} $'a\\tb'")
    assert done.returncode == 0, done.stdout + done.stderr
    assert out.read_text() == "a\tb"
    bad = lanelock("duel", "--fallback", "echo 'unclosed")
    assert bad.returncode == 2
    assert bad.stderr.startswith("lanelock: --fallback \"echo 'unclosed\": ") \
        and len(bad.stderr.splitlines()) == 1, bad.stderr
    assert leftover_duelists(str(tmp_path / "root")) == []
