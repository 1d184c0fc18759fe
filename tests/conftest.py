"""The suite's fixtures, and only fixtures (tests/README.md tells how to use them; the helpers
they use live in tests/support/): an isolated lock root per test, one registry of the processes a
test starts, one `lanelock` runner, one lane holder, and the guarantee that nothing a test started
outlives it and no lane is left held, whichever lock root it used.

Isolation: LANELOCK_DIR points at a fresh directory under tmp_path (not created: lanelock makes
it), both config files point at files that do not exist yet (a real /etc/lanelock or ~/.config
must never leak in), and every LANELOCK_* variable a surrounding turn or shell could have set is
removed (and NO_COLOR, FORCE_COLOR, CLICOLOR_FORCE).

Synchronisation is never a sleep: a holder's child prints "ready PID" on a pipe the test reads, and
holds the lane until the test writes its exit status to (or closes) its stdin. Deaths and stops are
waited for in the kernel (a pidfd, waitid()); wait_for() polls only a state no process can report.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

import pytest

from support import signals
from support.cli import COLOUR_VARIABLES, LANELOCK, TEST_MARK, TIMEOUT, communicate
from support.holding import HOLD_SCRIPT, Holder
from support.processes import Processes
from support.roots import LockRoots


def pytest_configure(config):
    # `pytest &` and `nohup pytest`: the processes the tests start begin with no signal ignored
    # (support/signals.py), or the ^C and hangup tests would test the shell's choice.
    signals.take_ignored()


def pytest_unconfigure(config):
    signals.give_back()


# -- isolation --------------------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch) -> Path:
    """A fresh lock root and no configuration: what every test starts from."""
    lock_dir = tmp_path / "locks"
    for name in list(os.environ):
        if name.startswith("LANELOCK_") and not name.startswith("LANELOCK_REQUIRE_"):
            monkeypatch.delenv(name)   # (LANELOCK_REQUIRE_*: the suite's own switches, for CI)
    for name in COLOUR_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LANELOCK_DIR", str(lock_dir))
    monkeypatch.setenv("LANELOCK_SYSTEM_CONFIG", str(tmp_path / "system-config.toml"))
    monkeypatch.setenv("LANELOCK_CONFIG", str(tmp_path / "user-config.toml"))
    monkeypatch.setenv(TEST_MARK, f"{os.getpid()}-{uuid.uuid4().hex}")
    return lock_dir


@pytest.fixture
def lock_dir(isolated) -> Path:
    """The test's LANELOCK_DIR (a Path; lanelock creates the directory on the first turn)."""
    return isolated


@pytest.fixture
def config_files(isolated) -> tuple[Path, Path]:
    """(system, user): the config files lanelock reads in this test; neither exists yet."""
    return Path(os.environ["LANELOCK_SYSTEM_CONFIG"]), Path(os.environ["LANELOCK_CONFIG"])


# -- no lane left held --------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def default_lock_root() -> Path:
    """The root a turn without LANELOCK_DIR uses on this machine (and no config file moves it)."""
    import json

    env = {name: value for name, value in os.environ.items() if not name.startswith("LANELOCK_")}
    env.update(LANELOCK_SYSTEM_CONFIG="/nonexistent.toml", LANELOCK_CONFIG="/nonexistent.toml")
    done = subprocess.run([*LANELOCK, "where", "--json"], capture_output=True, text=True,
                          timeout=TIMEOUT, env=env)
    assert done.returncode == 0, done.stderr
    return Path(json.loads(done.stdout)["root"])


@pytest.fixture(autouse=True)
def lock_roots(isolated, tmp_path, default_lock_root):
    """The registry of lock roots; after the test (and after procs has killed its processes), no
    lane under any of them may be held. The default root is always watched for the lanes a test
    makes there (on purpose or by a slip), never for those other turns on this machine hold."""
    roots = LockRoots(tmp_path)
    roots.watch_new(default_lock_root)
    yield roots
    roots.check()


@pytest.fixture
def default_root(monkeypatch, default_lock_root) -> Path:
    """For a test that proves the default root: LANELOCK_DIR unset (the config files stay
    isolated). Returns the root; lock_roots watches the lanes made in it."""
    monkeypatch.delenv("LANELOCK_DIR")
    return default_lock_root


@pytest.fixture
def tmpfs(tmp_path, lock_roots):
    """mount(options) -> a fresh tmpfs mounted under tmp_path with those options (skips when
    mounting is not possible here); unmounted after the teardown check. As root, permission bits
    stop nothing: a read-only or full file system does."""
    count = [0]

    def mount(options: str) -> Path:
        mount_point = tmp_path / f"mnt{count[0]}"
        count[0] += 1
        mount_point.mkdir()
        try:
            done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mount_point)],
                                  capture_output=True, text=True, timeout=TIMEOUT)
        except FileNotFoundError:
            pytest.skip("no mount(8) here")
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs ({options}) here: {done.stderr.strip()}")
        lock_roots.after(lambda: subprocess.run(["umount", "-l", str(mount_point)],
                                                capture_output=True, timeout=TIMEOUT))
        return mount_point

    return mount


# -- processes --------------------------------------------------------------------------------------


@pytest.fixture
def procs(lock_roots):
    """The process registry; torn down (everything killed) before the lanes are checked."""
    registry = Processes()
    yield registry
    registry.cleanup()


@pytest.fixture
def lanelock(procs):
    """lanelock(*args, env=None, input=None, timeout=60, prefix=(), **popen) -> CompletedProcess
    of `python -m lanelock ARGS` (text mode, with .pid).

    env: overrides on top of os.environ (None values remove a variable); input: text for stdin;
    timeout: seconds (the process group is killed and the test fails when it is exceeded); prefix:
    words before python (env -i ..., runuser ...); other keywords go to Popen (cwd, ...)."""

    def run(*args, env=None, input=None, timeout=TIMEOUT, prefix=(), **kwargs):
        return communicate(procs, [*prefix, *LANELOCK, *args], env=env, input=input,
                           timeout=timeout, **kwargs)

    return run


@pytest.fixture
def run_cmd(procs):
    """run_cmd(argv, env=None, input=None, timeout=60, **popen): like `lanelock` for any argv
    (shells, flock(1), a python -c script)."""

    def run(argv, env=None, input=None, timeout=TIMEOUT, **kwargs):
        return communicate(procs, argv, env=env, input=input, timeout=timeout, **kwargs)

    return run


# -- the holder -------------------------------------------------------------------------------------


@pytest.fixture
def holder(procs, tmp_path):
    """holder(*run_args, command=None, env=None, launcher=LANELOCK, prefix=(), ready=True,
    stderr=None, **popen) -> Holder, already holding the lane (its child has printed "ready PID")
    unless ready=False. launcher: what stands for `python -m lanelock` (a script that becomes
    another user first); prefix: words before it (ip netns exec ...). Released (and, failing that,
    killed) at teardown."""
    started: list[Holder] = []

    def start(*args, command=None, env=None, launcher=LANELOCK, prefix=(), ready=True,
              stderr=None, **popen) -> Holder:
        path = tmp_path / f"holder-{len(started)}.stderr"
        held = Holder(procs, path, args, command or ["sh", "-c", HOLD_SCRIPT], env, launcher,
                      prefix, stderr, popen)
        started.append(held)
        return held.wait_ready() if ready else held

    yield start
    for held in started:
        if held.proc.returncode is None:
            try:
                held.release()
            except (subprocess.TimeoutExpired, OSError):
                pass   # procs kills it


# -- a PostgreSQL server (the lane-store tests) --------------------------------------------------------
@pytest.fixture(scope="session")
def postgres():
    """One real PostgreSQL server on loopback per session (support/pg_server.py); skipped without
    Debian's postgresql package unless LANELOCK_REQUIRE_PG is set."""
    from support import pg_server

    if pg_server.binaries() is None:
        if os.environ.get("LANELOCK_REQUIRE_PG"):
            pytest.fail("no PostgreSQL server binaries")
        pytest.skip("no PostgreSQL server binaries (apt-get install postgresql)")
    pytest.importorskip("psycopg")
    server = pg_server.Server().start()
    yield server
    server.stop()


@pytest.fixture
def private_postgres(lock_roots):
    """A PostgreSQL server of the test's own, for a test that restarts, stops, cuts off or
    crowds it: its lanes watched by the teardown check, stopped after it."""
    from support import pg_server

    if pg_server.binaries() is None:
        if os.environ.get("LANELOCK_REQUIRE_PG"):
            pytest.fail("no PostgreSQL server binaries")
        pytest.skip("no PostgreSQL server binaries (apt-get install postgresql)")
    pytest.importorskip("psycopg")
    server = pg_server.Server()
    lock_roots.after(server.stop)
    server.start()
    lock_roots.watch_store(server.dsn)
    return server
