"""runner.Starter with real processes: `lanelock run` forks the command's child before it takes the
lane and parks it on a pipe; go() lets it exec, cancel() lets it exit.

What must hold: the parked child holds and waits for nothing; a ^C, SIGKILL or SIGTERM during the
wait leaves no process behind; a deflected turn reaps it; and the command a parked child becomes is
the same as one started at once -- byte-exact environment, signal state, descriptors, exit status --
even when the parked child was killed during the wait and go() had to fork a fresh one.

Synchronisation: the waiter is seen blocked in flock() in /proc/locks, the parked child blocked in
read(2) on a pipe in /proc/PID/syscall, and a death through a pidfd. This test process makes itself
a child subreaper, so whatever a wrapper leaves behind when it exits (a process or an unreaped
zombie) becomes our child, where the test can see it. Lane ports 18970-18989 are this suite's.
"""

from __future__ import annotations

import ctypes
import os
import re
import platform
import select
import signal
import subprocess
import sys

import pexpect
import psutil
import pytest

from support.cli import LANELOCK, TIMEOUT, environ
from support.kernel_locks import is_waiting
from support.processes import pid_gone, wait_for
from lanelock import locks

PR_SET_CHILD_SUBREAPER = 36
# read(2)'s number, to see a parked child blocked on its go pipe in /proc/PID/syscall.
READ_SYSCALL = {"x86_64": "0", "aarch64": "63", "riscv64": "63"}.get(platform.machine())
pytestmark = pytest.mark.skipif(READ_SYSCALL is None, reason="read(2) number unknown here")
SIGPIPE_BIT = 1 << (signal.SIGPIPE - 1)
SIGINT_BIT = 1 << (signal.SIGINT - 1)
# The command lists its descriptors; the one listdir() opened on /proc/self/fd is closed again by
# the time fstat() looks, so only the inherited ones are left.
LIST_FDS = ("import os\n"
            "def is_open(fd):\n"
            "    try:\n"
            "        return bool(os.fstat(fd))\n"
            "    except OSError:\n"
            "        return False\n"
            "print(sorted(int(fd) for fd in os.listdir('/proc/self/fd') if is_open(int(fd))))\n")


def lane(port: int) -> str:
    return f"127.0.0.1:{port}"


def run_argv(port: int, *command, flags=("--wait",)) -> list[str]:
    return [*LANELOCK, "run", "-b", lane(port), *flags, "--", *map(str, command)]


def blocked(pid: int, lock) -> None:
    """Wait until pid blocks in flock() on lock; fail if it ends instead."""
    wait_for(lambda: is_waiting(lock, pid) or pid_gone(pid), what=f"pid {pid} to block in flock()")
    assert not pid_gone(pid), "the turn ended instead of waiting for the lane"


def kernel(lock) -> locks.KernelView:
    return locks.kernel_view(os.stat(lock))


def parked_on_a_pipe(pid: int) -> bool:
    """Blocked in read(2) on a pipe: /proc/PID/syscall reads "NR FD ..." ("running" otherwise)."""
    try:
        with open(f"/proc/{pid}/syscall") as handle:
            words = handle.read().split()
        return (words[:1] == [READ_SYSCALL]
                and os.readlink(f"/proc/{pid}/fd/{int(words[1], 16)}").startswith("pipe:"))
    except (OSError, ValueError, IndexError):
        return False


def set_subreaper(on: bool) -> None:
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    assert prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) == 0, os.strerror(ctypes.get_errno())


class Family:
    """The wrapper's parked child, and the orphans wrappers leave to us (we are a subreaper)."""

    def __init__(self, procs):
        self.procs = procs
        self.pidfds: dict[int, int] = {}
        # Children from before (a session's PostgreSQL server) are nobody's orphans.
        self.earlier = {child.pid for child in psutil.Process().children()}

    def parked(self, wrapper_pid: int) -> int:
        """The wrapper's one child, once parked. A pidfd is kept so ended() waits for its death
        without polling and a reused pid can never fool it."""
        children = psutil.Process(wrapper_pid).children()
        assert len(children) == 1, f"the waiting wrapper should have one child: {children}"
        pid = children[0].pid
        self.pidfds[pid] = os.pidfd_open(pid)
        # Opened after the listing: still the wrapper's child, so the pidfd is for this process.
        assert psutil.Process(pid).ppid() == wrapper_pid
        self.procs.adopt(pid)
        wait_for(lambda: parked_on_a_pipe(pid) or pid_gone(pid), what=f"pid {pid} to park")
        assert not pid_gone(pid), "the parked child died while parking"
        return pid

    def ended(self, pid: int, timeout: float = TIMEOUT) -> bool:
        """Wait for pid's death (exited or killed, reaped or not)."""
        return bool(select.select([self.pidfds[pid]], [], [], timeout)[0])

    def orphans(self) -> list[int]:
        """Our children that no test started: what exited wrappers left behind."""
        known = {proc.pid for proc in self.procs.popens} | self.earlier
        known |= {child.pid for child in self.procs.spawns}
        return [child.pid for child in psutil.Process().children() if child.pid not in known]

    def reap(self, pid: int) -> int:
        """An orphan's wait status, once it is dead."""
        assert self.ended(pid), f"pid {pid} did not die"
        return os.waitpid(pid, 0)[1]

    def close(self) -> None:
        set_subreaper(False)   # from here on, orphans go to init as usual
        for pid in self.orphans():
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
        for fd in self.pidfds.values():
            os.close(fd)


@pytest.fixture
def family(procs):
    """Requested after procs, so it is torn down first: orphans are reaped, then procs kills the
    rest (whatever it orphans then goes to init, not to us)."""
    set_subreaper(True)
    kin = Family(procs)
    yield kin
    kin.close()


@pytest.fixture
def turn(procs, holder, family, lock_dir):
    """turn(mode, port, *command, **popen) -> (wrapper Popen, stdout bytes, stderr text) of
    `lanelock run --wait -- COMMAND` to completion. mode: "at once" (free lane); "after a wait"
    (behind a holder, its parked child runs the command); "reforked" (the parked child is killed
    with SIGKILL during the wait: go() must fork a fresh one)."""

    def run(mode: str, port: int, *command, **popen):
        held = None if mode == "at once" else holder("-b", lane(port))
        wrapper = procs.start(run_argv(port, *command), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, **popen)
        if held is not None:
            blocked(wrapper.pid, lock_dir / f"localhost-{port}.lock")
            child = family.parked(wrapper.pid)
            if mode == "reforked":
                os.kill(child, signal.SIGKILL)
                assert family.ended(child)
            assert held.release() == 0
        out, err = wrapper.communicate(timeout=TIMEOUT)
        assert family.orphans() == [], "the turn left a process (or an unreaped zombie) behind"
        return wrapper, out, err.decode(errors="replace")

    return run


MODES = ["at once", "after a wait", "reforked"]


# -- 1. the parked child while the turn waits ------------------------------------------------------
def test_the_parked_child_holds_nothing_and_becomes_the_command(procs, holder, family, lock_dir):
    port = 18970
    lock = lock_dir / f"localhost-{port}.lock"
    held = holder("-b", lane(port))
    wrapper = procs.start(run_argv(port, "sh", "-c", 'echo "$$"'), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE)
    blocked(wrapper.pid, lock)
    child = family.parked(wrapper.pid)   # asserts it is the wrapper's only child
    assert kernel(lock) == locks.KernelView((held.pid,), (wrapper.pid,))
    locking = {entry[0] for entry in locks.flock_entries()}
    assert child not in locking, "the parked child holds or waits for a lock"
    targets = {os.readlink(f"/proc/{child}/fd/{fd}") for fd in os.listdir(f"/proc/{child}/fd")}
    assert not {target for target in targets if target.startswith(str(lock_dir))}, targets
    assert held.release() == 0
    out, err = wrapper.communicate(timeout=TIMEOUT)
    assert wrapper.returncode == 0, err
    assert int(out) == child, "the command should run in the parked child itself"
    assert family.orphans() == []


# -- 2-4. the waiting wrapper ends: so does its parked child ---------------------------------------
# terminal: a real ^C (the tty signals the foreground group); group: the same from a test, also
# through the bounded wait's SIGALRM timer; wrapper: kill -INT of the wrapper alone, so the parked
# child is alive when the wrapper's KeyboardInterrupt cancels it.
@pytest.mark.parametrize("how, flags", [("terminal", ["--wait"]), ("group", ["--wait"]),
                                        ("group", ["--wait", "30"]), ("wrapper", ["--wait"])])
def test_sigint_while_waiting_ends_the_wrapper_and_the_parked_child(how, flags, procs, holder,
                                                                    family, lock_dir):
    port = 18971
    lock = lock_dir / f"localhost-{port}.lock"
    held = holder("-b", lane(port))
    argv = run_argv(port, "true", flags=flags)
    if how == "terminal":
        term = procs.spawn(pexpect.spawn(argv[0], argv[1:], env=environ(), timeout=TIMEOUT,
                                         encoding="utf-8"))
        pid = term.pid
    else:
        wrapper = procs.start(argv, stderr=subprocess.PIPE, text=True)
        pid = wrapper.pid
    blocked(pid, lock)
    child = family.parked(pid)
    if how == "terminal":
        term.sendintr()
        term.expect(pexpect.EOF)
        term.close()
        assert term.signalstatus == signal.SIGINT or term.exitstatus == 130, term.before
        assert "Traceback" not in term.before
    else:
        (os.killpg if how == "group" else os.kill)(pid, signal.SIGINT)
        _, err = wrapper.communicate(timeout=TIMEOUT)
        assert wrapper.returncode == -signal.SIGINT, err
        assert "Traceback" not in err
    assert family.ended(child)
    assert family.orphans() == [], "the wrapper should have reaped its parked child"
    assert kernel(lock) == locks.KernelView((held.pid,), ())
    assert held.release() == 0


@pytest.mark.parametrize("frozen", [False, True], ids=["running", "stopped"])
def test_kill_9_of_the_waiting_wrapper_takes_the_parked_child_along(frozen, procs, holder, family,
                                                                   lock_dir):
    port = 18972
    lock = lock_dir / f"localhost-{port}.lock"
    held = holder("-b", lane(port))
    wrapper = procs.start(run_argv(port, "true"))
    blocked(wrapper.pid, lock)
    child = family.parked(wrapper.pid)
    if frozen:
        # The wrapper's death also closes the go pipe, and a parked child exits on that EOF. A
        # stopped child cannot act on EOF: only the parent-death SIGKILL can end it.
        os.kill(child, signal.SIGSTOP)
        wait_for(lambda: psutil.Process(child).status() == psutil.STATUS_STOPPED,
                 what="the parked child to stop")
    os.kill(wrapper.pid, signal.SIGKILL)
    assert wrapper.wait(timeout=TIMEOUT) == -signal.SIGKILL
    assert family.orphans() == [child], "the orphaned parked child is reparented to us"
    status = family.reap(child)
    if frozen:
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
    assert kernel(lock) == locks.KernelView((held.pid,), ())
    assert held.release() == 0


def test_sigterm_to_the_waiting_wrapper_alone_ends_it_and_the_parked_child(procs, holder, family,
                                                                          lock_dir):
    port = 18973
    lock = lock_dir / f"localhost-{port}.lock"
    held = holder("-b", lane(port))
    wrapper = procs.start(run_argv(port, "true"), stderr=subprocess.PIPE, text=True)
    blocked(wrapper.pid, lock)
    child = family.parked(wrapper.pid)
    os.kill(wrapper.pid, signal.SIGTERM)   # the wrapper only, not its group
    _, err = wrapper.communicate(timeout=TIMEOUT)
    assert wrapper.returncode in (-signal.SIGTERM, 128 + signal.SIGTERM), err
    assert family.ended(child)
    left = family.orphans()
    assert set(left) <= {child}, left    # a wrapper killed outright leaves the child to us
    for pid in left:
        family.reap(pid)
    assert kernel(lock) == locks.KernelView((held.pid,), ())
    assert held.release() == 0


# -- 5. a deflected turn ---------------------------------------------------------------------------
def test_a_deflected_turn_without_fallback_exits_75_and_leaves_no_child(procs, holder, family,
                                                                        tmp_path):
    port = 18974
    primary = tmp_path / "primary-ran"
    held = holder("-b", lane(port))
    wrapper = procs.start(run_argv(port, "touch", primary, flags=()), stderr=subprocess.PIPE,
                          text=True)
    _, err = wrapper.communicate(timeout=TIMEOUT)
    assert wrapper.returncode == 75, err
    assert not primary.exists()
    # An unreaped (or surviving) parked child would have been reparented to us at the exit.
    assert family.orphans() == []
    assert held.release() == 0


def test_a_deflected_turn_with_a_fallback_runs_the_fallback_only(procs, holder, family, tmp_path):
    port = 18975
    primary, fallback = tmp_path / "primary-ran", tmp_path / "fallback-ran"
    held = holder("-b", lane(port))
    wrapper = procs.start(run_argv(port, "touch", primary, flags=["-f", f"touch {fallback}"]),
                          stderr=subprocess.PIPE, text=True)
    _, err = wrapper.communicate(timeout=TIMEOUT)
    assert wrapper.returncode == 0, err
    assert fallback.exists() and not primary.exists()
    assert family.orphans() == []
    assert held.release() == 0


# -- 6-8. the command is the same whether it started at once or after a wait -----------------------
@pytest.mark.parametrize("mode", MODES)
def test_the_command_environment_is_byte_exact(mode, turn, lock_dir):
    port = 18976
    # A C-locale environment (a cron job's): lanelock's Python adds LC_CTYPE=C.UTF-8 to its own
    # os.environ (PEP 538), and that must not reach the command.
    inherited = {name: value for name, value in os.environb.items()
                 if name not in (b"LC_ALL", b"LC_CTYPE", b"LANG")}
    env = {**inherited, b"LANG": b"C", b"STARTER_NEWLINE": b"one\ntwo\n",
           b"STARTER_BAD_UTF8": b"\xff\xfe\xc3(", b"STARTER_\xe9_NAME": b"latin-1 name",
           b"STARTER_EMPTY": b"", b"STARTER_EQUALS": b"a=b=",
           # A surrounding turn's leftovers: the turn removes them.
           b"LANELOCK_FAILOVER_REASON": b"stale", b"LANELOCK_DEBUG_PAUSE": b"nowhere"}
    wrapper, out, err = turn(mode, port, "cat", "/proc/self/environ", env=env)
    assert wrapper.returncode == 0, err
    entries = out.split(b"\0")[:-1]
    seen = dict(entry.partition(b"=")[::2] for entry in entries)
    assert len(seen) == len(entries), "a variable appears twice"
    lock_path = seen.get(b"LANELOCK_LOCK_PATH", b"")
    assert os.path.samefile(lock_path, lock_dir / f"localhost-{port}.lock")
    expected = {name: value for name, value in env.items()
                if name not in (b"LANELOCK_FAILOVER_REASON", b"LANELOCK_DEBUG_PAUSE")}
    expected.update({b"LANELOCK_STATE": b"held", b"LANELOCK_LANE": f"localhost:{port}".encode(),
                     b"LANELOCK_LOCK_PATH": lock_path, b"LANELOCK_HELD": lock_path,
                     b"LANELOCK_SEAT": b"1",
                     b"LANELOCK_TURNS": seen.get(b"LANELOCK_TURNS", b""),
                     b"LANELOCK_SESSION": seen.get(b"LANELOCK_SESSION", b"")})
    assert seen == expected
    assert seen[b"LANELOCK_SESSION"], "the turn's session is named"
    assert re.fullmatch(rb"[0-9a-f]{32}", seen[b"LANELOCK_TURNS"]), "the turn is handed over by name"


def signal_state(out: bytes) -> dict[str, int]:
    """{"SigBlk": mask, "SigIgn": mask} from the command's /proc/self/status lines."""
    return {line.split(":")[0]: int(line.split()[1], 16) for line in out.decode().splitlines()}


@pytest.mark.parametrize("sigint", ["default", "ignored"])
@pytest.mark.parametrize("mode", MODES)
def test_the_command_signal_state_is_the_same_with_and_without_a_wait(mode, sigint, turn, procs):
    port = 18977
    # The command execs straight into grep: a shell's own $$ would show the shell's mask while it
    # waits for grep, not the command's.
    command = ["grep", "-E", "^Sig(Blk|Ign):", "/proc/self/status"]
    # `cmd &` in a script starts the wrapper with SIGINT ignored; the command must keep it so.
    popen = {"preexec_fn": lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)} \
        if sigint == "ignored" else {}
    baseline = procs.start(command, stdout=subprocess.PIPE, **popen)   # no lanelock at all
    expected = signal_state(baseline.communicate(timeout=TIMEOUT)[0])
    wrapper, out, err = turn(mode, port, *command, **popen)
    assert wrapper.returncode == 0, err
    state = signal_state(out)
    assert state == expected
    assert state["SigBlk"] == 0
    assert not state["SigIgn"] & SIGPIPE_BIT, "SIGPIPE must not stay ignored (Python's choice)"
    assert bool(state["SigIgn"] & SIGINT_BIT) == (sigint == "ignored")


@pytest.mark.parametrize("mode", MODES)
def test_inherited_descriptors_pass_through_and_nothing_else(mode, turn):
    port = 18978
    read_end, write_end = os.pipe()
    try:
        script = f"import os\nos.write({write_end}, b'through the turn')\n{LIST_FDS}"
        wrapper, out, err = turn(mode, port, sys.executable, "-c", script, pass_fds=(write_end,))
        assert wrapper.returncode == 0, err
        assert out.decode().strip() == str([0, 1, 2, write_end])
        os.close(write_end)
        write_end = -1
        assert os.read(read_end, 100) == b"through the turn"
    finally:
        os.close(read_end)
        if write_end >= 0:
            os.close(write_end)


# -- 9-10. the turn's command after a wait ---------------------------------------------------------
def test_a_parked_child_killed_during_the_wait_is_replaced(procs, holder, family, lock_dir):
    port = 18979
    held = holder("-b", lane(port))
    wrapper = procs.start(run_argv(port, "sh", "-c", 'echo "$$"; exit 7'), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
    blocked(wrapper.pid, lock_dir / f"localhost-{port}.lock")
    child = family.parked(wrapper.pid)
    os.kill(child, signal.SIGKILL)
    assert family.ended(child)
    assert held.release() == 0
    out, err = wrapper.communicate(timeout=TIMEOUT)
    assert wrapper.returncode == 7, err
    assert int(out) != child, "the killed child cannot have run the command"
    assert "Traceback" not in err
    assert family.orphans() == []


def test_a_missing_command_after_a_wait_gives_127_and_one_line(procs, holder, family, lock_dir):
    port = 18980
    held = holder("-b", lane(port))
    wrapper = procs.start(run_argv(port, "no-such-command"), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
    blocked(wrapper.pid, lock_dir / f"localhost-{port}.lock")
    # Found missing before the fork: nothing is parked for a command that cannot start.
    assert psutil.Process(wrapper.pid).children() == []
    assert held.release() == 0
    out, err = wrapper.communicate(timeout=TIMEOUT)
    assert (wrapper.returncode, out) == (127, "")
    assert err == "lanelock: no-such-command: command not found\n"
    assert family.orphans() == []


def test_a_caller_s_own_environment_changes_reach_the_command(tmp_path):
    """In-process use of the CLI (cli.main from Python): what the caller put in os.environ goes
    through; only Python's own C-locale LC_CTYPE is taken back out."""
    script = ("import os, sys\n"
              "os.environ['FOO'] = 'set-in-python'\n"
              "from lanelock.cli import main\n"
              "sys.exit(main(['run', '-b', '127.0.0.1:18981', '--', 'sh', '-c',\n"
              "               'echo FOO=${FOO-unset} LC_CTYPE=${LC_CTYPE-unset}']))\n")
    env = {key: value for key, value in environ().items()
           if not key.startswith(("LC_", "LANG"))}
    done = subprocess.run([sys.executable, "-c", script], env={**env, "LC_ALL": "", "LANG": "C"},
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["FOO=set-in-python", "LC_CTYPE=unset"]
