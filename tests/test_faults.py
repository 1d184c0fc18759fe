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

from lanelock import testing
from lanelock.store import journal, sidecar

LANELOCK = [sys.executable, "-m", "lanelock"]
LOCK = "localhost-8080.lock"


@pytest.fixture(autouse=True)
def root(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "root"
    monkeypatch.setenv("LANELOCK_DIR", str(path))
    monkeypatch.setenv("LANELOCK_SYSTEM_CONFIG", str(tmp_path / "no-system.toml"))
    monkeypatch.setenv("LANELOCK_CONFIG", str(tmp_path / "no-user.toml"))
    for name in ("LANELOCK_BACKEND", "LANELOCK_SESSION", "LANELOCK_MODEL", "LANELOCK_HELD",
                 "LANELOCK_HOLDER_PID", "LANELOCK_DEBUG_PAUSE"):
        monkeypatch.delenv(name, raising=False)
    return path


@pytest.fixture
def procs():
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def lanelock(*args, env=None, timeout=60, **kw):
    return subprocess.run(LANELOCK + list(args), capture_output=True, text=True, env=env,
                          timeout=timeout, **kw)


def probe_state() -> str:
    return json.loads(lanelock("probe", "--json").stdout)["state"]


def wait_until(condition, timeout=20.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.005)
    raise AssertionError(f"timed out waiting for {what}")


def proc_state(pid: int) -> str:
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return "gone"
    return data[data.rfind(b")") + 2:].split()[0].decode()


def journal_events(root: Path) -> list[dict]:
    events, bad = journal.read(str(root / "localhost-8080.journal"))
    assert bad == 0
    return events


def assert_free_and_reusable(root: Path):
    assert probe_state() == "free"
    done = lanelock("run", "--", "sh", "-c", 'echo "$LANELOCK_STATE"')
    assert done.returncode == 0 and done.stdout.strip() == "held", done.stderr
    journal_events(root)


# -- SIGKILL of the wrapper at each step --------------------------------------------------------

@pytest.mark.parametrize("step", ["before-acquire", "after-acquire", "during-release"])
def test_sigkill_of_the_wrapper_at_each_step(step, root, procs):
    lanelock("run", "--", "true")   # the files exist, with a released sidecar
    env = dict(os.environ, LANELOCK_DEBUG_PAUSE=step)
    proc = subprocess.Popen(LANELOCK + ["run", "--", "true"], env=env,
                            stderr=subprocess.DEVNULL)
    procs.append(proc)
    wait_until(lambda: proc_state(proc.pid) == "T", what=f"the wrapper to stop at {step}")
    if step != "before-acquire":
        assert probe_state() == "busy"
    proc.kill()
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert_free_and_reusable(root)
    status = json.loads(lanelock("status", "--json").stdout)["lanes"][0]
    assert status["state"] == "free"


def test_sigkill_of_the_wrapper_during_the_child(root, procs, tmp_path):
    pidfile = tmp_path / "child.pid"
    proc = subprocess.Popen(LANELOCK + ["run", "--", "sh", "-c", f"echo $$ > {pidfile}; exec sleep 60"])
    procs.append(proc)
    wait_until(lambda: pidfile.exists() and pidfile.read_text().strip(), what="the child")
    child = int(pidfile.read_text())
    proc.kill()
    proc.wait()
    wait_until(lambda: proc_state(child) in ("gone", "Z"), what="the parent-death signal")
    assert_free_and_reusable(root)
    verdict = json.loads(lanelock("status", "--json").stdout)["lanes"][0]["verdict"]
    assert verdict == "released"   # the turn after it released cleanly


# -- the child misbehaving ----------------------------------------------------------------------

def test_child_ignoring_sigterm_is_killed_after_kill_after(root, procs, tmp_path):
    ready = tmp_path / "ready"
    script = f"trap '' TERM; touch {ready}; while :; do sleep 0.05; done"
    proc = subprocess.Popen(LANELOCK + ["run", "--kill-after", "0.3", "--", "sh", "-c", script])
    procs.append(proc)
    wait_until(ready.exists, what="the child")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGKILL
    assert probe_state() == "free"


def test_child_ignoring_sigterm_keeps_the_lane_without_kill_after(root, procs, tmp_path):
    ready = tmp_path / "ready"
    pidfile = tmp_path / "pid"
    script = f"trap '' TERM; echo $$ > {pidfile}; touch {ready}; while :; do sleep 0.05; done"
    proc = subprocess.Popen(LANELOCK + ["run", "--", "sh", "-c", script])
    procs.append(proc)
    wait_until(ready.exists, what="the child")
    proc.send_signal(signal.SIGTERM)
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.5)
    assert probe_state() == "busy"       # the generation goes on, so the lane stays held
    os.kill(int(pidfile.read_text()), signal.SIGKILL)
    assert proc.wait(timeout=30) == 137
    assert probe_state() == "free"


def test_stopped_child_keeps_the_lane_until_it_continues(root, procs, tmp_path):
    pidfile, go = tmp_path / "pid", tmp_path / "go"
    script = f"echo $$ > {pidfile}; while [ ! -e {go} ]; do sleep 0.02; done"
    proc = subprocess.Popen(LANELOCK + ["run", "--", "sh", "-c", script])
    procs.append(proc)
    wait_until(lambda: pidfile.exists() and pidfile.read_text().strip(), what="the child")
    child = int(pidfile.read_text())
    os.kill(child, signal.SIGSTOP)
    wait_until(lambda: proc_state(child) == "T", what="the child to stop")
    assert probe_state() == "busy"
    go.touch()
    os.kill(child, signal.SIGCONT)
    assert proc.wait(timeout=30) == 0
    assert probe_state() == "free"


# -- the lock root ------------------------------------------------------------------------------

def _mount_tmpfs(path: Path, options: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                          capture_output=True)
    return done.returncode == 0


@pytest.fixture
def mounts():
    mounted: list[Path] = []
    yield mounted
    for path in reversed(mounted):
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def assert_fail_open(done, expect_out="ran"):
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == expect_out
    warnings = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(warnings) == 1, done.stderr
    assert warnings[0].startswith("lanelock: warning: gate unavailable (")
    assert warnings[0].endswith("); running without it")


def test_read_only_root_fails_open(tmp_path, monkeypatch, mounts):
    mount = tmp_path / "ro"
    if not _mount_tmpfs(mount, "ro,size=1m"):
        pytest.skip("cannot mount a tmpfs here (needs root and CAP_SYS_ADMIN)")
    mounts.append(mount)
    monkeypatch.setenv("LANELOCK_DIR", str(mount / "lanes"))
    assert_fail_open(lanelock("run", "--", "sh", "-c", 'echo ran; [ "$LANELOCK_STATE" = fail-open ]'))


def test_existing_lock_on_a_read_only_root_still_gates(tmp_path, monkeypatch, mounts, procs):
    mount = tmp_path / "remount"
    if not _mount_tmpfs(mount, "size=1m"):
        pytest.skip("cannot mount a tmpfs here")
    mounts.append(mount)
    monkeypatch.setenv("LANELOCK_DIR", str(mount))
    assert lanelock("run", "--", "true").returncode == 0
    if subprocess.run(["mount", "-o", "remount,ro", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot remount read-only here")
    ready = tmp_path / "ready"
    holder = subprocess.Popen(LANELOCK + ["run", "-q", "--", "sh", "-c",
                                          f'echo "$LANELOCK_STATE" > {ready}; sleep 60'])
    procs.append(holder)
    wait_until(lambda: ready.exists() and ready.read_text().strip(), what="the holder")
    assert ready.read_text().strip() == "held"   # flock on a read-only descriptor
    assert lanelock("run", "--", "true").returncode == 75


def test_full_filesystem_keeps_the_lane_and_warns(tmp_path, monkeypatch, mounts):
    mount = tmp_path / "full"
    if not _mount_tmpfs(mount, "size=64k"):
        pytest.skip("cannot mount a tmpfs here")
    mounts.append(mount)
    monkeypatch.setenv("LANELOCK_DIR", str(mount / "lanes"))
    subprocess.run(["dd", "if=/dev/zero", f"of={mount / 'filler'}", "bs=4k", "count=64"],
                   capture_output=True)
    done = lanelock("run", "--", "sh", "-c", 'echo "$LANELOCK_STATE"')
    assert done.returncode == 0
    assert done.stdout.strip() in ("held", "fail-open")
    if done.stdout.strip() == "held":
        assert "sidecar was not written" in done.stderr or "journal not written" in done.stderr
    else:
        assert done.stderr.count("gate unavailable") == 1


def test_root_under_a_regular_file_and_root_is_a_file(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for root in (blocker / "sub", blocker):
        monkeypatch.setenv("LANELOCK_DIR", str(root))
        assert_fail_open(lanelock("run", "--", "echo", "ran"))


def test_unsafe_root_of_another_user_is_not_trusted(tmp_path, monkeypatch):
    root = tmp_path / "unsafe"
    root.mkdir()
    os.chown(root, 65534, 65534)
    root.chmod(0o777)   # world-writable without the sticky bit: anyone could swap lock files
    monkeypatch.setenv("LANELOCK_DIR", str(root))
    done = lanelock("run", "--", "echo", "ran")
    assert_fail_open(done)
    assert "not trusting it" in done.stderr
    assert not (root / LOCK).exists()


def test_lock_file_replaced_while_held(root, procs, tmp_path):
    ready = tmp_path / "ready"
    holder = subprocess.Popen(LANELOCK + ["run", "-s", "first", "--", "sh", "-c",
                                          f"touch {ready}; sleep 60"])
    procs.append(holder)
    wait_until(ready.exists, what="the holder")
    (root / LOCK).unlink()          # someone "cleans up" the lock file under a live holder
    second = lanelock("run", "--", "echo", "SECOND")
    assert second.returncode == 75 and "SECOND" not in second.stdout
    assert "removed or replaced" in second.stderr
    lane = json.loads(lanelock("status", "--json").stdout)["lanes"][0]
    assert lane["verdict"] == "lock-file-replaced" and lane["state"] == "held"
    holder.kill()
    holder.wait()
    assert_free_and_reusable(root)


# -- symlinks planted by someone else -----------------------------------------------------------

@pytest.fixture
def victim(tmp_path) -> Path:
    path = tmp_path / "victim.txt"
    path.write_text("precious\n")
    return path


def test_symlink_at_the_lock_path_fails_open(root, victim):
    root.mkdir(parents=True)
    (root / LOCK).symlink_to(victim)
    assert_fail_open(lanelock("run", "--", "echo", "ran"))
    assert victim.read_text() == "precious\n"


def test_symlinked_root_fails_open(tmp_path, monkeypatch, victim):
    real = tmp_path / "real-root"
    real.mkdir()
    link = tmp_path / "link-root"
    link.symlink_to(real)
    monkeypatch.setenv("LANELOCK_DIR", str(link))
    assert_fail_open(lanelock("run", "--", "echo", "ran"))
    assert list(real.iterdir()) == []


@pytest.mark.parametrize("name,words", [("localhost-8080.json", "sidecar was not written"),
                                        ("localhost-8080.journal", "journal not written")])
def test_symlinked_sidecar_or_journal_stays_gated_and_warns(root, victim, name, words):
    root.mkdir(parents=True)
    (root / name).symlink_to(victim)
    done = lanelock("run", "--", "sh", "-c", 'echo "$LANELOCK_STATE"')
    assert done.returncode == 0 and done.stdout.strip() == "held"
    assert words in done.stderr
    assert victim.read_text() == "precious\n"
    assert (root / name).is_symlink()


def test_symlink_at_the_sidecar_temp_path_is_not_written_through(root, victim, procs):
    lanelock("run", "--", "true")
    env = dict(os.environ, LANELOCK_DEBUG_PAUSE="before-acquire")
    proc = subprocess.Popen(LANELOCK + ["run", "--", "true"], env=env, stderr=subprocess.PIPE)
    procs.append(proc)
    wait_until(lambda: proc_state(proc.pid) == "T", what="the pause")
    temp = root / f".localhost-8080.json.{proc.pid}.tmp"
    temp.symlink_to(victim)
    os.kill(proc.pid, signal.SIGCONT)
    assert proc.wait(timeout=30) == 0
    assert victim.read_text() == "precious\n"
    record, problem = sidecar.read(str(root / "localhost-8080.json"))
    assert problem is None and record["pid"] == proc.pid


# -- garbage in, no traceback out ---------------------------------------------------------------

GARBAGE = [b"\x00\xff\xfe garbage", b"\xc3\x28 not utf-8", b"[" * 100000, b'{"schema": 99}',
           b'{"schema": 1, "pid": "7", "start_ticks": [1], "argv": {"a": 1}}',
           b'{"schema": 1, "pid": 1000000000000000000000000000000}']


@pytest.mark.parametrize("garbage", GARBAGE, ids=range(len(GARBAGE)))
def test_garbage_sidecar_is_overwritten_by_the_next_holder(root, garbage, procs, tmp_path):
    root.mkdir(parents=True)
    (root / "localhost-8080.json").write_bytes(garbage)
    done = lanelock("run", "--", "true")
    assert done.returncode == 0 and "Traceback" not in done.stderr
    record, problem = sidecar.read(str(root / "localhost-8080.json"))
    assert problem is None and record["exit_status"] == 0


@pytest.mark.parametrize("garbage", GARBAGE[:3], ids=range(3))
def test_deflection_beside_a_garbage_sidecar_names_the_kernel_holder(root, garbage, procs, tmp_path):
    ready = tmp_path / "ready"
    holder = subprocess.Popen(LANELOCK + ["run", "--", "sh", "-c", f"touch {ready}; sleep 60"])
    procs.append(holder)
    wait_until(ready.exists, what="the holder")
    (root / "localhost-8080.json").write_bytes(garbage)
    done = lanelock("run", "--", "true")
    assert done.returncode == 75 and "Traceback" not in done.stderr
    assert f"pid {holder.pid}" in done.stderr


@pytest.mark.parametrize("text", ["grace = \n", "grace = 'x'\n", "bogus = 1\n", "\xff\xfe",
                                  "[[chains.a]]\nnot_a_key = 1\n", "a = [" * 5000])
def test_garbage_config_fails_open_for_run_and_exits_2_elsewhere(tmp_path, monkeypatch, text):
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


def test_hostile_labels_are_one_sanitised_line(root, procs, tmp_path):
    ready = tmp_path / "ready"
    label = "evil\n\x1b[31mRED\x1b[0m" + "x" * 10000
    holder = subprocess.Popen(LANELOCK + ["run", "-s", label, "-m", "m\nodel", "--", "sh", "-c",
                                          f"touch {ready}; sleep 60"])
    procs.append(holder)
    wait_until(ready.exists, what="the holder")
    done = lanelock("run", "--", "true")
    assert done.returncode == 75
    line = done.stderr.strip()
    assert "\n" not in line and "\x1b" not in line and len(line) < 1000
    status = lanelock("status")
    assert len(status.stdout.strip().splitlines()) == 1 and "\x1b" not in status.stdout
    journal_events(root)


def test_command_names_with_spaces(tmp_path):
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


# -- many turns, random kills, zero overlaps ----------------------------------------------------

@pytest.mark.slow
def test_thousand_turns_with_random_kills_never_overlap(root):
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
            proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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
    assert probe_state() == "free"
    journal_events(root)
