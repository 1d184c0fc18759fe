"""Kill it, starve it, feed it garbage: the lane ends free or correctly held, no two generations
overlap, the journal stays parseable. Real processes throughout."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from support.cli import LANELOCK, STEM
from support.holding import HOLD_SCRIPT, signalled_hold
from support.processes import ExitWatch, wait_for, wait_stopped
from lanelock import testing
from lanelock.store.flock import journal, sidecar

LOCK = f"{STEM}.lock"


def probe_state(lanelock) -> str:
    return json.loads(lanelock("probe", "--json").stdout)["state"]


def proc_state(pid: int) -> str:
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return "gone"
    return data[data.rfind(b")") + 2:].split()[0].decode()


def journal_events(lock_dir: Path) -> list[dict]:
    events, bad = journal.read(str(lock_dir / f"{STEM}.journal"))
    assert bad == 0
    return events


def assert_free_and_reusable(lanelock, lock_dir: Path):
    assert probe_state(lanelock) == "free"
    done = lanelock("run", "--", "sh", "-c", 'echo "$LANELOCK_STATE"')
    assert done.returncode == 0 and done.stdout.strip() == "held", done.stderr
    journal_events(lock_dir)


# -- SIGKILL of the wrapper at each step --------------------------------------------------------

@pytest.mark.parametrize("step", ["before-acquire", "after-acquire", "during-release"])
def test_sigkill_of_the_wrapper_at_each_step(step, lanelock, lock_dir, procs):
    lanelock("run", "--", "true")   # the files exist, with a released sidecar
    proc = procs.start([*LANELOCK, "run", "--", "true"],
                       env=dict(os.environ, LANELOCK_DEBUG_PAUSE=step), stderr=subprocess.DEVNULL)
    wait_stopped(proc.pid)   # the debug pause: the wrapper stops itself at the step
    if step != "before-acquire":
        assert probe_state(lanelock) == "busy"
    proc.kill()
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert_free_and_reusable(lanelock, lock_dir)
    status = json.loads(lanelock("status", "--json").stdout)["lanes"][0]
    assert status["state"] == "free"


def test_sigkill_of_the_wrapper_during_the_child(lanelock, lock_dir, holder):
    held = holder()
    child = ExitWatch(held.child_pid)
    os.kill(held.pid, signal.SIGKILL)
    assert held.wait() == -signal.SIGKILL
    child.wait()   # the parent-death signal
    assert_free_and_reusable(lanelock, lock_dir)
    verdict = json.loads(lanelock("status", "--json").stdout)["lanes"][0]["verdict"]
    assert verdict == "released"   # the turn after it released cleanly


# -- the child misbehaving ----------------------------------------------------------------------

def test_child_ignoring_sigterm_is_killed_after_kill_after(lanelock, holder):
    held = holder("--kill-after", "0.3",
                  command=["sh", "-c", f"trap '' TERM; {HOLD_SCRIPT}"])
    os.kill(held.pid, signal.SIGTERM)
    assert held.wait() == 128 + signal.SIGKILL
    assert probe_state(lanelock) == "free"


def test_child_taking_sigterm_keeps_the_lane_without_kill_after(lanelock, holder):
    held = holder(command=signalled_hold("SIGTERM"))
    os.kill(held.pid, signal.SIGTERM)
    assert held.read_line() == f"signal {int(signal.SIGTERM)}\n"   # forwarded; the child goes on
    assert probe_state(lanelock) == "busy"   # the generation goes on, so the lane stays held
    assert held.release(7) == 7             # and the wrapper waited for the child's own status
    assert probe_state(lanelock) == "free"


def test_stopped_child_keeps_the_lane_until_it_continues(lanelock, holder):
    held = holder()
    os.kill(held.child_pid, signal.SIGSTOP)
    # Not our child (the wrapper's): only the kernel's view of it says when it has stopped.
    wait_for(lambda: proc_state(held.child_pid) == "T", what="the child to stop")
    assert probe_state(lanelock) == "busy"
    os.kill(held.child_pid, signal.SIGCONT)
    assert held.release() == 0
    assert probe_state(lanelock) == "free"


# -- the lock root ------------------------------------------------------------------------------

def assert_fail_open(done, expect_out="ran"):
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == expect_out
    warnings = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(warnings) == 1, done.stderr
    assert warnings[0].startswith("lanelock: warning: gate unavailable (")
    assert warnings[0].endswith("); running without it")


def test_read_only_root_fails_open(lanelock, monkeypatch, tmpfs):
    monkeypatch.setenv("LANELOCK_DIR", str(tmpfs("ro,size=1m") / "lanes"))
    assert_fail_open(lanelock("run", "--", "sh", "-c",
                              'echo ran; [ "$LANELOCK_STATE" = fail-open ]'))


def test_existing_lock_on_a_read_only_root_still_gates(lanelock, monkeypatch, tmpfs, holder):
    mount = tmpfs("size=1m")
    monkeypatch.setenv("LANELOCK_DIR", str(mount))
    assert lanelock("run", "--", "true").returncode == 0
    if subprocess.run(["mount", "-o", "remount,ro", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot remount read-only here")
    held = holder("-q", command=["sh", "-c", f'echo "ready $$ $LANELOCK_STATE"; {HOLD_SCRIPT}'])
    assert held.ready_line.split()[2] == "held"   # flock on a read-only descriptor
    assert lanelock("run", "--", "true").returncode == 75
    assert held.release() == 0


def test_full_filesystem_keeps_the_lane_and_warns(lanelock, monkeypatch, tmpfs):
    mount = tmpfs("size=64k")
    monkeypatch.setenv("LANELOCK_DIR", str(mount / "lanes"))
    subprocess.run(["dd", "if=/dev/zero", f"of={mount / 'filler'}", "bs=4k", "count=64"],
                   capture_output=True)
    done = lanelock("run", "--", "sh", "-c", 'echo "$LANELOCK_STATE"')
    assert done.returncode == 0
    assert done.stdout.strip() in ("held", "fail-open")
    if done.stdout.strip() == "held":
        assert "holder record was not written" in done.stderr or "journal not written" in done.stderr
    else:
        assert done.stderr.count("gate unavailable") == 1


def test_root_under_a_regular_file_and_root_is_a_file(lanelock, tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for root in (blocker / "sub", blocker):
        monkeypatch.setenv("LANELOCK_DIR", str(root))
        assert_fail_open(lanelock("run", "--", "echo", "ran"))


def test_unsafe_root_of_another_user_is_not_trusted(lanelock, tmp_path, monkeypatch):
    root = tmp_path / "unsafe"
    root.mkdir()
    os.chown(root, 65534, 65534)
    root.chmod(0o777)   # world-writable without the sticky bit: anyone could swap lock files
    monkeypatch.setenv("LANELOCK_DIR", str(root))
    done = lanelock("run", "--", "echo", "ran")
    # Attacked is not broken: the turn deflects (75, nothing ran), never runs ungated.
    assert (done.returncode, done.stdout) == (75, ""), done
    assert "gate_untrusted" in done.stderr and "not trusting it" in done.stderr
    assert not (root / LOCK).exists()


# -- a broken gate says so where people look ---------------------------------
# A root no turn can lock: every turn there fails open. probe, status and metrics must say so
# instead of "free" (probe and status said "free; no turn has used this lane yet", exit 0).
GATE_UNAVAILABLE = 69   # exitcodes.GATE_UNAVAILABLE: status of a lane whose turns run ungated
BROKEN_REASONS = {"read-only": "Read-only file system", "regular-file": "not a directory",
                  "no-space": "No space left on device",
                  "no-space-in-root": "No space left on device"}


def fill_inodes(mount: Path) -> None:
    """Use up a tmpfs's inodes: nothing more can be created there (ENOSPC)."""
    for number in range(10000):
        try:
            (mount / f"filler{number}").touch()
        except OSError as error:
            assert error.errno == 28, error   # ENOSPC
            return
    raise AssertionError("the tmpfs never filled up")


@pytest.fixture(params=sorted(BROKEN_REASONS))
def broken_root(request, tmp_path, tmpfs, monkeypatch) -> tuple[str, Path]:
    """(kind, root): LANELOCK_DIR points at a root that does not exist and cannot be created, or
    (no-space-in-root) one that exists but where no lock file can be created."""
    kind = request.param
    if kind == "read-only":
        root = tmpfs("ro,size=1m") / "lanes"
    elif kind == "regular-file":
        (tmp_path / "file").write_text("x")
        root = tmp_path / "file" / "locks"
    else:
        mount = tmpfs("size=64k,nr_inodes=8")
        fill_inodes(mount)
        root = mount / "lanes" if kind == "no-space" else mount
    monkeypatch.setenv("LANELOCK_DIR", str(root))
    return kind, root


def test_a_broken_root_fails_open_and_probe_says_why(broken_root, lanelock):
    kind, root = broken_root
    assert_fail_open(lanelock("run", "--", "echo", "ran"))   # what every turn here does
    for args in ((), ("--json",)):
        done = lanelock("probe", *args)
        assert (done.returncode, done.stdout) == (2, ""), done
        (line,) = done.stderr.splitlines()
        assert line.startswith("lanelock: ") and str(root) in line, line
        assert BROKEN_REASONS[kind] in line and "ungated" in line, line


def test_status_of_a_broken_root_says_turns_run_ungated(broken_root, lanelock):
    kind, root = broken_root
    done = lanelock("status")
    assert done.returncode == GATE_UNAVAILABLE, done
    (line,) = done.stdout.splitlines()
    assert line.startswith("localhost:8080: gate unavailable: "), line
    assert BROKEN_REASONS[kind] in line and str(root) in line, line
    # then what its engine says (nothing answers on 127.0.0.1:8080 here)
    line = line.split("; engine")[0]
    assert line.endswith("turns here would run ungated (fail open)"), line
    assert "Traceback" not in done.stderr
    done = lanelock("status", "--json")
    assert done.returncode == GATE_UNAVAILABLE, done
    (lane,) = json.loads(done.stdout)["lanes"]
    assert (lane["gate"], lane["verdict"]) == ("unavailable", "gate-unavailable"), lane
    assert BROKEN_REASONS[kind] in lane["gate_problem"], lane
    assert lane["message"] == line.split(": ", 1)[1]
    # --all finds no lane under a root that is not there; the root itself is what is broken.
    every = lanelock("status", "--all", "--json")
    assert every.returncode == GATE_UNAVAILABLE, every
    assert json.loads(every.stdout)["lanes"] == []
    assert BROKEN_REASONS[kind] in every.stderr and "ungated" in every.stderr


def test_metrics_of_a_broken_root_say_the_gate_cannot_be_taken(broken_root, lanelock, run_cmd):
    from prometheus_client.parser import text_string_to_metric_families
    from support.prometheus import tool

    promtool = tool("promtool")
    for args in ((), ("--all",)):
        done = lanelock("metrics", *args)
        assert (done.returncode, done.stderr) == (0, ""), done   # a scrape of a broken gate works
        checked = run_cmd([promtool, "check", "metrics"], input=done.stdout)
        assert (checked.returncode, checked.stdout, checked.stderr) == (0, "", ""), checked
        gauges = {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
                  for family in text_string_to_metric_families(done.stdout)
                  for sample in family.samples}
        assert gauges[("lanelock_store_available", ())] == 0
        if not args:
            assert gauges[("lanelock_gate_available", (("lane", "localhost:8080"),))] == 0


def test_a_root_that_is_not_there_yet_is_free(lanelock, lock_dir, run_cmd):
    """The first turn makes a missing root: that is no broken gate."""
    from support.prometheus import tool

    assert not lock_dir.exists()
    done = lanelock("probe")
    assert (done.returncode, done.stdout, done.stderr) == (0, "free: localhost:8080\n", "")
    done = lanelock("status", "--json")
    assert done.returncode == 0, done
    (lane,) = json.loads(done.stdout)["lanes"]
    assert (lane["gate"], lane["gate_problem"], lane["verdict"]) == ("available", None, "never-used")
    metrics = lanelock("metrics").stdout
    assert 'lanelock_gate_available{lane="localhost:8080"} 1.0' in metrics
    assert "lanelock_store_available 1.0" in metrics
    checked = run_cmd([tool("promtool"), "check", "metrics"], input=metrics)
    assert checked.returncode == 0, checked
    assert not lock_dir.exists()   # asking created nothing


def test_a_read_only_root_gates_the_lanes_it_has_and_says_new_ones_cannot(lanelock, monkeypatch,
                                                                           tmpfs):
    mount = tmpfs("size=1m")
    monkeypatch.setenv("LANELOCK_DIR", str(mount))
    assert lanelock("run", "--", "true").returncode == 0
    if subprocess.run(["mount", "-o", "remount,ro", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot remount read-only here")
    # The lane with a lock file: flock works on a read-only descriptor, its gate is there.
    assert lanelock("probe").returncode == 0
    done = lanelock("status", "--json")
    assert done.returncode == 0 and json.loads(done.stdout)["lanes"][0]["gate"] == "available"
    # A lane with none yet: its first turn cannot create one.
    new = lanelock("probe", "-b", "localhost:7391")
    assert new.returncode == 2 and "Read-only file system" in new.stderr
    done = lanelock("status", "-b", "localhost:7391")
    assert done.returncode == GATE_UNAVAILABLE and "gate unavailable" in done.stdout
    metrics = lanelock("metrics", "--all").stdout
    assert 'lanelock_gate_available{lane="localhost:8080"} 1.0' in metrics
    assert "lanelock_store_available 0.0" in metrics


def test_lock_file_replaced_while_held(lanelock, lock_dir, holder):
    held = holder("-s", "first")
    (lock_dir / LOCK).unlink()          # someone "cleans up" the lock file under a live holder
    second = lanelock("run", "--", "echo", "SECOND")
    assert second.returncode == 75 and "SECOND" not in second.stdout
    assert "removed or replaced" in second.stderr
    lane = json.loads(lanelock("status", "--json").stdout)["lanes"][0]
    assert lane["verdict"] == "lock-file-replaced" and lane["state"] == "held"
    os.kill(held.pid, signal.SIGKILL)
    held.wait()
    assert_free_and_reusable(lanelock, lock_dir)


# -- symlinks planted by someone else -----------------------------------------------------------

@pytest.fixture
def victim(tmp_path) -> Path:
    path = tmp_path / "victim.txt"
    path.write_text("precious\n")
    return path


def test_symlink_at_the_lock_path_fails_open(lanelock, lock_dir, victim):
    lock_dir.mkdir(parents=True)
    (lock_dir / LOCK).symlink_to(victim)
    assert_fail_open(lanelock("run", "--", "echo", "ran"))
    assert victim.read_text() == "precious\n"


def test_symlinked_root_fails_open(lanelock, tmp_path, monkeypatch, victim):
    real = tmp_path / "real-root"
    real.mkdir()
    link = tmp_path / "link-root"
    link.symlink_to(real)
    monkeypatch.setenv("LANELOCK_DIR", str(link))
    assert_fail_open(lanelock("run", "--", "echo", "ran"))
    assert list(real.iterdir()) == []


@pytest.mark.parametrize("name,words", [("localhost-8080.json", "holder record was not written"),
                                        ("localhost-8080.journal", "journal not written")])
def test_symlinked_sidecar_or_journal_stays_gated_and_warns(lanelock, lock_dir, victim, name, words):
    lock_dir.mkdir(parents=True)
    (lock_dir / name).symlink_to(victim)
    done = lanelock("run", "--", "sh", "-c", 'echo "$LANELOCK_STATE"')
    assert done.returncode == 0 and done.stdout.strip() == "held"
    assert words in done.stderr
    assert victim.read_text() == "precious\n"
    assert (lock_dir / name).is_symlink()


def test_symlink_at_the_sidecar_temp_path_is_not_written_through(lanelock, lock_dir, victim, procs):
    lanelock("run", "--", "true")
    proc = procs.start([*LANELOCK, "run", "--", "true"],
                       env=dict(os.environ, LANELOCK_DEBUG_PAUSE="before-acquire"),
                       stderr=subprocess.DEVNULL)
    wait_stopped(proc.pid)
    temp = lock_dir / f".localhost-8080.json.{proc.pid}.tmp"
    temp.symlink_to(victim)
    os.kill(proc.pid, signal.SIGCONT)
    assert proc.wait(timeout=30) == 0
    assert victim.read_text() == "precious\n"
    record, problem = sidecar.read(str(lock_dir / "localhost-8080.json"))
    assert problem is None and record["pid"] == proc.pid


# -- garbage in, no traceback out ---------------------------------------------------------------

GARBAGE = [b"\x00\xff\xfe garbage", b"\xc3\x28 not utf-8", b"[" * 100000, b'{"schema": 99}',
           b'{"schema": 1, "pid": "7", "start_ticks": [1], "argv": {"a": 1}}',
           b'{"schema": 1, "pid": 1000000000000000000000000000000}']


@pytest.mark.parametrize("garbage", GARBAGE, ids=range(len(GARBAGE)))
def test_garbage_sidecar_is_overwritten_by_the_next_holder(lanelock, lock_dir, garbage):
    lock_dir.mkdir(parents=True)
    (lock_dir / "localhost-8080.json").write_bytes(garbage)
    done = lanelock("run", "--", "true")
    assert done.returncode == 0 and "Traceback" not in done.stderr
    record, problem = sidecar.read(str(lock_dir / "localhost-8080.json"))
    assert problem is None and record["exit_status"] == 0


@pytest.mark.parametrize("garbage", GARBAGE[:3], ids=range(3))
def test_deflection_beside_a_garbage_sidecar_names_the_kernel_holder(lanelock, lock_dir, garbage, holder):
    held = holder()
    (lock_dir / "localhost-8080.json").write_bytes(garbage)
    done = lanelock("run", "--", "true")
    assert done.returncode == 75 and "Traceback" not in done.stderr
    assert f"pid {held.pid}" in done.stderr
    assert held.release() == 0


@pytest.mark.parametrize("text", ["grace = \n", "\xff\xfe", "a = [" * 5000])
def test_garbage_config_fails_open_for_run_and_exits_2_elsewhere(lanelock, tmp_path, monkeypatch, text):
    """A file that does not parse at all: nothing in it can be trusted (a backend, a store)."""
    config = tmp_path / "system.toml"
    config.write_bytes(text.encode("utf-8", "surrogateescape") if isinstance(text, str) else text)
    monkeypatch.setenv("LANELOCK_SYSTEM_CONFIG", str(config))
    ran = lanelock("run", "--", "echo", "ran")
    assert_fail_open(ran)
    assert str(config) in ran.stderr
    for command in (["where"], ["probe"], ["status"], ["history"], ["config", "show"]):
        done = lanelock(*command)
        assert done.returncode == 2, (command, done.stderr)
        assert done.stderr.startswith("lanelock: ") and "Traceback" not in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("text", ["grace = 'x'\n", "bogus = 1\n", "[[chains.a]]\nnot_a_key = 1\n"],
                         ids=["bad-value", "unknown-key", "bad-chain"])
def test_a_bad_setting_in_a_config_file_is_its_default_and_the_gate_stays_on(
        lanelock, lock_dir, tmp_path, monkeypatch, holder, text):
    """A bad value (or an unknown key) of a setting with a safe default is that
    setting's default with one warning -- never an ungated turn, never a stopped command."""
    config = tmp_path / "system.toml"
    config.write_text(text)
    monkeypatch.setenv("LANELOCK_SYSTEM_CONFIG", str(config))
    held = holder()
    ran = lanelock("run", "--", "echo", "ran")
    assert ran.returncode == 75 and "ran" not in ran.stdout, ran.stderr   # gated: it deflects
    warnings = [line for line in ran.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1 and str(config) in warnings[0], ran.stderr
    assert held.release() == 0
    for command in (["where"], ["probe"], ["status"], ["history"], ["config", "show"]):
        done = lanelock(*command)
        assert done.returncode == 0, (command, done.stderr)
        assert "Traceback" not in done.stderr


def test_hostile_labels_are_one_sanitised_line(lanelock, lock_dir, holder):
    label = "evil\n\x1b[31mRED\x1b[0m" + "x" * 10000
    held = holder("-s", label, "-m", "m\nodel")
    done = lanelock("run", "--", "true")
    assert done.returncode == 75
    line = done.stderr.strip()
    assert "\n" not in line and "\x1b" not in line and len(line) < 1000
    status = lanelock("status")
    assert len(status.stdout.strip().splitlines()) == 1 and "\x1b" not in status.stdout
    assert held.release() == 0
    journal_events(lock_dir)


def test_command_names_with_spaces(lanelock, tmp_path):
    folder = tmp_path / "dir with space"
    folder.mkdir()
    script = folder / "my cmd"
    script.write_text("#!/bin/sh\necho \"args: $*\"\n")
    script.chmod(0o755)
    done = lanelock("run", "--", str(script), "a b", "c")
    assert done.returncode == 0 and done.stdout.strip() == "args: a b c"
    holder_fallback = lanelock("run", "-f", f"'{script}' 'fall back'", "--no-gate", "--", "true")
    assert holder_fallback.returncode == 0


# -- readers never raise ------------------------------------------------------------------------

@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=2048))
def test_sidecar_parse_never_raises(data):
    record, problem = sidecar.parse(data)
    assert (record is None) != (problem is None)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.binary(max_size=300), max_size=20))
def test_journal_read_never_raises(tmp_path_factory, lines):
    path = tmp_path_factory.mktemp("journal") / "lane.journal"
    path.write_bytes(b"\n".join(lines))
    events, bad = journal.read(str(path))
    assert all(isinstance(event, dict) for event in events) and bad >= 0
    events, bad = journal.read(str(path), since=0.0)
    assert all(isinstance(event, dict) for event in events) and bad >= 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0, 1000), max_size=60), st.lists(st.floats(-29, 29), max_size=60),
       st.floats(0, 1100), st.sampled_from([7, 64, 4096]), st.integers(0, 60))
def test_journal_read_since_finds_what_a_whole_read_finds(tmp_path_factory, times, jitter, since,
                                                         chunk, rotated):
    """The end read back in chunks (any size, lines cut anywhere) holds every event of the
    span a whole read holds, across the rotated generation too, with lines out of time order
    by less than the slack."""
    times = [t + (jitter[i] if i < len(jitter) else 0.0) for i, t in enumerate(sorted(times))]
    lines = [json.dumps({"event": "released", "ts": t, "n": i}).encode() + b"\n"
             for i, t in enumerate(times)]
    path = tmp_path_factory.mktemp("journal") / "lane.journal"
    Path(f"{path}.1").write_bytes(b"".join(lines[:rotated]))
    path.write_bytes(b"".join(lines[rotated:]))
    original = journal.CHUNK
    journal.CHUNK = chunk
    try:
        tail, _ = journal.read(str(path), since=since)
    finally:
        journal.CHUNK = original
    whole, _ = journal.read(str(path))
    assert [e for e in tail if e["ts"] >= since] == [e for e in whole if e["ts"] >= since]


# -- many turns, random kills, zero overlaps ----------------------------------------------------

@pytest.mark.slow
def test_thousand_turns_with_random_kills_never_overlap(lanelock, lock_dir, procs):
    local = testing.make_server(0, 0.01, "local")
    threading.Thread(target=local.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{local.server_address[1]}"
    argv = LANELOCK + ["run", "-q", "-b", f"127.0.0.1:{local.server_address[1]}", "--wait", "30",
                       "--", sys.executable, "-m", "lanelock.testing", "client", url]
    rng = random.Random(1234)
    remaining = [1000]
    guard = threading.Lock()
    killed = [0]

    def worker():
        while True:
            with guard:
                if remaining[0] <= 0:
                    return
                remaining[0] -= 1
            proc = procs.start(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            if rng.random() < 0.1:
                time.sleep(rng.random() * 0.05)
                proc.kill()
                killed[0] += 1
            proc.wait(timeout=120)

    workers = [threading.Thread(target=worker) for _ in range(10)]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join()
    local.shutdown()
    local.server_close()
    assert local.counter.max_in_flight == 1
    assert killed[0] > 0
    assert probe_state(lanelock) == "free"
    journal_events(lock_dir)
