"""The processes a test starts, killed by pid and process group at teardown; deaths and stops
waited for in the kernel (a pidfd, waitid()), lines read with a deadline, and wait_for() for the
states no process can report."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import threading
import time

import psutil

from support.cli import TIMEOUT


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


def line_with(stream, words: str, timeout: float = TIMEOUT) -> str:
    """The first line from a binary pipe that holds words (the lines before it skipped),
    within timeout seconds each; AssertionError at EOF."""
    while True:
        line = read_line(stream, timeout)
        assert line, f"no line with {words!r} before the end"
        if words in line:
            return line


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
