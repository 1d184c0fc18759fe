"""Spawn the turn's command, stand between it and the world's signals, and report how it ended.

- The child never inherits the lock fd (O_CLOEXEC), so nothing it leaves behind can hold the lane.
- The child gets a parent-death signal (SIGKILL): if the wrapper is killed, even with SIGKILL, the
  kernel drops the lane and the generation stops with it; no turn continues ungated. The wrapper
  may die between fork() and prctl(), so the child checks its parent afterwards. The kernel drops
  the lock before it sends that signal: the holder record names the child, and the next turn waits
  for it to be gone (store/outlived.py).
- The child is forked before the lane is taken and parked until the lane is ours (Starter): the
  fork is off the hand-off path, where flock(1)'s whole cost is one fork of a small C program.
- INT/TERM/HUP/QUIT/USR1/USR2 sent to the wrapper are forwarded to the child (flock(1) does not,
  bootkube#502); the wrapper waits and exits with the child's status. A signal the terminal sent to
  the whole foreground group (si_code SI_KERNEL) already reached the child and is not sent twice --
  but only when the child is in our process group, and never a hangup that came to us as the
  session leader: the kernel sends that to the leader alone (tmux, `ssh -t`, a pty; PITFALLS 14),
  and a child that never hears of it would keep the lane forever.
- A stopped child (SIGSTOP, ^Z) keeps the lane, as flock does; the wrapper tells the turn (on_stop)
  so the holder record says since when, and on ^Z it records that before stopping itself. INT, TERM,
  HUP or QUIT forwarded to a stopped child is followed by SIGCONT, so the child acts on it and the
  lane frees (a stopped child would hold it until someone resumed it).
- Signals are taken with sigwaitinfo() while blocked: no handler races, no polling.
"""

from __future__ import annotations

import errno
import os
import signal
import time

from .. import exitcodes, proc
from . import launch

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT,
             signal.SIGUSR1, signal.SIGUSR2)
FROM_TERMINAL = (signal.SIGINT, signal.SIGQUIT, signal.SIGHUP)
ENDING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)   # also resume a stopped child
SI_KERNEL = 0x80
PR_SET_PDEATHSIG = 1
_NOT_FOUND = (errno.ENOENT, errno.ENOTDIR)


class Outcome:
    __slots__ = ("exit_code", "signal", "tty_signal", "error")

    def __init__(self, exit_code: int, signal: int | None = None, tty_signal: int | None = None,
                 error: str | None = None):
        self.exit_code = exit_code
        self.signal = signal            # the signal the child died of
        self.tty_signal = tty_signal    # a terminal-generated signal the wrapper also received
        self.error = error              # why the command could not be started


class Starter:
    """The turn's child, forked before the lane is taken and parked at the starting line.

    Forking a Python process and running its after-fork code costs milliseconds; after the lock,
    that would delay every hand-off. So the wrapper forks first: the parked child sets its
    parent-death signal and the command's signal dispositions, then blocks on a pipe. go() sends
    it the turn's environment and it execs at once; cancel() (a deflected turn) lets it exit.

    While parked, the child is what the command will be: a ^C to the terminal's group or the
    wrapper's death ends it too, and it holds no lock (it is forked before the lock file is open).
    """

    def __init__(self, argv: list[str], search_path: str | None = None):
        self.argv = list(argv)
        if search_path is None:
            search_path = os.environ.get("PATH", os.defpath)
        self.path, self.failure = resolve(self.argv[0], search_path)
        self.pid: int | None = None
        self.started = False
        self._go = self._status = -1
        self.mask = signal.pthread_sigmask(signal.SIG_BLOCK, ())   # the command's signal mask
        # An inherited SIGCHLD=SIG_IGN would make the kernel reap the child behind our back.
        self.old_chld = signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        if not self.failure:
            self._fork()

    def _fork(self) -> None:
        prctl = prepare()
        go_read, self._go = os.pipe2(os.O_CLOEXEC)
        self._status, status_write = os.pipe2(os.O_CLOEXEC)
        parent = os.getpid()
        inherited_int = signal.getsignal(signal.SIGINT)
        try:
            pid = os.fork()
        except OSError:
            for fd in (go_read, status_write):
                os.close(fd)
            self.close()
            raise
        if pid == 0:  # pragma: no cover - the child execs or exits
            # Our copy of the go pipe's write end would keep the child from ever seeing EOF.
            os.close(self._go)
            os.close(self._status)
            _parked(self.path, self.argv, parent, go_read, status_write, prctl, inherited_int,
                    self.mask)
        self.pid = pid
        os.close(go_read)
        os.close(status_write)

    def go(self, changes: dict[str, str | None]) -> int:
        """Start the command with our environment plus changes (None unsets). 0, or the errno
        that stopped the command from starting (the child is reaped then)."""
        self.started = True
        if self.failure:
            return self.failure
        payload = b"".join(
            os.fsencode(name) + (b"" if value is None else b"=" + os.fsencode(value)) + b"\0"
            for name, value in changes.items())
        message = launch.GO + len(payload).to_bytes(4, "big") + payload
        try:
            _write_all(self._go, message)
        except BrokenPipeError:   # the parked child was killed while it waited: start afresh
            self.close()
            os.waitpid(self.pid, 0)
            self._fork()
            _write_all(self._go, message)
        os.close(self._go)
        self._go = -1
        with os.fdopen(self._status, "rb") as pipe:   # EOF: the exec succeeded
            self._status = -1
            failure = pipe.read()
        if failure:
            os.waitpid(self.pid, 0)
            self.pid = None
            return int(failure or b"0") or errno.EINVAL
        return 0

    def cancel(self) -> None:
        """The turn will not run this command: the parked child exits and is reaped."""
        self.close()
        if self.pid is not None:
            pid, self.pid = self.pid, None
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
        self.restore()

    def close(self) -> None:
        for fd in (self._go, self._status):
            if fd >= 0:
                os.close(fd)
        self._go = self._status = -1

    def restore(self) -> None:
        signal.signal(signal.SIGCHLD, self.old_chld)

    # `with Starter(argv) as starter:` -- whatever happens in the block (a deflection, ^C while
    # waiting for the lane, an error), a child that was not started leaves with it.
    def __enter__(self) -> "Starter":
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if not self.started:
            self.cancel()


class Unforked:
    """Stands for a Starter that could not fork ahead (the turn forks later, once decided)."""

    started = False
    pid = None

    def cancel(self) -> None:
        pass

    def __enter__(self) -> "Unforked":
        return self

    def __exit__(self, kind, value, traceback) -> None:
        pass


def run(starter: Starter, changes: dict[str, str | None], *, kill_after: float | None = None,
        on_spawn=None, on_stop=None) -> Outcome:
    """Start the starter's command with our environment plus changes, and wait for it. Returns
    the child's exit status mapped to the shell's convention. on_spawn() runs in the wrapper once
    the child exists, with our signals blocked, so a thread it starts inherits the block and can
    never swallow the SIGCHLD we wait for."""
    watched = {signal.SIGCHLD, signal.SIGTSTP, *FORWARDED}
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, watched)
    try:
        failure = starter.go(changes)
        if failure:
            return _spawn_failure(starter.argv[0], failure, starter.path)
        if on_spawn is not None:
            on_spawn()
        pid, starter.pid = starter.pid, None
        return _supervise(pid, watched, kill_after, on_stop)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        starter.restore()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


_PRCTL: list = []


def prepare():
    """Load prctl (ctypes) once, before the fork (the child must not pay for it)."""
    if not _PRCTL:
        try:
            import ctypes

            _PRCTL.append(ctypes.CDLL(None, use_errno=True).prctl)
        except (ImportError, OSError, AttributeError):
            _PRCTL.append(None)
    return _PRCTL[0]


def resolve(command: str, search_path: str) -> tuple[str, int]:
    """(executable path, 0) or ('', errno), searched as execvp would, but in the wrapper: a PATH
    search in the forked child (os.execvpe) costs ~1.5 ms of failed execve() calls per turn."""
    if "/" in command:
        return command, 0
    denied = 0
    for directory in search_path.split(os.pathsep):
        candidate = os.path.join(directory or ".", command)
        try:
            st = os.stat(candidate)
        except OSError:
            continue
        if not os.path.isdir(candidate) and os.access(candidate, os.X_OK) and st.st_mode & 0o111:
            return candidate, 0
        denied = errno.EACCES   # like execvp: remember it, keep looking
    return "", denied or errno.ENOENT


def _parked(path, argv, parent, go_read, status_write, prctl, inherited_int,
            mask) -> None:  # pragma: no cover - runs in the forked child
    try:
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:   # the wrapper died before prctl took effect
            os.kill(os.getpid(), signal.SIGKILL)
        # The command's dispositions from here on: while parked, a signal does to this child what
        # it would do to the command. Python ignores SIGPIPE and SIGXFSZ for itself.
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
        if inherited_int is not signal.SIG_IGN:   # keep an ignored SIGINT ignored (cmd &)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        env = launch.command_environ()
    except BaseException:   # noqa: BLE001 - nothing may escape into a copy of the wrapper
        os.write(status_write, str(errno.EINVAL).encode())
        os._exit(exitcodes.NOT_FOUND)
    launch.wait_and_exec(go_read, status_write, path, argv, env)


SHELL_BUILTINS = frozenset(
    "cd export source . alias unalias set unset exit ulimit umask eval exec read type wait jobs "
    "fg bg trap shift return declare local readonly pushd popd dirs history hash builtin".split())


def _spawn_failure(command: str, code: int, path: str = "") -> Outcome:
    """The one line that says why the command did not start, in words that lead somewhere."""
    if not command:
        return Outcome(exitcodes.NOT_FOUND, error="the command is empty (an empty argument "
                                                   "after --?)")
    if code in _NOT_FOUND:
        if "/" not in command and command in SHELL_BUILTINS:
            return Outcome(exitcodes.NOT_FOUND, error=(
                f"{command}: a shell builtin, not a program: run it in a shell, e.g. "
                f"lanelock run -- sh -c '{command} ...'"))
        interpreter = _missing_interpreter(path or command)
        if interpreter:
            return Outcome(exitcodes.NOT_FOUND, error=(
                f"{command}: its interpreter {interpreter} was not found (the script's #! line)"))
        return Outcome(exitcodes.NOT_FOUND, error=f"{command}: command not found")
    return Outcome(exitcodes.CANNOT_EXECUTE, error=f"{command}: cannot execute: {os.strerror(code)}")


def _missing_interpreter(command: str) -> str | None:
    """execve() says ENOENT both for a missing file and for a script whose #! interpreter is
    missing; only the second has a file to read."""
    if "/" not in command:
        return None
    try:
        with open(command, "rb") as handle:
            first = handle.readline(256)
    except OSError:
        return None
    if not first.startswith(b"#!"):
        return None
    words = first[2:].split()
    return words[0].decode("utf-8", "replace") if words else "(none)"


def _supervise(pid: int, watched: set, kill_after: float | None, on_stop=None) -> Outcome:
    tty_signal = None
    deadline = None
    while True:
        if deadline is None:
            info = signal.sigwaitinfo(watched)
        else:
            info = signal.sigtimedwait(watched, max(0.0, deadline - time.monotonic()))
            if info is None:   # the child ignored the forwarded signal for kill_after seconds
                _kill(pid, signal.SIGKILL)
                deadline = None
                continue
        if info.si_signo == signal.SIGCHLD:
            if info.si_pid == pid and info.si_code in (os.CLD_STOPPED, os.CLD_CONTINUED) \
                    and on_stop is not None:
                on_stop(info.si_code == os.CLD_STOPPED)
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            continue
        from_terminal = info.si_code == SI_KERNEL and _group_got_it(pid, info.si_signo)
        if info.si_signo == signal.SIGTSTP:
            # ^Z: the child stops itself (it is in our group); kill -TSTP: it hears it from us.
            # Either way we stop too, as job control expects, having first said so.
            if not from_terminal:
                _kill(pid, signal.SIGTSTP)
            if on_stop is not None:
                on_stop(True)
            os.kill(os.getpid(), signal.SIGSTOP)
            continue
        if from_terminal and info.si_signo in FROM_TERMINAL:
            tty_signal = info.si_signo   # the child is in our foreground group and got it too
        else:
            _kill(pid, info.si_signo)
        if info.si_signo in ENDING and proc.state(pid) == b"T":   # not t: a tracer's stop
            # A stopped command cannot act on the signal: it would keep the lane until someone
            # resumes it. Continue it so it ends (as kill(1) users and systemd do: TERM, then CONT).
            _kill(pid, signal.SIGCONT)
        if kill_after is not None and deadline is None and info.si_signo in (
                signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
            deadline = time.monotonic() + kill_after
    died_of = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
    return Outcome(exitcodes.from_wait_status(status), signal=died_of, tty_signal=tty_signal)


def _group_got_it(child: int, signo: int) -> bool:
    """Did a signal the kernel sent us for the terminal reach the child too? Only when it went to
    our whole process group and the child is in it. A hangup goes to the session leader alone:
    when we are the leader, the child has not had it."""
    if signo == signal.SIGHUP and os.getsid(0) == os.getpid():
        return False
    try:
        return os.getpgid(child) == os.getpgrp()
    except OSError:
        return False


def _kill(pid: int, signo: int) -> None:
    try:
        os.kill(pid, signo)
    except ProcessLookupError:
        pass


def reraise_terminal_signal(outcome: Outcome) -> None:
    """A child killed by the terminal's ^C or ^\\: die of the same signal, so the calling shell
    sees exactly what it would without lanelock (bash stops a loop only for a signal death)."""
    if outcome.signal is not None and outcome.signal == outcome.tty_signal:
        from ..guard import flush_quietly

        flush_quietly()
        signal.signal(outcome.signal, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {outcome.signal})
        os.kill(os.getpid(), outcome.signal)
