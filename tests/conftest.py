"""Shared fixtures: an isolated lock root per test, a `lanelock` runner, a lane holder, and the
guarantee that nothing a test started outlives it and no lane is left held.

Isolation: LANELOCK_DIR points at a fresh directory under tmp_path (not created: lanelock makes
it), both config files point at files that do not exist (a real /etc/lanelock or ~/.config must
never leak in), and every LANELOCK_* variable a surrounding turn could have set is removed.

Synchronisation is never a sleep: a holder's child prints "ready PID" on a pipe the test reads, and
holds the lane until the test writes to (or closes) its stdin.
"""

from __future__ import annotations

import contextlib
import io
import ipaddress
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import unquote

import psutil
import pytest

LANELOCK = [sys.executable, "-m", "lanelock"]
needs_flock = pytest.mark.skipif(shutil.which("flock") is None,
                                 reason="flock(1) (util-linux) not found")
TIMEOUT = 60.0          # no single process a test starts may run longer than this
CLEARED = ("LANELOCK_BACKEND", "LANELOCK_SESSION", "LANELOCK_MODEL", "LANELOCK_HELD",
           "LANELOCK_HOLDER_PID", "LANELOCK_STATE", "LANELOCK_LANE", "LANELOCK_LOCK_PATH",
           "LANELOCK_FAILOVER_REASON", "LANELOCK_FALLBACK_INDEX", "LANELOCK_DEBUG",
           "LANELOCK_STORE")

# The held child: say so on stdout (the test reads it), then hold until the test writes a line or
# closes our stdin; the line, if a number, is the exit status.
HOLD_SCRIPT = 'echo "ready $$"; read code; exit "${code:-0}"'


# -- isolation --------------------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch) -> Path:
    """A fresh lock root and no configuration: what every test starts from."""
    lock_dir = tmp_path / "locks"
    for name in CLEARED:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LANELOCK_DIR", str(lock_dir))
    monkeypatch.setenv("LANELOCK_SYSTEM_CONFIG", str(tmp_path / "no-such-system-config.toml"))
    monkeypatch.setenv("LANELOCK_CONFIG", str(tmp_path / "no-such-user-config.toml"))
    return lock_dir


@pytest.fixture
def lock_dir(isolated) -> Path:
    """The test's LANELOCK_DIR (a Path; lanelock creates the directory on the first turn)."""
    return isolated


def environ(env: dict | None = None) -> dict:
    """os.environ with overrides; a value of None removes the variable."""
    merged = dict(os.environ)
    for name, value in (env or {}).items():
        if value is None:
            merged.pop(name, None)
        else:
            merged[name] = str(value)
    return merged


def backend_of_stem(stem: str) -> list[str] | None:
    """`lanelock probe` arguments for a lock file's stem (localhost-8080, fd00__1-8080,
    localhost-8080~model), or None when the stem cannot be read back (a hashed long name)."""
    stem, _, model = stem.partition("~")
    host, sep, port = stem.rpartition("-")
    if not sep or not port.isdigit() or not host:
        return None
    if "_" in host:
        try:
            host = f"[{ipaddress.ip_address(host.replace('_', ':'))}]"
        except ValueError:
            return None
    args = ["--backend", f"{host}:{port}"]
    if model:
        args += ["--key-by", "model", "--model", unquote(model)]
    return args


def probe_in_process(args) -> subprocess.CompletedProcess:
    """`lanelock probe ARGS` through the CLI's own entry point, without a process start per test
    (the suite pays for that ~150 times). It opens its own descriptor, so a lane this very process
    still holds (a leaked API turn) shows as busy as it would to anyone else."""
    from lanelock.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(["probe", *args])
    return subprocess.CompletedProcess(["lanelock", "probe", *args], status, out.getvalue(),
                                       err.getvalue())


@pytest.fixture(autouse=True)
def lanes_free_at_teardown(isolated):
    """After the test (and after its processes are killed): every lane under the test's root is
    free, asked through `lanelock probe` (and flock(1) for a lane whose name cannot be read back)."""
    yield
    if not isolated.is_dir():
        return
    held = []
    for lock in sorted(isolated.glob("*.lock")):
        if not lock.is_file() or lock.is_symlink():
            continue   # a test planted it (symlink, FIFO, directory): not a lane anyone holds
        args = backend_of_stem(lock.name[:-len(".lock")])
        if args is None and shutil.which("flock"):
            check = subprocess.run(["flock", "-n", "-E", "99", str(lock), "true"],
                                   capture_output=True, text=True, timeout=TIMEOUT)
            free = check.returncode == 0
        elif args is None:
            continue   # no flock(1) and a name that cannot be read back: nothing to ask with
        else:
            check = probe_in_process(args)
            free = check.returncode == 0
        if not free:
            held.append(f"{lock}: {check.stdout.strip()} {check.stderr.strip()}")
    assert not held, f"lanes left held at teardown: {held}"


# -- processes --------------------------------------------------------------------------------------
class Processes:
    """Every process a test starts, killed by pid (and by process group) at teardown."""

    def __init__(self):
        self.popens: list[subprocess.Popen] = []
        self.spawns: list = []          # pexpect children
        self.strays: list[psutil.Process] = []   # processes the test learnt of (daemons, children)

    def start(self, argv, *, new_session: bool = True, **kwargs) -> subprocess.Popen:
        """Popen in its own session (so its whole group can be killed), stdin /dev/null unless
        given."""
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        proc = subprocess.Popen(argv, start_new_session=new_session, **kwargs)
        proc.own_group = new_session
        self.popens.append(proc)
        return proc

    def spawn(self, child):
        """Register a pexpect child (pexpect already gives it its own session)."""
        self.spawns.append(child)
        return child

    def adopt(self, pid: int) -> psutil.Process | None:
        """A pid the test learnt of: killed at teardown if still the same process (psutil checks
        the start time, so a reused pid is never hit)."""
        try:
            process = psutil.Process(pid)
        except psutil.NoSuchProcess:
            return None
        self.strays.append(process)
        return process

    def cleanup(self) -> None:
        for proc in self.popens:
            if proc.returncode is None:       # not reaped yet: its pid (and group id) is still ours
                if proc.own_group:
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
                try:
                    proc.kill()
                except ProcessLookupError:
                    pass
                try:
                    proc.wait(timeout=TIMEOUT)
                except subprocess.TimeoutExpired:
                    pass
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    try:
                        stream.close()
                    except OSError:
                        pass
        for child in self.spawns:
            if child.isalive():
                try:
                    os.killpg(child.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            child.close(force=True)
        for process in self.strays:
            try:
                process.kill()   # psutil refuses if the pid now belongs to another process
            except psutil.NoSuchProcess:
                continue
            # Not our child: whoever adopted it reaps it; a zombie no longer runs.
            wait_for(lambda: not running(process), what=f"pid {process.pid} to die")


@pytest.fixture
def procs(lanes_free_at_teardown):
    """The process registry; torn down (everything killed) before the lanes are checked."""
    registry = Processes()
    yield registry
    registry.cleanup()


@pytest.fixture
def lanelock(procs):
    """run(*args, env=None, **kw) -> CompletedProcess of `python -m lanelock ARGS` (text mode).

    env: overrides on top of os.environ (None values remove a variable); input: text for stdin;
    timeout: seconds (the process group is killed and the test fails when it is exceeded); other
    keywords go to Popen (cwd, ...)."""

    def run(*args, env=None, input=None, timeout=TIMEOUT, prefix=(), **kwargs):
        argv = [*prefix, *LANELOCK, *map(str, args)]
        return communicate(procs, argv, env=env, input=input, timeout=timeout, **kwargs)

    return run


def communicate(procs: Processes, argv, *, env=None, input=None, timeout=TIMEOUT, **kwargs):
    """Run argv to completion under the registry; CompletedProcess with text stdout/stderr."""
    proc = procs.start(argv, env=environ(env), text=True,
                       stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs)
    try:
        out, err = proc.communicate(input, timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{argv} did not finish in {timeout}s (deadlock?)\nstdout: {out}\nstderr: {err}")
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


@pytest.fixture
def run_cmd(procs):
    """Like `lanelock` but for any argv (env -i prefixes, shells, flock(1))."""

    def run(argv, env=None, input=None, timeout=TIMEOUT, **kwargs):
        return communicate(procs, [str(word) for word in argv], env=env, input=input,
                           timeout=timeout, **kwargs)

    return run


# -- reading with a deadline ------------------------------------------------------------------------
def read_line(stream, timeout: float = TIMEOUT) -> str:
    """One line from a binary pipe, waiting at most timeout seconds; '' at EOF."""
    deadline = time.monotonic() + timeout
    data = b""
    fd = stream.fileno()
    while not data.endswith(b"\n"):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"no line within {timeout}s (got {data!r})")
        ready, _, _ = select.select([fd], [], [], remaining)
        if not ready:
            continue
        byte = os.read(fd, 1)
        if not byte:
            break
        data += byte
    return data.decode()


def wait_for(condition, timeout: float = 30.0, what: str = "condition"):
    """Last resort when no process can tell us: re-check a condition until a deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.005)


def running(process: psutil.Process) -> bool:
    """Still this very process (not a reused pid), and not a zombie."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def pid_gone(pid: int) -> bool:
    """True when pid no longer runs (gone, or a zombie nobody has reaped yet)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


# -- the holder -------------------------------------------------------------------------------------
class Holder:
    """`python -m lanelock run [ARGS] -- sh -c HOLD_SCRIPT` in the background, holding the lane.

    pid is the wrapper (the lock holder), child_pid the held command."""

    def __init__(self, procs: Processes, stderr_path: Path, args, command, env, cwd, prefix):
        self.stderr_path = stderr_path
        argv = [*prefix, *LANELOCK, "run", *map(str, args), "--", *command]
        self._stderr = open(stderr_path, "wb")
        self.proc = procs.start(argv, env=environ(env), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=self._stderr, cwd=cwd)
        self.pid = self.proc.pid
        self.child_pid: int | None = None
        self.ready_line = ""
        self.returncode: int | None = None

    def wait_ready(self, timeout: float = TIMEOUT) -> "Holder":
        line = read_line(self.proc.stdout, timeout)
        if not line.startswith("ready "):
            self.proc.wait(timeout=TIMEOUT)
            raise AssertionError(f"holder did not start holding: stdout {line!r}, "
                                 f"exit {self.proc.returncode}, stderr {self.stderr()!r}")
        self.ready_line = line.strip()
        self.child_pid = int(line.split()[1])
        return self

    def release(self, exit_status: int = 0) -> int:
        """Let the held command end (with exit_status) and return the wrapper's exit status."""
        if self.proc.returncode is None and self.proc.stdin and not self.proc.stdin.closed:
            try:
                self.proc.stdin.write(f"{exit_status}\n".encode())
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
        return self.wait()

    def wait(self, timeout: float = 30.0) -> int:
        self.returncode = self.proc.wait(timeout=timeout)
        self._stderr.close()
        return self.returncode

    def stderr(self) -> str:
        if not self._stderr.closed:
            self._stderr.flush()
        return self.stderr_path.read_text()


@pytest.fixture
def holder(procs, tmp_path):
    """holder(*run_args, command=None, env=None, ready=True) -> Holder, already holding the lane
    (its child has printed "ready PID"). Released (and, failing that, killed) at teardown."""
    started: list[Holder] = []

    def start(*args, command=None, env=None, cwd=None, prefix=(), ready=True) -> Holder:
        path = tmp_path / f"holder-{len(started)}.stderr"
        held = Holder(procs, path, args, command or ["sh", "-c", HOLD_SCRIPT], env, cwd, prefix)
        started.append(held)
        return held.wait_ready() if ready else held

    yield start
    for held in started:
        if held.proc.returncode is None:
            try:
                held.release()
            except (subprocess.TimeoutExpired, OSError):
                pass   # procs kills it


def is_waiting(lock_path, pid: int) -> bool:
    """Is pid blocked in flock() on this lock file (a '->' entry in /proc/locks)?"""
    from lanelock import holders

    try:
        view = holders.kernel_view(os.stat(lock_path))
    except FileNotFoundError:
        return False
    return view is not None and pid in view.waiters
