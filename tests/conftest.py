"""The one test setup (tests/README.md tells how to use it): an isolated lock root per test, one
registry of the processes a test starts, one `lanelock` runner, one lane holder, and the guarantee
that nothing a test started outlives it and no lane is left held, whichever lock root it used.

Isolation: LANELOCK_DIR points at a fresh directory under tmp_path (not created: lanelock makes
it), both config files point at files that do not exist yet (a real /etc/lanelock or ~/.config
must never leak in), and every LANELOCK_* variable a surrounding turn or shell could have set is
removed (and NO_COLOR, FORCE_COLOR, CLICOLOR_FORCE).

Synchronisation is never a sleep: a holder's child prints "ready PID" on a pipe the test reads, and
holds the lane until the test writes its exit status to (or closes) its stdin. Deaths and stops are
waited for in the kernel (a pidfd, waitid()); wait_for() polls only a state no process can report.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
import select
import json
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest

LANELOCK = [sys.executable, "-m", "lanelock"]
LANE = "localhost:8080"          # the default lane, and its lock root file names' stem
STEM = "localhost-8080"
needs_flock = pytest.mark.skipif(shutil.which("flock") is None,
                                 reason="flock(1) (util-linux) not found")
TIMEOUT = 60.0          # no single process a test starts may run longer than this
COLOUR_VARIABLES = ("NO_COLOR", "FORCE_COLOR", "CLICOLOR_FORCE")
# Every process a test starts inherits this test's mark: the teardown check tells its lanes in a
# shared root from those of other turns on the machine.
TEST_MARK = "PYTEST_LANELOCK_MARK"

# The held child: say so on stdout (the test reads it), then hold until the test writes a line or
# closes our stdin; the line, if a number, is the exit status.
HOLD_SCRIPT = 'echo "ready $$"; read code; exit "${code:-0}"'

# A command that turns its parent-death signal off: it outlives a killed wrapper.
ESCAPING_HOLD = r"""
import ctypes, os, sys
ctypes.CDLL(None, use_errno=True).prctl(1, 0, 0, 0, 0)   # PR_SET_PDEATHSIG, none
print("ready", os.getpid(), flush=True)
sys.stdin.read()
"""

# A held child that takes signals and goes on: each signal it gets (the names in argv) is reported
# as a line "signal N" on stdout, until the test writes the exit status to stdin. The handlers only
# note the signal on a wakeup pipe that select() watches beside stdin, so a signal arriving at any
# moment is seen: with a Python handler and a blocking read, a signal that lands after the
# interpreter's last check and before read(2) waits for the read to return -- for ever, in a test
# that sends no input (test_signals_to_the_wrapper_are_forwarded_to_the_child[SIGINT] hung so).
SIGNALLED_HOLD = """
import os, select, signal, sys
wake_read, wake_write = os.pipe()
os.set_blocking(wake_write, False)
signal.set_wakeup_fd(wake_write, warn_on_full_buffer=False)
for name in sys.argv[1:]:
    signal.signal(getattr(signal, name), lambda signum, frame: None)
print("ready", os.getpid(), flush=True)
line = b""
while not line.endswith(b"\\n"):
    ready, _, _ = select.select([0, wake_read], [], [])
    if wake_read in ready:
        for signum in os.read(wake_read, 64):
            print("signal", signum, flush=True)
    if 0 in ready:
        chunk = os.read(0, 64)
        if not chunk:
            break
        line += chunk
sys.exit(int(line.strip() or 0))
"""


def signalled_hold(*names: str) -> list[str]:
    """The command of a holder whose child takes these signals (names: "SIGINT", ...)."""
    return [sys.executable, "-c", SIGNALLED_HOLD, *names]


def pytest_configure(config):
    # A shell starts a background job (`pytest &`) with SIGINT ignored, and every process the
    # tests start would inherit that: the ^C tests would then test the shell's choice instead of
    # lanelock's. Tests that want an ignored SIGINT set it for their own process.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


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


def environ(env: dict | None = None) -> dict:
    """os.environ with overrides; a value of None removes the variable."""
    merged = dict(os.environ)
    for name, value in (env or {}).items():
        if value is None:
            merged.pop(name, None)
        else:
            merged[name] = str(value)
    return merged


# -- no lane left held --------------------------------------------------------------------------------
def flock_entries(path) -> tuple[list[int], list[int]]:
    """(holders, waiters): the pids /proc/locks shows on this file's flock (empty when unreadable)."""
    try:
        st = os.stat(path)
        with open("/proc/locks") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return [], []
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    holding, waiting = [], []
    for line in lines:
        words = line.split()
        blocked = words[1:2] == ["->"]
        words = words[2:] if blocked else words[1:]
        if len(words) >= 5 and words[0] == "FLOCK" and words[4] == inode:
            (waiting if blocked else holding).append(int(words[3]))
    return holding, waiting


def is_waiting(lock_path, pid: int) -> bool:
    """Is pid blocked in flock() on this lock file (a '->' entry in /proc/locks)?"""
    return pid in flock_entries(lock_path)[1]


def is_queued(lock_path, pid: int) -> bool:
    """Does pid wait in the lane's queue (store/flock/queue.py: a file ARRIVAL.RANK.PID.RANDOM in
    STEM.queue/ beside the lock, there only while its turn waits)? The first in the queue blocks
    in flock() on the lock itself (is_waiting); the others on the entry ahead of them."""
    try:
        names = os.listdir(Path(lock_path).with_suffix(".queue"))
    except OSError:
        return False
    return any(name.split(".")[2:3] == [str(pid)] for name in names)


def lane_held(lock: Path) -> bool:
    """Does anyone hold this lock file's flock? Asked with a lock of our own, taken without waiting
    on a descriptor of our own (so a lane this very process holds, a leaked API turn, is seen too)
    and let go at once. A planted symlink, FIFO or directory is no lane."""
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


class LockRoots:
    """Every lock root (and lane store) a test used, checked at teardown: no lane may be held.

    Watched without asking: every *.lock under the test's tmp_path (its LANELOCK_DIR, any root it
    pointed LANELOCK_DIR or --lock-dir at there, tmpfs mounts there), and the LANELOCK_DIR and
    LANELOCK_STORE in force when the test ends. A root elsewhere is registered with watch(); the
    default root with watch_new() (its lanes made during the test: other turns on this machine may
    hold theirs); a PostgreSQL store given on the command line with watch_store(). after() runs
    clean-ups (unmount, remove) once the check is done, so they cannot hide a held lane."""

    def __init__(self, tmp_path: Path):
        self.tmp_path = tmp_path
        self.roots: list[Path] = []
        self.existing: dict[Path, set[Path]] = {}   # watch_new(): the lanes that were there before
        self.stores: list[str] = []
        self.cleanups: list = []

    def watch(self, root) -> Path:
        self.roots.append(Path(root))
        return Path(root)

    def watch_new(self, root) -> Path:
        root = Path(root)
        self.existing[root] = set(root.glob("*.lock")) if root.is_dir() else set()
        return root

    def watch_store(self, dsn: str) -> str:
        self.stores.append(dsn)
        return dsn

    def after(self, cleanup) -> None:
        self.cleanups.append(cleanup)

    def locks(self) -> list[Path]:
        found = set(self.tmp_path.rglob("*.lock"))
        roots = list(self.roots)
        if os.environ.get("LANELOCK_DIR"):
            roots.append(Path(os.environ["LANELOCK_DIR"]))
        for root in roots:
            found |= set(root.glob("*.lock")) if root.is_dir() else set()
        for root, before in self.existing.items():
            found |= (set(root.glob("*.lock")) if root.is_dir() else set()) - before
        return sorted(found)

    def held(self) -> list[str]:
        """What is left held: one line per lane. In a shared root (the default one) a lane counts
        only when this test holds it: a duel, another user's turn or another checkout's tests
        there meanwhile are no test's error."""
        shared = set(self.existing)
        held = []
        for lock in self.locks():
            if not lane_held(lock):
                continue
            if lock.parent in shared and not _this_tests(lock):
                continue
            held.append(f"{lock} (held by pid {flock_entries(lock)[0] or '?'})")
        stores = set(self.stores)
        if os.environ.get("LANELOCK_STORE", "").startswith("postgres"):
            stores.add(os.environ["LANELOCK_STORE"])
        for dsn in sorted(stores):
            pids = store_holders(dsn)
            if pids:
                held.append(f"{dsn}: advisory lane locks held by server pids {pids}")
        return held

    def check(self) -> None:
        try:
            held = self.held()
            assert not held, f"lanes left held at teardown: {held}"
        finally:
            for cleanup in reversed(self.cleanups):
                cleanup()


def _this_tests(lock: Path) -> bool:
    """Is a lane of a shared root held by this test? By this process (a leaked API turn), by one
    of its descendants, or by a process that carries this test's mark in its environment (one
    that left the tree: a daemon, an orphan). Another worker's or another suite's holder carries
    another mark or none. A holder let go between the lock attempt and this look is nobody's."""
    holders = flock_entries(lock)[0]
    if not holders:
        return lane_held(lock)
    for pid in holders:
        if pid == os.getpid():
            return True
        try:
            process = psutil.Process(pid)
            if os.getpid() in {parent.pid for parent in process.parents()}:
                return True
            if process.environ().get(TEST_MARK) == os.environ.get(TEST_MARK):
                return True
        except psutil.Error:
            continue
    return False


def store_holders(dsn: str) -> list[int]:
    """The server pids still holding a lane's advisory lock in this database. A session's locks go
    when the server notices its client is gone (killed at teardown a moment ago): given a few
    seconds, as no process can tell us when."""
    import psycopg

    query = ("SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 2 "
             "AND classid = %s AND database = (SELECT oid FROM pg_database "
             "WHERE datname = current_database())")
    namespace = 0x4C4E4C4B   # lanelock's advisory key namespace ("LNLK"), key1 of every lane

    def holding() -> list[int]:
        with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as conn:
            return [row[0] for row in conn.execute(query, (namespace,)).fetchall()]

    try:
        wait_for(lambda: not holding(), what="the store to let go", timeout=10.0)
    except AssertionError:
        return holding()
    return []


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


def remove_lane_files(lock_path) -> None:
    """A throwaway lane's files (lock, holder record, journal, counts, and its seats folder), for
    a test that made one in a shared root such as the default one."""
    stem = Path(str(lock_path)[: -len(".lock")])
    for path in stem.parent.glob(f"{stem.name}.*"):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                path.unlink()


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
class Processes:
    """Every process a test starts, killed by pid (and by process group) at teardown."""

    def __init__(self):
        self.popens: list[subprocess.Popen] = []
        self.spawns: list = []          # pexpect children
        self.strays: list[psutil.Process] = []   # processes the test learnt of (daemons, children)

    def start(self, argv, *, new_session: bool = True, **kwargs) -> subprocess.Popen:
        """Popen of argv (path-like words allowed) in its own session (so its whole group can be
        killed), stdin /dev/null unless given."""
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        proc = subprocess.Popen([str(word) for word in argv], start_new_session=new_session,
                                **kwargs)
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
        # Each session's processes, even once its leader was reaped (a session id is not reused
        # while the session has a process): the groups `lanelock run` gives its commands too.
        # One pass over /proc for all of them.
        sessions = {proc.pid for proc in self.popens if proc.own_group}
        sessions |= {child.pid for child in self.spawns}
        for pid in session_members(sessions) if sessions else ():
            self.adopt(pid)
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
                death = ExitWatch(process.pid)
            except ProcessLookupError:
                continue
            # Opened before the identity check: if this is still our process, the pidfd is its.
            if not running(process):
                death.close()
                continue
            try:
                process.kill()   # psutil refuses if the pid now belongs to another process
            except psutil.NoSuchProcess:
                death.close()
                continue
            death.wait()   # not our child: whoever adopted it reaps it; a zombie no longer runs


def session_members(sids: set) -> list[int]:
    """The processes of the sessions sids but their leaders, from /proc (those that end meanwhile
    are left out)."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) not in sids:
            try:
                with open(f"/proc/{name}/stat", "rb") as handle:
                    fields = handle.read().rsplit(b")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[3]) in sids:
                found.append(int(name))
    return found


@pytest.fixture
def procs(lock_roots):
    """The process registry; torn down (everything killed) before the lanes are checked."""
    registry = Processes()
    yield registry
    registry.cleanup()


def communicate(procs: Processes, argv, *, env=None, input=None, timeout=TIMEOUT, **kwargs):
    """Run argv to completion under the registry; CompletedProcess with text stdout/stderr and
    the process's .pid."""
    proc = procs.start(argv, env=environ(env), text=True,
                       stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs)
    try:
        out, err = proc.communicate(input, timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{argv} did not finish in {timeout}s (deadlock?)\nstdout: {out}\nstderr: {err}")
    done = subprocess.CompletedProcess([str(word) for word in argv], proc.returncode, out, err)
    done.pid = proc.pid
    return done


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


def cli_in_process(args) -> subprocess.CompletedProcess:
    """`lanelock ARGS` through the CLI's own entry point, without a process start (the suite pays
    for those hundreds of times)."""
    from lanelock.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(list(args))
    return subprocess.CompletedProcess(["lanelock", *args], status, out.getvalue(), err.getvalue())


def probe_in_process(args) -> subprocess.CompletedProcess:
    """`lanelock probe ARGS` in this process. It opens its own descriptor, so a lane this very
    process still holds (a leaked API turn) shows as busy as it would to anyone else."""
    return cli_in_process(["probe", *args])


def json_of(args) -> dict:
    """The JSON a read command prints (`where --json`, `status --json`...), asked in-process."""
    import json

    done = cli_in_process(args)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


# -- waiting with a deadline --------------------------------------------------------------------------
def read_all(sock, seen: bytes = b"") -> bytes:
    """Everything a socket sends until it closes (EOF or a reset), after what was seen."""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return seen
        if not chunk:
            return seen
        seen += chunk


def answer(data: bytes) -> tuple[int, dict, bytes]:
    """An HTTP/1.1 answer's bytes as (status, lower-case headers, body)."""
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(lines[0].split()[1]), headers, body


def send_waiting(port: int, count: int, request: bytes, timeout: float):
    """count copies of request, each on a connection of its own in a thread, returned once every
    one is sent: (results, threads). results fills with (status, headers) -- or (repr(error),
    {}) -- as the answers end; join the threads to have them all."""
    import threading

    results, sent = [], threading.Semaphore(0)

    def ask():
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
                sock.sendall(request)
                sent.release()
                data = read_all(sock)
            results.append(answer(data)[:2])
        except OSError as error:
            sent.release()
            results.append((repr(error), {}))

    threads = [threading.Thread(target=ask) for _ in range(count)]
    for thread in threads:
        thread.start()
    for _ in threads:
        assert sent.acquire(timeout=TIMEOUT)
    return results, threads


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


def wait_for(condition, what: str = "condition", timeout: float = 30.0):
    """Last resort when no process can tell us (a waiter blocked in the kernel, a stopped
    process that is not our child, a server's lock table): re-check a condition until a deadline.
    Returns the condition's first true value."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.005)


class ExitWatch:
    """A pidfd on a process that runs now: wait() returns once it has ended (a zombie counts),
    blocking in the kernel, and a reused pid can never fool it. Open it before the kill."""

    def __init__(self, pid: int):
        self.pid = pid
        self.fd = os.pidfd_open(pid)

    def wait(self, timeout: float = TIMEOUT) -> None:
        try:
            ready, _, _ = select.select([self.fd], [], [], timeout)
            assert ready, f"pid {self.pid} still runs after {timeout}s"
        finally:
            self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def wait_exit(pid: int, timeout: float = TIMEOUT) -> None:
    """Until pid has ended (a zombie counts), for a pid that cannot have been reused yet: our own
    unreaped child, or a process the test saw alive a moment ago. Gone already: returns."""
    try:
        death = ExitWatch(pid)
    except ProcessLookupError:
        return
    death.wait(timeout)


def wait_stopped(pid: int, timeout: float = TIMEOUT) -> None:
    """Until our child pid stops (SIGSTOP, LANELOCK_DEBUG_PAUSE): waitid() in the kernel. WNOWAIT
    leaves the event, and an exit, to whoever waits next (Popen)."""
    box = {}
    waiter = threading.Thread(target=lambda: box.update(info=os.waitid(
        os.P_PID, pid, os.WSTOPPED | os.WEXITED | os.WNOWAIT)), daemon=True)
    waiter.start()
    waiter.join(timeout)
    assert "info" in box, f"pid {pid} neither stopped nor ended within {timeout}s"
    assert box["info"].si_code == os.CLD_STOPPED, f"pid {pid} ended instead of stopping"


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
    """`lanelock run [ARGS] -- COMMAND` in the background, holding the lane; COMMAND is
    HOLD_SCRIPT unless given (any command that prints "ready PID" first and ends when told on
    stdin).

    pid is the wrapper (the lock holder), child_pid the held command. Its stderr goes to a file
    unless stderr=subprocess.PIPE is asked for (to read a warning line as it comes)."""

    def __init__(self, procs: Processes, stderr_path: Path, args, command, env, launcher, prefix,
                 stderr, popen):
        self.stderr_path = stderr_path
        argv = [*prefix, *launcher, "run", *args, "--", *command]
        self._stderr = open(stderr_path, "wb") if stderr is None else None
        self.proc = procs.start(argv, env=environ(env), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE,
                                stderr=self._stderr if stderr is None else stderr, **popen)
        self.pid = self.proc.pid
        self.child_pid: int | None = None
        self.ready_line = ""
        self.returncode: int | None = None

    def wait_ready(self, timeout: float = TIMEOUT) -> "Holder":
        line = read_line(self.proc.stdout, timeout)
        if not line.startswith("ready "):
            self.proc.kill()
            self.proc.wait(timeout=TIMEOUT)
            raise AssertionError(f"holder did not start holding: stdout {line!r}, "
                                 f"exit {self.proc.returncode}, stderr {self.stderr()!r}")
        self.ready_line = line.strip()
        self.child_pid = int(line.split()[1])
        return self

    def read_line(self, timeout: float = TIMEOUT) -> str:
        """The held command's next line on stdout ("signal 2" from a signalled_hold())."""
        return read_line(self.proc.stdout, timeout)

    def release(self, exit_status: int = 0) -> int:
        """Let the held command end (with exit_status) and return the wrapper's exit status."""
        if self.proc.returncode is None and self.proc.stdin and not self.proc.stdin.closed:
            try:
                self.proc.stdin.write(f"{exit_status}\n".encode())
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
        return self.wait()

    def wait(self, timeout: float = TIMEOUT) -> int:
        self.returncode = self.proc.wait(timeout=timeout)
        if self._stderr is not None:
            self._stderr.close()
        return self.returncode

    def stderr(self) -> str:
        if self._stderr is None:
            return self.proc.stderr.read().decode() if self.proc.stderr else ""
        if not self._stderr.closed:
            self._stderr.flush()
        return self.stderr_path.read_text()


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


# -- a server that says when it listens ---------------------------------------------------------------
class Server:
    """A process that says on stderr when it listens (a regex with the port as group 1); the rest
    of its stderr is drained by a thread so it can never block on a full pipe."""

    def __init__(self, procs, argv, listening: str, env=None):
        self.proc = procs.start(argv, env=environ(env), stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE)
        self.lines: list[str] = []
        self.lines_ended = False   # the drain read the pipe's end
        self._more = threading.Condition()
        pattern = re.compile(listening)
        while True:
            line = read_line(self.proc.stderr)
            if not line:
                self.proc.wait(timeout=TIMEOUT)
                raise AssertionError(f"{argv[0]} exited {self.proc.returncode}: {self.lines}")
            self.lines.append(line)
            found = pattern.search(line)
            if found:
                break
        self.found = found
        self.port = int(found.group(1))
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()

    def _drain(self) -> None:
        for raw in iter(self.proc.stderr.readline, b""):
            with self._more:
                self.lines.append(raw.decode(errors="replace"))
                self._more.notify_all()
        with self._more:
            self.lines_ended = True
            self._more.notify_all()

    def log(self) -> str:
        return "".join(self.lines)

    def until(self, condition, what: str, timeout: float = TIMEOUT) -> str:
        """The log once condition(log) holds, woken by each line the drain reads: a line the
        server wrote before an answer may still be in the pipe when the answer arrives."""
        deadline = time.monotonic() + timeout
        with self._more:
            while not condition(self.log()):
                left = deadline - time.monotonic()
                if left <= 0 or self.lines_ended:
                    raise AssertionError(f"no {what} in {self.log()!r}")
                self._more.wait(left)
        return self.log()

    def said(self, text: str, timeout: float = TIMEOUT) -> str:
        """The log once `text` is in it (see until)."""
        return self.until(lambda log: text in log, repr(text), timeout)

    def stop(self, signo=signal.SIGTERM) -> int:
        """Signal the server, wait for it and for the end of its stderr; its exit status."""
        self.proc.send_signal(signo)
        return self.wait()

    def wait(self) -> int:
        status = self.proc.wait(timeout=TIMEOUT)
        self._reader.join(TIMEOUT)
        return status


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


# -- history ---------------------------------------------------------------------------------------
TIMELINE = re.compile(r"^\S+ \d\d:00 \S+  [#~x.!]{60}$")   # one hour of `history` piped


def history_json(lanelock, *args) -> dict:
    """`lanelock history --json ARGS`, parsed: it must succeed, with no traceback."""
    done = lanelock("history", "--json", *args)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done
    return json.loads(done.stdout)
