"""`lanelock run` with real processes: exit statuses, argv passthrough, the child's environment,
deflection and the fallback chain, fail-open, one gate whatever the environment, nesting, --wait
hand-off, and the probe race. Signals, process lifetime and Ctrl-C: test_run_signals.py."""

from __future__ import annotations

import json
import os
import pwd
import re
import shlex
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from support.cli import LANELOCK, TIMEOUT, needs_flock
from support.kernel_locks import is_waiting
from support.processes import read_line, wait_for

ENV_DUMP = [sys.executable, "-c",
            "import json, os; print(json.dumps({k: v for k, v in os.environ.items() "
            "if k.startswith('LANELOCK_')}))"]
FAIL_OPEN_LINE = re.compile(r"^lanelock: warning: gate unavailable \(.+\); running without it$")
MINIMAL_PATH = "/usr/bin:/bin"
# A held command that reports its lock path too: "ready PID LOCK_PATH".
HOLD_WITH_PATH = 'echo "ready $$ $LANELOCK_LOCK_PATH"; read code; exit "${code:-0}"'


def child_env(result) -> dict:
    assert result.returncode == 0, (result.returncode, result.stderr)
    return json.loads(result.stdout)


def busy_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "local_backend_busy" in line]


# -- exit statuses ------------------------------------------------------------------------------
@pytest.mark.parametrize("status", [0, 1, 3, 42, 255])
def test_the_child_exit_status_passes_through(status, lanelock, lock_dir):
    result = lanelock("run", "--", "sh", "-c", f"exit {status}")
    assert result.returncode == status
    assert result.stderr == ""
    assert json.loads((lock_dir / "localhost-8080.json").read_text())["exit_status"] == status


@pytest.mark.parametrize("signo", [signal.SIGTERM, signal.SIGUSR1, signal.SIGKILL])
def test_a_child_killed_by_a_signal_gives_128_plus_n(signo, lanelock):
    result = lanelock("run", "--", "sh", "-c", f"kill -{int(signo)} $$")
    assert result.returncode == 128 + signo


def test_busy_with_no_fallback_exits_75(holder, lanelock, tmp_path):
    held = holder()
    marker = tmp_path / "ran"
    result = lanelock("run", "--", "touch", marker)
    assert result.returncode == 75
    assert not marker.exists()
    assert held.release() == 0


def test_busy_exit_code_changes_the_busy_status(holder, lanelock):
    held = holder()
    assert lanelock("run", "--busy-exit-code", "9", "--", "true").returncode == 9
    assert lanelock("run", "-E", "0", "--", "true").returncode == 0
    assert held.release() == 0


def test_a_file_that_is_not_executable_gives_126(lanelock, tmp_path):
    script = tmp_path / "script.sh"
    script.write_text("#!/bin/sh\necho hello\n")
    script.chmod(0o644)   # root too needs an execute bit to exec a file
    result = lanelock("run", "--", script)
    assert result.returncode == 126
    assert result.stdout == ""
    assert result.stderr.splitlines() == [f"lanelock: {script}: cannot execute: Permission denied"]


def test_a_directory_as_the_command_gives_126(lanelock, tmp_path):
    assert lanelock("run", "--", tmp_path).returncode == 126


@pytest.mark.parametrize("command", ["no-such-command-lanelock-test", "/nonexistent/dir/cmd"])
def test_a_missing_command_gives_127(command, lanelock):
    result = lanelock("run", "--", command)
    assert result.returncode == 127
    assert result.stderr.splitlines() == [f"lanelock: {command}: command not found"]


def test_a_missing_command_releases_the_lane(lanelock):
    assert lanelock("run", "--", "no-such-command-lanelock-test").returncode == 127
    assert lanelock("probe").returncode == 0


def assert_one_usage_line(result) -> None:
    assert result.returncode == 2, (result.returncode, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("lanelock:"), result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("flags", [
    ["--no-such-flag"], ["--busy-exit-code", "300"], ["--wait", "-1"], ["--key-by", "colour"],
    ["--fallback", "'unclosed"], ["--fallback", "@"], ["--fallback", ""], ["--grace", "soon"],
    ["--chain", "undefined"],
])
def test_bad_flags_give_2_with_one_line_and_nothing_runs(flags, lanelock, tmp_path):
    marker = tmp_path / "ran"
    assert_one_usage_line(lanelock("run", *flags, "--", "touch", marker))
    assert not marker.exists()


@pytest.mark.parametrize("args", [["run"], ["run", "--"], ["no-such-subcommand"]])
def test_a_missing_command_or_subcommand_gives_2(args, lanelock):
    assert_one_usage_line(lanelock(*args))


# -- the child's argv passes through untouched -------------------------------------------------
def test_flags_after_the_double_dash_go_to_the_command(lanelock):
    result = lanelock("run", "--", "printf", "%s\n", "--help", "-h", "-q", "--", "--wait")
    assert (result.returncode, result.stdout) == (0, "--help\n-h\n-q\n--\n--wait\n")


def test_flags_after_the_command_name_go_to_the_command(lanelock):
    result = lanelock("run", "printf", "%s\n", "-h", "--help", "-v")
    assert (result.returncode, result.stdout) == (0, "-h\n--help\n-v\n")
    assert result.stderr == ""   # lanelock's own -v was not taken


def test_the_command_gets_its_arguments_verbatim(lanelock):
    words = ["a b", "", "*", "$HOME", "'q'", "ü", "-"]
    result = lanelock("run", "--", sys.executable, "-c",
                      "import json, sys; print(json.dumps(sys.argv[1:]))", *words)
    assert json.loads(result.stdout) == words


# -- the child's environment -------------------------------------------------------------------
def test_held_turn_environment(lanelock, lock_dir):
    env = child_env(lanelock("run", "--", *ENV_DUMP))
    assert env["LANELOCK_STATE"] == "held"
    assert env["LANELOCK_LANE"] == "localhost:8080"
    assert env["LANELOCK_LOCK_PATH"] == str(lock_dir / "localhost-8080.lock")
    assert "LANELOCK_FAILOVER_REASON" not in env


def test_a_stale_failover_reason_is_not_passed_on(lanelock):
    env = child_env(lanelock("run", "--", *ENV_DUMP,
                             env={"LANELOCK_FAILOVER_REASON": "local_backend_busy"}))
    assert "LANELOCK_FAILOVER_REASON" not in env


def test_deflected_turn_environment(holder, lanelock, lock_dir):
    held = holder()
    result = lanelock("run", "--fallback", shlex.join(ENV_DUMP), "--", "false")
    env = child_env(result)
    assert env["LANELOCK_STATE"] == "deflected"
    assert env["LANELOCK_FAILOVER_REASON"] == "local_backend_busy"
    assert env["LANELOCK_LANE"] == "localhost:8080"
    assert env["LANELOCK_LOCK_PATH"] == str(lock_dir / "localhost-8080.lock")
    assert held.release() == 0


@pytest.mark.parametrize("backend", ["api.openai.com:443", "https://api.openai.com/v1", "8.8.8.8:53"])
def test_ungated_turn_environment_and_no_lock_file(backend, lanelock, lock_dir):
    env = child_env(lanelock("run", "--backend", backend, "--", *ENV_DUMP))
    assert env["LANELOCK_STATE"] == "ungated"
    assert not lock_dir.exists() or not list(lock_dir.iterdir())


def test_fail_open_turn_environment(lanelock, tmp_path):
    (tmp_path / "file").write_text("not a directory\n")
    env = child_env(lanelock("run", "--", *ENV_DUMP, env={"LANELOCK_DIR": tmp_path / "file" / "sub"}))
    assert env["LANELOCK_STATE"] == "fail-open"


# -- deflection and the fallback chain ---------------------------------------------------------
def test_deflection_prints_one_line_naming_the_holder(holder, lanelock, tmp_path):
    held = holder("--session", "alice-chat", "--model", "qwen-7b")
    marker = tmp_path / "fallback-ran"
    result = lanelock("run", "--fallback", f"touch {marker}", "--", "false")
    assert result.returncode == 0 and marker.exists()
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    line = lines[0]
    assert line.startswith("lanelock: ")
    assert "local_backend_busy" in line and "local model in use by another session" in line
    assert f"pid {held.pid}" in line
    assert "session alice-chat" in line and "model qwen-7b" in line
    assert re.search(r"held \d+\.\ds", line), line
    assert held.release() == 0


def test_hostile_labels_cannot_break_the_one_deflection_line(holder, lanelock):
    held = holder("--session", "evil\nsession\x1b[31m", "--model", "m\r\nlanelock: fake")
    result = lanelock("run", "--", "true")
    assert result.returncode == 75
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert "\x1b" not in result.stderr and "\r" not in result.stderr
    assert held.release() == 0


def test_busy_without_fallback_prints_one_line_too(holder, lanelock):
    held = holder()
    result = lanelock("run", "--", "true")
    lines = result.stderr.splitlines()
    assert result.returncode == 75 and len(lines) == 1
    assert "local_backend_busy" in lines[0] and "local model in use by another session" in lines[0]
    assert f"pid {held.pid}" in lines[0]
    assert held.release() == 0


@pytest.mark.parametrize("busy_spelling", ["127.0.0.1:8080", "localhost:8080", "http://[::1]:8080/v1"])
def test_fallback_chain_skips_the_busy_lane_itself(busy_spelling, holder, lanelock, tmp_path):
    held = holder()
    skipped, ran = tmp_path / "skipped", tmp_path / "ran"
    result = lanelock("run", "-f", f"@{busy_spelling} touch {skipped}", "-f", f"touch {ran}",
                      "--", "false")
    assert result.returncode == 0, result.stderr
    assert ran.exists() and not skipped.exists()
    assert "fallback 1 skipped" in result.stderr
    assert len(busy_lines(result.stderr)) == 1 and "fallback 2" in busy_lines(result.stderr)[0]
    assert held.release() == 0


def test_fallback_chain_skips_another_busy_local_lane(holder, lanelock, tmp_path):
    held = holder()
    other = holder("--backend", "127.0.0.1:8081")
    skipped, ran = tmp_path / "skipped", tmp_path / "ran"
    result = lanelock("run", "-f", f"@127.0.0.1:8081 touch {skipped}", "-f", f"touch {ran}",
                      "--", "false")
    assert result.returncode == 0 and ran.exists() and not skipped.exists()
    assert "busy local lane" in result.stderr
    assert other.release() == 0 and held.release() == 0


def test_fallback_bound_to_another_local_lane_holds_that_lane(holder, lanelock, tmp_path):
    held = holder()
    rcfile = tmp_path / "probe-rc"
    inner = f"{sys.executable} -m lanelock probe -b 127.0.0.1:8081 >/dev/null; echo $? > {rcfile}"
    result = lanelock("run", "-f", f"@127.0.0.1:8081 sh -c '{inner}; printenv LANELOCK_STATE'",
                      "--", "false")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "deflected"
    assert rcfile.read_text().strip() == "1", "the fallback's own lane was not held while it ran"
    assert lanelock("probe", "-b", "127.0.0.1:8081").returncode == 0   # released afterwards
    assert held.release() == 0


def test_fallback_bound_to_a_public_backend_runs_ungated(holder, lanelock, lock_dir):
    held = holder()
    result = lanelock("run", "-f", "@api.openai.com:443 printenv LANELOCK_STATE", "--", "false")
    assert (result.returncode, result.stdout.strip()) == (0, "deflected")
    assert sorted(path.name for path in lock_dir.glob("*.lock")) == ["localhost-8080.lock"]
    assert held.release() == 0


def test_a_malformed_fallback_backend_is_a_usage_error_and_nothing_runs(lanelock, tmp_path):
    marker = tmp_path / "ran"
    result = lanelock("run", "-f", "@host: true", "--", "touch", marker)
    assert result.returncode == 2 and not marker.exists()


def test_a_malformed_fallback_backend_when_busy_is_a_usage_error(holder, lanelock, tmp_path):
    held = holder()
    result = lanelock("run", "-f", "@host:abc true", "-f", "true", "--", "true")
    assert result.returncode == 2, result.stderr
    assert "internal error" not in result.stderr
    assert held.release() == 0


def test_a_fallback_that_cannot_start_is_skipped(holder, lanelock, tmp_path):
    held = holder()
    ran = tmp_path / "ran"
    result = lanelock("run", "-f", "no-such-command-lanelock-test", "-f", f"touch {ran}", "--", "false")
    assert result.returncode == 0 and ran.exists()
    assert "fallback 1 did not start" in result.stderr
    assert held.release() == 0


def test_the_fallback_exit_status_is_the_turns(holder, lanelock):
    held = holder()
    assert lanelock("run", "-f", "sh -c 'exit 7'", "--", "true").returncode == 7
    assert held.release() == 0


def test_no_fallback_could_run_gives_the_busy_status(holder, lanelock):
    held = holder()
    result = lanelock("run", "-f", "@127.0.0.1:8080 true", "-E", "11", "--", "true")
    assert result.returncode == 11
    assert held.release() == 0


# -- ungated backends --------------------------------------------------------------------------
def test_public_backend_runs_at_once_while_the_local_lane_is_held(holder, lanelock, lock_dir):
    held = holder()
    result = lanelock("run", "-b", "api.openai.com:443", "--", "printenv", "LANELOCK_STATE")
    assert (result.returncode, result.stdout.strip(), result.stderr) == (0, "ungated", "")
    assert not [path for path in lock_dir.iterdir() if "openai" in path.name]
    assert held.release() == 0


def test_gate_flag_gates_a_public_backend(lanelock, lock_dir):
    result = lanelock("run", "--gate", "-b", "api.openai.com:443", "--", "printenv", "LANELOCK_STATE")
    assert result.stdout.strip() == "held"
    assert (lock_dir / "api.openai.com-443.lock").is_file()


def test_no_gate_flag_skips_the_gate_for_a_local_backend(holder, lanelock):
    held = holder()
    result = lanelock("run", "--no-gate", "--", "printenv", "LANELOCK_STATE")
    assert (result.returncode, result.stdout.strip()) == (0, "ungated")
    assert held.release() == 0


# -- fail open ---------------------------------------------------------------------------------
def assert_failed_open(result, marker: Path, status: int = 3) -> None:
    assert result.returncode == status, result.stderr
    assert marker.exists(), "the command did not run"
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and FAIL_OPEN_LINE.match(lines[0]), result.stderr


def fail_open_run(lanelock, marker: Path, lock_root: Path | str):
    return lanelock("run", "--", "sh", "-c", 'touch "$0"; exit 3', marker,
                    env={"LANELOCK_DIR": lock_root})


def test_fail_open_when_the_lock_root_is_under_a_regular_file(lanelock, tmp_path):
    (tmp_path / "file").write_text("x")
    marker = tmp_path / "ran"
    assert_failed_open(fail_open_run(lanelock, marker, tmp_path / "file" / "sub"), marker)


def test_fail_open_when_the_lock_root_is_a_regular_file(lanelock, tmp_path):
    (tmp_path / "file").write_text("x")
    marker = tmp_path / "ran"
    assert_failed_open(fail_open_run(lanelock, marker, tmp_path / "file"), marker)
    assert (tmp_path / "file").read_text() == "x"


@pytest.mark.parametrize("dangling", [False, True])
def test_fail_open_on_a_symlink_at_the_lock_path(dangling, lanelock, lock_dir, tmp_path):
    victim = tmp_path / "victim"
    if not dangling:
        victim.write_text("precious\n")
    lock_dir.mkdir()
    (lock_dir / "localhost-8080.lock").symlink_to(victim)
    marker = tmp_path / "ran"
    assert_failed_open(fail_open_run(lanelock, marker, lock_dir), marker)
    if dangling:
        assert not victim.exists(), "a file was created through the symlink"
    else:
        assert victim.read_text() == "precious\n"


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_a_lock_path_that_is_not_a_regular_file_deflects(kind, lanelock, lock_dir, tmp_path):
    """Whoever may write the root could plant it: failing open there would switch the gate off
    for everyone, so the lane is busy, with the reason, until it is removed (test_threat.py)."""
    lock_dir.mkdir()
    path = lock_dir / "localhost-8080.lock"
    path.mkdir() if kind == "directory" else os.mkfifo(path)
    marker = tmp_path / "ran"
    done = fail_open_run(lanelock, marker, lock_dir)
    assert done.returncode == 75 and not marker.exists(), done
    assert "is not a regular file: remove it" in done.stderr, done.stderr


@pytest.fixture
def read_only_mount(tmpfs):
    return tmpfs("ro,size=64k")


@pytest.mark.parametrize("under", [".", "locks"])
def test_fail_open_on_a_read_only_mount(under, read_only_mount, lanelock, tmp_path):
    marker = tmp_path / "ran"
    assert_failed_open(fail_open_run(lanelock, marker, read_only_mount / under), marker)


def test_fail_open_when_no_lock_file_can_be_created_enospc(tmpfs, lanelock, tmp_path):
    root = tmpfs("size=64k,nr_inodes=2") / "locks"   # the mount's root and this dir: no inode left
    root.mkdir()
    marker = tmp_path / "ran"
    assert_failed_open(fail_open_run(lanelock, marker, root), marker)


def test_a_full_disk_once_held_is_only_a_warning(tmpfs, lanelock):
    mount_point = tmpfs("size=4k")
    root = mount_point / "locks"
    root.mkdir()
    fd = os.open(mount_point / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        with pytest.raises(OSError, match="No space left"):
            while True:
                os.write(fd, b"\0" * 4096)
    finally:
        os.close(fd)
    inner = f"{sys.executable} -m lanelock probe >/dev/null; echo probe=$?; exit 3"
    result = lanelock("run", "--", "sh", "-c", inner, env={"LANELOCK_DIR": root})
    assert result.returncode == 3
    assert result.stdout.strip() == "probe=1", "the lane was not held while the disk was full"
    assert "gate unavailable" not in result.stderr
    assert result.stderr and all(line.startswith("lanelock: warning:")
                                 for line in result.stderr.splitlines()), result.stderr


def test_quiet_silences_the_fail_open_warning(lanelock, tmp_path):
    (tmp_path / "file").write_text("x")
    result = lanelock("run", "-q", "--", "sh", "-c", "exit 3", env={"LANELOCK_DIR": tmp_path / "file"})
    assert (result.returncode, result.stderr) == (3, "")


def test_a_sidecar_that_cannot_be_written_keeps_the_lock(lanelock, lock_dir, tmp_path):
    lock_dir.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (lock_dir / "localhost-8080.json").symlink_to(victim)
    inner = f"{sys.executable} -m lanelock probe >/dev/null; echo probe=$?; printenv LANELOCK_STATE"
    result = lanelock("run", "--", "sh", "-c", inner)
    assert result.returncode == 0
    assert result.stdout.split() == ["probe=1", "held"]
    assert "holder record was not written" in result.stderr and "gate unavailable" not in result.stderr
    assert victim.read_text() == "precious\n"


# -- -q and -v ---------------------------------------------------------------------------------
def test_quiet_silences_deflection_notes(holder, lanelock, tmp_path):
    held = holder()
    assert lanelock("run", "-q", "--", "true").stderr == ""
    result = lanelock("run", "-q", "-f", "@127.0.0.1:8080 true", "-f", "true", "--", "true")
    assert (result.returncode, result.stderr) == (0, "")
    assert held.release() == 0


def test_verbose_prints_the_lock_path(lanelock, lock_dir):
    result = lanelock("run", "-v", "--", "true")
    assert result.returncode == 0
    assert str(lock_dir / "localhost-8080.lock") in result.stderr
    assert "waited" in result.stderr


def test_verbose_reports_the_wait_when_deflected(holder, lanelock):
    held = holder()
    result = lanelock("run", "-v", "--", "true")
    assert result.returncode == 75 and "waited" in result.stderr
    assert held.release() == 0


# -- one gate whatever the environment ---------------------------------------------------------
def cron_argv(home: Path, lock_dir: Path, tmp_path: Path, *lanelock_args) -> list[str]:
    """A cron-like invocation: env -i, minimal PATH, no XDG variables, another HOME."""
    return ["env", "-i", f"PATH={MINIMAL_PATH}", f"HOME={home}", f"LANELOCK_DIR={lock_dir}",
            f"LANELOCK_SYSTEM_CONFIG={tmp_path / 'no-such-system-config.toml'}",
            *LANELOCK, *lanelock_args]


def test_sessions_with_other_homes_and_env_i_contend_on_one_lock_file(holder, run_cmd, lanelock,
                                                                       lock_dir, tmp_path):
    for name in ("home-a", "home-b", "home-c", "cwd-a", "cwd-b", "xdg-a", "xdg-c"):
        (tmp_path / name).mkdir()
    held = holder(command=["sh", "-c", HOLD_WITH_PATH], cwd=tmp_path / "cwd-a",
                  env={"HOME": tmp_path / "home-a", "XDG_RUNTIME_DIR": tmp_path / "xdg-a"})
    held_path = held.ready_line.split()[2]
    assert held_path == str(lock_dir / "localhost-8080.lock")

    cron = run_cmd(cron_argv(tmp_path / "home-b", lock_dir, tmp_path,
                             "run", "-f", "printenv LANELOCK_LOCK_PATH", "--", "false"),
                   cwd=tmp_path / "cwd-b", env={})
    assert cron.returncode == 0, cron.stderr
    assert cron.stdout.strip() == held_path
    assert len(busy_lines(cron.stderr)) == 1 and f"pid {held.pid}" in cron.stderr

    profile = lanelock("run", "-f", "printenv LANELOCK_LOCK_PATH", "--", "false", cwd=tmp_path,
                       env={"HOME": tmp_path / "home-c", "XDG_RUNTIME_DIR": tmp_path / "xdg-c",
                            "XDG_CONFIG_HOME": tmp_path / "xdg-c", "LANELOCK_CONFIG": None})
    assert (profile.returncode, profile.stdout.strip()) == (0, held_path)
    assert len(busy_lines(profile.stderr)) == 1
    assert held.release() == 0


def test_the_default_root_is_the_same_for_every_environment(run_cmd, lanelock, tmp_path,
                                                            default_root):
    """No LANELOCK_DIR: an ordinary shell, a cron job and an agent profile (each with its own HOME,
    XDG variables and cwd) compute the same default lock file. Only `where`: no lock is taken."""
    for name in ("h1", "h2", "h3", "c2", "c3", "xdg3", "conf3/lanelock"):
        (tmp_path / name).mkdir(parents=True)
    # A per-user config that tries to move the root: it must be ignored, and said so.
    (tmp_path / "conf3" / "lanelock" / "config.toml").write_text(f'lock_dir = "{tmp_path}/evil"\n')
    system = tmp_path / "no-such-system-config.toml"
    shell = lanelock("where", "--json", env={"HOME": tmp_path / "h1"})
    cron = run_cmd(["env", "-i", f"PATH={MINIMAL_PATH}", f"HOME={tmp_path / 'h2'}",
                    f"LANELOCK_SYSTEM_CONFIG={system}", *LANELOCK, "where", "--json"],
                   cwd=tmp_path / "c2", env={})
    profile = run_cmd(["env", "-i", f"PATH={MINIMAL_PATH}:/usr/local/bin", f"HOME={tmp_path / 'h3'}",
                       f"XDG_RUNTIME_DIR={tmp_path / 'xdg3'}", f"XDG_CONFIG_HOME={tmp_path / 'conf3'}",
                       f"LANELOCK_SYSTEM_CONFIG={system}", "USER=agent", "LOGNAME=agent",
                       *LANELOCK, "where", "--json"], cwd=tmp_path / "c3", env={})
    infos = []
    for result in (shell, cron, profile):
        assert result.returncode == 0, result.stderr
        infos.append(json.loads(result.stdout))
    assert len({info["lock_path"] for info in infos}) == 1, [info["lock_path"] for info in infos]
    assert {info["root_source"] for info in infos} == {"default"}
    assert infos[0]["root"] == str(default_root) in ("/run/lock/lanelock", "/tmp/lanelock")
    assert "IGNORED" in profile.stderr and infos[2]["warnings"]
    assert not (tmp_path / "evil").exists()


# -- nested turns ------------------------------------------------------------------------------
@pytest.mark.parametrize("inner_flags", [[], ["--wait"], ["--wait", "10"], ["-b", "localhost:8080"]])
def test_a_nested_run_of_the_same_lane_runs_straight_through(inner_flags, lanelock):
    result = lanelock("run", "--", *LANELOCK, "run", *inner_flags, "--", "printenv", "LANELOCK_STATE",
                      timeout=30)
    assert (result.returncode, result.stdout.strip()) == (0, "held"), result.stderr
    assert "local_backend_busy" not in result.stderr


def test_a_nested_run_through_a_shell_keeps_the_outer_turn(lanelock):
    inner = (f"{sys.executable} -m lanelock run -v -- true; "
             f"{sys.executable} -m lanelock probe >/dev/null; echo probe=$?")
    result = lanelock("run", "--", "sh", "-c", inner, timeout=30)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "probe=1", "the nested turn let go of the outer turn's lane"
    assert "nested" in result.stderr and "local_backend_busy" not in result.stderr


def test_a_nested_run_exit_status_passes_through(lanelock):
    result = lanelock("run", "--", *LANELOCK, "run", "--", "sh", "-c", "exit 5", timeout=30)
    assert result.returncode == 5


# -- --wait ------------------------------------------------------------------------------------
@pytest.mark.parametrize("wait_flags", [["--wait"], ["--wait", "30"], ["-w", "30"]])
def test_a_waiting_turn_starts_after_the_holder_releases(wait_flags, holder, procs, lock_dir, tmp_path):
    held = holder()
    marker = tmp_path / "waiter-ran"
    waiter = procs.start([*LANELOCK, "run", *wait_flags, "--", "sh", "-c", 'touch "$0"', marker],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lock = lock_dir / "localhost-8080.lock"
    wait_for(lambda: is_waiting(lock, waiter.pid) or waiter.poll() is not None,
             what="the waiter to block in flock()")
    assert waiter.poll() is None, waiter.communicate()
    assert not marker.exists()
    assert held.release() == 0
    out, err = waiter.communicate(timeout=TIMEOUT)
    assert waiter.returncode == 0, err
    assert marker.exists()
    assert "local_backend_busy" not in err


def test_a_bounded_wait_that_expires_exits_75(holder, lanelock):
    held = holder()
    result = lanelock("run", "--wait", "0.2", "--", "true")
    assert result.returncode == 75
    assert len(busy_lines(result.stderr)) == 1
    assert held.release() == 0


def test_a_bounded_wait_that_expires_falls_back(holder, lanelock, tmp_path):
    held = holder()
    ran = tmp_path / "ran"
    result = lanelock("run", "--wait", "0.2", "-f", f"touch {ran}", "--", "true")
    assert result.returncode == 0 and ran.exists()
    assert held.release() == 0


# -- the probe race ----------------------------------------------------------------------------
@needs_flock
def test_probes_racing_with_turns_never_make_a_turn_deflect(procs, lanelock, lock_dir, tmp_path):
    assert lanelock("run", "--", "true").returncode == 0     # the lock file exists from here on
    lock = lock_dir / "localhost-8080.lock"
    stop = tmp_path / "stop"
    flock_loop = procs.start(
        ["sh", "-c", 'n=0; busy=0; echo started; while [ ! -e "$0" ]; do '
         'flock -n "$1" true || busy=$((busy+1)); n=$((n+1)); done; echo "$n $busy"', stop, lock],
        stdout=subprocess.PIPE)
    probe_loop = procs.start(
        ["sh", "-c", f'n=0; echo started; while [ ! -e "$0" ]; do {sys.executable} -m lanelock probe '
         '>/dev/null 2>&1; n=$((n+1)); done; echo "$n"', stop],
        stdout=subprocess.PIPE)
    for loop in (flock_loop, probe_loop):
        assert read_line(loop.stdout) == "started\n"
    # The prober's hold lasts microseconds, but a loaded 2-core machine can keep a prober off
    # the CPU while it holds for longer than the default grace (50 ms): the grace a loaded
    # machine needs, as docs/running.md advises. What is proved is the mechanism: the turn rides
    # out a hold by waiting in the kernel, never deflecting for it.
    turns = procs.start(
        ["sh", "-c", f'for i in $(seq 30); do {sys.executable} -m lanelock run --grace 1 -- true '
         '|| echo "turn $i exit $?"; done'],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = turns.communicate(timeout=120)
    stop.touch()
    counts = [loop.communicate(timeout=TIMEOUT)[0].decode().split() for loop in (flock_loop, probe_loop)]
    assert turns.returncode == 0 and out == "", out
    assert "local_backend_busy" not in err, err
    assert int(counts[0][0]) > 30 and int(counts[1][0]) >= 1, counts


# -- more of the turn's contract ---------------------------------------------------------------
def test_stdin_and_stdout_belong_to_the_child(lanelock):
    result = lanelock("run", "--", "cat", input="prompt text\n")
    assert (result.returncode, result.stdout, result.stderr) == (0, "prompt text\n", "")


def test_the_child_starts_with_default_sigpipe(run_cmd):
    """Python ignores SIGPIPE for itself; the child must not inherit that (`yes | head` ends by
    SIGPIPE, exit 141, without an EPIPE error message)."""
    script = f'{sys.executable} -m lanelock run -- yes | head -n 1 >/dev/null; echo "${{PIPESTATUS[0]}}"'
    result = run_cmd(["bash", "-c", script])
    assert result.stdout.strip() == "141", result.stderr
    assert "Broken pipe" not in result.stderr


def test_an_ignored_sigint_stays_ignored_for_the_child(procs):
    """`cmd &` in a script starts cmd with SIGINT ignored; under lanelock it must stay so."""
    probe = [sys.executable, "-c",
             "import signal; print(signal.getsignal(signal.SIGINT) is signal.SIG_IGN)"]
    proc = procs.start([*LANELOCK, "run", "--", *probe], stdout=subprocess.PIPE, text=True,
                       preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    out, _ = proc.communicate(timeout=TIMEOUT)
    assert out.strip() == "True"


AGENT = """#!{python}
import os, subprocess, sys
lanelock = [sys.executable, "-m", "lanelock", "run", "--", "printenv", "LANELOCK_SESSION"]
if sys.argv[1:] == ["shell"]:   # through a shell and env, as agents' tool calls run
    lanelock = ["sh", "-c", 'env "$@"', "sh", *lanelock]
said = subprocess.run(lanelock, stdout=subprocess.PIPE, text=True).stdout.strip()
print(os.getpid(), said)
"""


@pytest.mark.parametrize("how", ["direct", "shell"])
def test_without_a_terminal_the_session_names_the_program_that_started_the_turn(how, run_cmd,
                                                                               tmp_path):
    """Agents without a terminal were all 'root@cron': the label names the program that started
    the turn (shells and env passed over) and its pid, as a terminal's label names the terminal."""
    agent = tmp_path / "myagent"
    agent.write_text(AGENT.format(python=sys.executable))
    agent.chmod(0o755)
    done = run_cmd([str(agent), how])   # no terminal: procs starts it in a session of its own
    pid, said = done.stdout.split()
    assert said == f"{pwd.getpwuid(os.getuid()).pw_name}@myagent/{pid}", done


def test_a_turn_that_cron_started_is_labelled_cron(run_cmd, tmp_path):
    cron = tmp_path / "cron"   # a program named cron, as the daemon's child sees its parent
    cron.write_text(f"#!/bin/sh\nsh -c '{sys.executable} -m lanelock run -- printenv "
                    "LANELOCK_SESSION; true'\ntrue\n")
    cron.chmod(0o755)
    done = run_cmd([str(cron)])
    assert done.stdout.strip() == f"{pwd.getpwuid(os.getuid()).pw_name}@cron", done


def test_the_session_label_can_be_given(lanelock):
    labelled = lanelock("run", "-s", "chat-1", "--", "printenv", "LANELOCK_SESSION")
    assert labelled.stdout.strip() == "chat-1"
    from_env = lanelock("run", "--", "printenv", "LANELOCK_SESSION", env={"LANELOCK_SESSION": "env-1"})
    assert from_env.stdout.strip() == "env-1"


def test_the_lock_root_and_files_are_shared_modes(lanelock, lock_dir):
    assert lanelock("run", "--", "true").returncode == 0
    assert stat.S_IMODE(os.stat(lock_dir).st_mode) == 0o1777
    assert stat.S_IMODE(os.stat(lock_dir / "localhost-8080.lock").st_mode) == 0o644


@needs_flock
def test_flock_1_and_lanelock_exclude_each_other(procs, lanelock, lock_dir):
    lock_dir.mkdir(mode=0o1777)
    lock = lock_dir / "localhost-8080.lock"
    holder = procs.start(["flock", lock, "sh", "-c", 'echo "ready $$"; read x; exit 0'],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert read_line(holder.stdout).startswith("ready ")
    result = lanelock("run", "--", "true")
    assert result.returncode == 75
    line = busy_lines(result.stderr)[0]
    assert f"pid {holder.pid}" in line and "not a lanelock turn" in line
    holder.stdin.close()
    assert holder.wait(timeout=TIMEOUT) == 0
    assert lanelock("run", "--", "true").returncode == 0


@needs_flock
def test_a_stale_sidecar_never_names_the_holder(holder, procs, lanelock, lock_dir):
    """After kill -9 the sidecar still names the dead wrapper; the kernel knows the real holder."""
    dead = holder()
    os.kill(dead.pid, signal.SIGKILL)
    dead.wait()
    lock = lock_dir / "localhost-8080.lock"
    other = procs.start(["flock", lock, "sh", "-c", 'echo "ready $$"; read x; exit 0'],
                        stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert read_line(other.stdout).startswith("ready ")
    line = busy_lines(lanelock("run", "--", "true").stderr)[0]
    assert f"pid {other.pid}" in line and f"pid {dead.pid}" not in line
    other.stdin.close()
    assert other.wait(timeout=TIMEOUT) == 0


def test_fail_open_when_the_lock_root_parent_is_missing(lanelock, tmp_path):
    marker = tmp_path / "ran"
    assert_failed_open(fail_open_run(lanelock, marker, tmp_path / "missing" / "deeper"), marker)


def test_fail_open_on_a_broken_config_file(lanelock, tmp_path):
    config = tmp_path / "config.toml"
    config.write_text("this is = = not toml\n")
    marker = tmp_path / "ran"
    result = lanelock("run", "--", "sh", "-c", 'touch "$0"; exit 3', marker,
                      env={"LANELOCK_CONFIG": config})
    assert_failed_open(result, marker)


def test_a_fallback_chain_from_the_config_file(holder, lanelock, tmp_path):
    config = tmp_path / "config.toml"
    skipped, ran = tmp_path / "skipped", tmp_path / "ran"
    config.write_text(
        '[[chains.local-first]]\n'
        f'backend = "localhost:8080"\ncommand = "touch {skipped}"\n'
        '[[chains.local-first]]\n'
        f'command = ["touch", "{ran}"]\n')
    held = holder()
    env = {"LANELOCK_CONFIG": config}
    result = lanelock("run", "--chain", "local-first", "--", "false", env=env)
    assert result.returncode == 0, result.stderr
    assert ran.exists() and not skipped.exists()
    unknown = lanelock("run", "--chain", "nope", "--", "true", env=env)
    assert unknown.returncode == 2 and unknown.stderr.startswith("lanelock:")
    assert held.release() == 0


def test_a_file_that_is_not_a_program_gives_126(lanelock, tmp_path):
    garbage = tmp_path / "garbage"
    garbage.write_bytes(b"\x7fELF\x00\x01garbage")
    garbage.chmod(0o755)
    assert lanelock("run", "--", garbage).returncode == 126


def test_the_lock_file_is_never_unlinked(lanelock, lock_dir):
    assert lanelock("run", "--", "true").returncode == 0
    inode = os.stat(lock_dir / "localhost-8080.lock").st_ino
    assert lanelock("run", "--", "sh", "-c", "exit 1").returncode == 1
    assert lanelock("run", "--", "no-such-command-lanelock-test").returncode == 127
    assert os.stat(lock_dir / "localhost-8080.lock").st_ino == inode


def test_path_search_skips_a_non_executable_and_reports_126_when_none_runs(lanelock, tmp_path):
    """The wrapper searches PATH itself (as execvp would): a non-executable match is skipped for a
    later executable one; if only non-executable ones exist, the status is 126, not 127."""
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    (first / "lanelock-probe-cmd").write_text("#!/bin/sh\necho first\n")
    (second / "lanelock-probe-cmd").write_text("#!/bin/sh\necho second\n")
    (second / "lanelock-probe-cmd").chmod(0o755)
    path = f"{first}:{second}:{os.environ['PATH']}"
    done = lanelock("run", "--", "lanelock-probe-cmd", env={"PATH": path})
    assert done.returncode == 0 and done.stdout.strip() == "second"
    (second / "lanelock-probe-cmd").chmod(0o644)
    done = lanelock("run", "--", "lanelock-probe-cmd", env={"PATH": path})
    assert done.returncode == 126 and "cannot execute" in done.stderr
