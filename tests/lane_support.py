"""Shared by the status and history suites: an isolated lock root, a registry that kills every
process a test starts, and a holder that holds the lane until the test lets go. Synchronisation is
never a sleep: the holder's child prints "ready PID" on a pipe and waits for its exit status on
stdin.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import Processes as SharedProcesses
from conftest import read_line  # noqa: F401 - re-exported for the suites
from conftest import wait_for as shared_wait_for
from lanelock import holders

LANELOCK = [sys.executable, "-m", "lanelock"]
TIMEOUT = 60.0
LANE = "localhost:8080"
STEM = "localhost-8080"
HOLD_SCRIPT = 'echo "ready $$"; read code; exit "${code:-0}"'


# -- isolation and processes -----------------------------------------------------------------------
@pytest.fixture(autouse=True)
def root(request, tmp_path, monkeypatch) -> Path:
    """A fresh lock root (not created: the first turn makes it) and no configuration files."""
    if "isolated" in request.fixturenames:   # a shared conftest isolation runs first; ours wins
        request.getfixturevalue("isolated")
    for name in list(os.environ):
        if name.startswith("LANELOCK_"):
            monkeypatch.delenv(name)
    for name in ("NO_COLOR", "FORCE_COLOR", "CLICOLOR_FORCE"):
        monkeypatch.delenv(name, raising=False)
    lock_root = tmp_path / "root"
    monkeypatch.setenv("LANELOCK_DIR", str(lock_root))
    monkeypatch.setenv("LANELOCK_SYSTEM_CONFIG", str(tmp_path / "no-such-system.toml"))
    monkeypatch.setenv("LANELOCK_CONFIG", str(tmp_path / "no-such-user.toml"))
    return lock_root


class Processes(SharedProcesses):
    """conftest's registry (every process killed by pid and group at teardown), taking any
    path-like words in argv."""

    def start(self, argv, **kwargs) -> subprocess.Popen:
        return super().start([str(word) for word in argv], **kwargs)


@pytest.fixture
def procs(root):
    """The registry; after the test everything it started is killed, then no lane may be held
    (asked of /proc/locks: the check itself never takes a lock)."""
    registry = Processes()
    yield registry
    registry.cleanup()
    held = []
    for lock in sorted(root.glob("*.lock")) if root.is_dir() else []:
        if lock.is_symlink() or not lock.is_file():
            continue
        view = holders.kernel_view(os.stat(lock))
        if view is not None and view.holders:
            held.append(f"{lock.name}: held by {view.holders}")
    assert not held, f"lanes left held at teardown: {held}"


@pytest.fixture
def run(procs):
    """run(*argv, env=None, input=None, timeout=60) -> CompletedProcess (text), with .pid."""

    def run_argv(*argv, env=None, input=None, timeout=TIMEOUT):
        merged = {**os.environ, **(env or {})}
        proc = procs.start(argv, env=merged, text=True, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE,
                           stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL)
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            pytest.fail(f"{argv} did not finish in {timeout}s (hang?)\nstdout {out!r}\nstderr {err!r}")
        done = subprocess.CompletedProcess(argv, proc.returncode, out, err)
        done.pid = proc.pid
        return done

    return run_argv


@pytest.fixture
def lanelock(run):
    """lanelock(*args, **kw): `python -m lanelock ARGS` to completion."""
    return lambda *args, **kwargs: run(*LANELOCK, *args, **kwargs)


def wait_for(condition, what: str, timeout: float = 30.0):
    """conftest's wait_for, with the argument order these suites use."""
    return shared_wait_for(condition, timeout=timeout, what=what)


class Holder:
    """`lanelock run ARGS -- sh -c HOLD_SCRIPT`: pid is the wrapper (the lock holder)."""

    def __init__(self, procs: Processes, args):
        argv = [*LANELOCK, "run", *args, "--", "sh", "-c", HOLD_SCRIPT]
        self.proc = procs.start(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
        self.pid = self.proc.pid
        line = read_line(self.proc.stdout)
        if not line.startswith("ready "):
            self.proc.kill()
            raise AssertionError(f"holder did not start holding: {line!r} "
                                 f"{self.proc.stderr.read().decode()!r}")
        self.child_pid = int(line.split()[1])

    def release(self, exit_status: int = 0) -> int:
        self.proc.stdin.write(f"{exit_status}\n".encode())
        self.proc.stdin.close()
        return self.proc.wait(timeout=TIMEOUT)


@pytest.fixture
def holder(procs):
    """holder(*run_args) -> Holder already holding its lane; released at teardown if still held."""
    started: list[Holder] = []

    def start(*args) -> Holder:
        held = Holder(procs, [str(arg) for arg in args])
        started.append(held)
        return held

    yield start
    for held in started:
        if held.proc.poll() is None:
            try:
                held.release()
            except (OSError, subprocess.TimeoutExpired):
                pass   # procs kills it


# -- looking -----------------------------------------------------------------------------------------
