"""Spawn the turn's command, stand between it and the world's signals, and report how it ended.

- The child never inherits the lock fd (O_CLOEXEC), so nothing it leaves behind can hold the lane.
- The child gets a parent-death signal (SIGKILL): if the wrapper is killed, even with SIGKILL, the
  kernel drops the lane and the generation stops with it; no turn continues ungated. The wrapper
  may die between fork() and prctl(), so the child checks its parent afterwards.
- INT/TERM/HUP/QUIT/USR1/USR2 sent to the wrapper are forwarded to the child (flock(1) does not,
  bootkube#502); the wrapper waits and exits with the child's status. A signal the terminal sent to
  the whole foreground group (si_code SI_KERNEL) already reached the child and is not sent twice.
- Signals are taken with sigwaitinfo() while blocked: no handler races, no polling.
"""

from __future__ import annotations

import errno
import os
import signal
import time

from . import exitcodes

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT,
             signal.SIGUSR1, signal.SIGUSR2)
FROM_TERMINAL = (signal.SIGINT, signal.SIGQUIT, signal.SIGHUP)
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


def run(argv: list[str], env: dict[str, str], *, kill_after: float | None = None,
        on_spawn=None) -> Outcome:
    """Run argv to completion. Returns the child's exit status mapped to the shell's convention.
    on_spawn() runs in the wrapper once the child exists, with our signals blocked, so a thread it
    starts inherits the block and can never swallow the SIGCHLD we wait for."""
    libc_prctl = prepare()
    path, failure = resolve(argv[0], env.get("PATH", os.defpath))
    if failure:
        return _spawn_failure(argv[0], failure)
    watched = {signal.SIGCHLD, *FORWARDED}
    # An inherited SIGCHLD=SIG_IGN would make the kernel reap the child behind our back.
    old_chld = signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    inherited_int = signal.getsignal(signal.SIGINT)
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, watched)
    try:
        read_end, write_end = os.pipe2(os.O_CLOEXEC)
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child execs or exits
            _child(path, argv, env, parent, write_end, libc_prctl, old_mask, inherited_int)
        os.close(write_end)
        with os.fdopen(read_end, "rb") as pipe:
            failure = pipe.read()
        if failure:
            os.waitpid(pid, 0)
            return _spawn_failure(argv[0], int(failure or b"0"))
        if on_spawn is not None:
            on_spawn()
        return _supervise(pid, watched, kill_after)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        signal.signal(signal.SIGCHLD, old_chld)


_PRCTL: list = []


def prepare():
    """Load prctl (ctypes) ahead of time: a --wait turn calls this before it blocks, so the
    milliseconds ctypes costs are not spent between the holder's release and our child's start."""
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


def _child(path, argv, env, parent, write_end, prctl, old_mask, inherited_int) -> None:  # pragma: no cover
    code = 0
    try:
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:   # the wrapper died before prctl took effect
            os.kill(os.getpid(), signal.SIGKILL)
        # Python ignores SIGPIPE and SIGXFSZ for itself; the command must start with the defaults.
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
        if inherited_int is not signal.SIG_IGN:   # keep an ignored SIGINT ignored (cmd &)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        os.execve(path, argv, env)
    except OSError as error:
        code = error.errno or errno.EINVAL
    except BaseException:
        code = errno.EINVAL
    try:
        os.write(write_end, str(code).encode())
    finally:
        os._exit(exitcodes.NOT_FOUND)


def _spawn_failure(command: str, code: int) -> Outcome:
    if code in _NOT_FOUND:
        return Outcome(exitcodes.NOT_FOUND, error=f"{command}: command not found")
    return Outcome(exitcodes.CANNOT_EXECUTE, error=f"{command}: cannot execute: {os.strerror(code)}")


def _supervise(pid: int, watched: set, kill_after: float | None) -> Outcome:
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
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            continue
        if info.si_code == SI_KERNEL and info.si_signo in FROM_TERMINAL:
            tty_signal = info.si_signo   # the child is in our foreground group and got it too
        else:
            _kill(pid, info.si_signo)
        if kill_after is not None and deadline is None and info.si_signo in (
                signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
            deadline = time.monotonic() + kill_after
    died_of = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
    return Outcome(exitcodes.from_wait_status(status), signal=died_of, tty_signal=tty_signal)


def _kill(pid: int, signo: int) -> None:
    try:
        os.kill(pid, signo)
    except ProcessLookupError:
        pass


def reraise_terminal_signal(outcome: Outcome) -> None:
    """A child killed by the terminal's ^C or ^\\: die of the same signal, so the calling shell
    sees exactly what it would without lanelock (bash stops a loop only for a signal death)."""
    if outcome.signal is not None and outcome.signal == outcome.tty_signal:
        import sys

        sys.stdout.flush()
        sys.stderr.flush()
        signal.signal(outcome.signal, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {outcome.signal})
        os.kill(os.getpid(), outcome.signal)
