"""Spawn the turn's command, stand between it and the world's signals, and report how it ended.

A turn is its command's whole process tree, as one process group:
- The command runs in a process group of its own, led by it (set from both sides of the fork, so
  neither the wrapper nor the command can run ahead of it). `curl` inside `sh -c` is as much the
  turn as the shell: INT/TERM/HUP/QUIT/USR1/USR2 sent to the wrapper go to the whole group (flock(1)
  forwards nothing, bootkube#502), a stopped group is continued after an ending signal so it can
  act on it, and --kill-after kills the group.
- The lane is not free while any process of the group runs: when the command (the group's leader)
  has ended and others of its group remain, the wrapper says so once and keeps the lane until the
  group is empty; it then exits with the command's status. A wrapper killed outright leaves the
  same promise to the holder record: it names the group, and the next turn waits until the kernel
  says the group is empty (store/outlived.py).
- A process group, not a cgroup: a cgroup needs a delegated, writable subtree, which most users
  of a desktop or a container do not have, and it leaves a directory behind that someone must
  remove -- the kernel would no longer be the only janitor of a killed turn. A group costs one
  setpgid(), needs no privilege, and the kernel alone says when it is empty (kill(-pgid, 0)).
  What it cannot hold: a process that leaves the group on purpose (setsid, setpgid: a daemon) is
  outside the turn, and does not keep the lane.
- The terminal: a terminal signals and lets read only its foreground group. When the wrapper is
  in the foreground as a job of its own, the command's group is given it while the command runs
  and the wrapper takes it back when the command ends, as a shell does for a job (terminal.py;
  sharing its group, with a pager or a script's shell, it keeps it and forwards). ^C and
  ^\\ reach the command's group directly; a command that dies of one while it has the terminal
  makes the wrapper send it to its own group, the one that had the terminal, and die of it
  (reraise_terminal_signal), so a calling script's loop stops as without lanelock. ^Z stops the
  command's group: the wrapper records the stop, takes the terminal back and stops itself, so
  the shell sees the job stopped; continued (fg) it gives the terminal back to the command's
  group if its own has it again and continues the group (bg: the group continues without the
  terminal; a background command that reads the terminal stops the job again). A hangup
  reaches the session leader alone: a wrapper that is one forwards it to the group
  like any signal.
- The child never inherits the lock fd (O_CLOEXEC), so nothing it leaves behind can hold the lock
  itself; only the group keeps the lane.
- The child gets a parent-death signal (SIGKILL): if the wrapper is killed, even with SIGKILL, the
  command (the leader) ends with it; the rest of its group runs to its end, still gated. The
  wrapper may die between fork() and prctl(), so the child checks its parent afterwards.
- The child is forked before the lane is taken and parked until the lane is ours (Starter): the
  fork is off the hand-off path, where flock(1)'s whole cost is one fork of a small C program.
- A stopped command (SIGSTOP, ^Z) keeps the lane, as flock does; the wrapper tells the turn
  (on_stop) so the holder record says since when.
- Signals are taken with sigwaitinfo() while blocked: no handler races, no polling.
"""

from __future__ import annotations

import errno
import os
import signal
import time

from .. import exitcodes, proc
from . import launch
from .terminal import Terminal

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT,
             signal.SIGUSR1, signal.SIGUSR2)
FROM_TERMINAL = (signal.SIGINT, signal.SIGQUIT, signal.SIGHUP)
KEYBOARD = (signal.SIGINT, signal.SIGQUIT)   # what a terminal sends its foreground group
ENDING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)   # then SIGCONT the group
JOB_STOPS = (signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU)
SI_KERNEL = 0x80
PR_SET_PDEATHSIG = 1
_NOT_FOUND = (errno.ENOENT, errno.ENOTDIR)


class Outcome:
    __slots__ = ("exit_code", "signal", "tty_signal", "error", "handed")

    def __init__(self, exit_code: int, signal: int | None = None, tty_signal: int | None = None,
                 error: str | None = None, handed: bool = False):
        self.exit_code = exit_code
        self.signal = signal            # the signal the child died of
        self.tty_signal = tty_signal    # a signal the terminal sent the command or the wrapper
        self.error = error              # why the command could not be started
        self.handed = handed            # tty_signal came while the command had the terminal


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
        self.mask = command_mask()   # the command's signal mask
        # An inherited SIGCHLD=SIG_IGN would make the kernel reap the child behind our back.
        self.old_chld = signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        self.terminal: Terminal | None = None
        if not self.failure:
            self._fork()
            # Looked at before the lane is taken: after it, every millisecond delays the hand-off.
            self.terminal = Terminal()

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
        # The group, from this side too: whichever of us runs first, it exists once fork()
        # returns here, before the turn records it or hands it the terminal.
        try:
            os.setpgid(pid, pid)
        except OSError:   # the child did it first, or died already (go() will see)
            pass
        os.close(go_read)
        os.close(status_write)

    def go(self, changes: dict[str, str | None]) -> int:
        """Start the command with our environment plus changes (None unsets). 0, or the errno
        that stopped the command from starting (the child is reaped then). The terminal is
        handed to the command's group before it execs, when we are a job of our own."""
        self.started = True
        if self.failure:
            return self.failure
        payload = b"".join(
            os.fsencode(name) + (b"" if value is None else b"=" + os.fsencode(value)) + b"\0"
            for name, value in changes.items())
        message = launch.GO + len(payload).to_bytes(4, "big") + payload
        terminal = self.terminal
        if terminal is not None:
            terminal.hand_upfront(self.pid)
        try:
            _write_all(self._go, message)
        except BrokenPipeError:   # the parked child was killed while it waited: start afresh
            self.close()
            os.waitpid(self.pid, 0)
            self._fork()
            if terminal is not None:
                terminal.take_back()
                terminal.hand_upfront(self.pid)
            _write_all(self._go, message)
        os.close(self._go)
        self._go = -1
        with os.fdopen(self._status, "rb") as pipe:   # EOF: the exec succeeded
            self._status = -1
            failure = pipe.read()
        if failure:
            os.waitpid(self.pid, 0)
            self.pid = None
            if terminal is not None:
                terminal.take_back()
            return int(failure or b"0") or errno.EINVAL
        return 0

    def cancel(self) -> None:
        """The turn will not run this command: the parked child exits and is reaped."""
        self.close()
        if self.terminal is not None:
            self.terminal.close()
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


_STARTED_WITH: list = []   # the signal mask this process had before hold_sigchld()


def hold_sigchld() -> None:
    """Block SIGCHLD in this process from now on, before the turn starts any thread: a thread
    inherits its creator's mask, and one that does not block SIGCHLD can be handed the command's
    (the kernel gives a process's signal to any thread that does not block it, whenever the
    waiting thread is not in sigwaitinfo at that moment) -- its action being to ignore it, it is
    lost, and run() waits for ever. The commands still start with the mask of before
    (command_mask)."""
    if not _STARTED_WITH:
        _STARTED_WITH.append(signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD}))


def command_mask() -> set:
    """The signal mask a command starts with: this process's, as it was before hold_sigchld()."""
    if _STARTED_WITH:
        return set(_STARTED_WITH[0])
    return signal.pthread_sigmask(signal.SIG_BLOCK, ())


def run(starter: Starter, changes: dict[str, str | None], *, kill_after: float | None = None,
        on_spawn=None, on_stop=None, on_linger=None) -> Outcome:
    """Start the starter's command with our environment plus changes, and wait for it and the
    rest of its process group. Returns the child's exit status mapped to the shell's
    convention. on_spawn() runs in the wrapper once the child exists, with our signals blocked,
    so a thread it starts inherits the block and can never swallow the SIGCHLD we wait for.
    on_linger(pids) runs once if the command ends while others of its group still run (pids:
    those /proc shows)."""
    watched = {signal.SIGCHLD, signal.SIGTSTP, signal.SIGCONT, *FORWARDED}
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, watched | {signal.SIGTTOU})
    terminal = starter.terminal or Terminal()
    try:
        failure = starter.go(changes)
        if failure:
            return _spawn_failure(starter.argv[0], failure, starter.path)
        if on_spawn is not None:
            on_spawn()
        pid, starter.pid = starter.pid, None
        return _Supervision(pid, terminal, kill_after, on_stop, on_linger).run(watched)
    finally:
        terminal.close()
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
        os.setpgid(0, 0)   # the turn's own group (the wrapper sets it too: whoever is first)
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


class _Supervision:
    """The wait for one command and its process group (pgid == the command's pid)."""

    def __init__(self, pid: int, terminal: Terminal, kill_after: float | None, on_stop,
                 on_linger):
        self.pid = pid
        self.terminal, self.kill_after = terminal, kill_after
        self.on_stop, self.on_linger = on_stop, on_linger
        self.status: int | None = None   # the command's wait status, once it has ended
        self.tty_signal: int | None = None
        self.deadline: float | None = None
        self.lingering = None            # outlived.Command: the group, once the command ended
        self._waiter = None              # the thread that waits for the rest of the group
        self.handed = False

    def run(self, watched: set) -> Outcome:
        while True:
            if self.deadline is None:
                info = signal.sigwaitinfo(watched)
            else:
                info = signal.sigtimedwait(watched, max(0.0, self.deadline - time.monotonic()))
                if info is None:   # the group ignored the forwarded signal for kill_after seconds
                    _kill_group(self.pid, signal.SIGKILL)
                    self.deadline = None
                    continue
            signo = info.si_signo
            if signo == signal.SIGCHLD:
                if self._reap():
                    break
            elif signo == signal.SIGCONT:
                self._resumed()
            elif signo == signal.SIGTSTP:
                # ^Z to our group (the terminal was not handed) or kill -TSTP of the wrapper: the
                # group stops, and so do we, as job control expects, having first said so.
                _kill_group(self.pid, signal.SIGTSTP)
                if self.on_stop is not None and self.status is None:
                    self.on_stop(True)
                self._stop_self()
            else:
                if info.si_code == SI_KERNEL and signo in FROM_TERMINAL:
                    # Sent by the terminal to us, not to the command's group (ours has the
                    # foreground, or a hangup came to us as the session leader): the group has
                    # not had it.
                    self.tty_signal = signo
                _kill_group(self.pid, signo)
                if signo in ENDING:
                    self._continue_if_stopped()
                if self.kill_after is not None and self.deadline is None and signo in ENDING:
                    self.deadline = time.monotonic() + self.kill_after
        status = self.status
        died_of = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
        return Outcome(exitcodes.from_wait_status(status), signal=died_of,
                       tty_signal=self.tty_signal, handed=self.handed)

    def _reap(self) -> bool:
        """The command's changes of state; True once it has ended and its group is empty."""
        while self.status is None:
            try:
                done, status = os.waitpid(self.pid, os.WNOHANG | os.WUNTRACED | os.WCONTINUED)
            except ChildProcessError:   # pragma: no cover - it is our child until we reap it
                return True
            if not done:
                return False
            if os.WIFSTOPPED(status):
                self._stopped(os.WSTOPSIG(status))
            elif os.WIFCONTINUED(status):
                if self.on_stop is not None:
                    self.on_stop(False)
            else:
                self._ended(status)
        return self._group_empty()

    def _ended(self, status: int) -> None:
        self.status = status
        died_of = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
        if died_of in KEYBOARD and self.terminal.holds():
            self.tty_signal = died_of   # ^C or ^\ at the terminal the command had
            self.handed = True
        self.terminal.take_back()

    def _group_empty(self) -> bool:
        """The command has ended: is its group empty? If not, say so once and have a thread wait
        for the group's processes (their pidfds) and wake us with a SIGCHLD when none is left."""
        from ..facts import own_start_ticks
        from ..store import outlived

        if self.lingering is None:
            if not outlived.group_exists(self.pid):   # the usual end: one syscall
                return True
            # Every process of the group started after this wrapper; its session is ours.
            self.lingering = outlived.Command(self.pid, own_start_ticks() or 0, self.pid,
                                              os.getsid(0))
        if self.lingering.look() == []:
            return True
        if self._waiter is None:
            if self.on_linger is not None:
                self.on_linger(list(self.lingering.members))
            import threading

            group = outlived.Command(self.pid, self.lingering.ticks, self.pid,
                                     self.lingering.sid)

            def wake() -> None:
                outlived.gone(group, None)
                os.kill(os.getpid(), signal.SIGCHLD)

            # Started with our signals blocked: it inherits the block and never takes them.
            self._waiter = threading.Thread(target=wake, name="lanelock-group", daemon=True)
            self._waiter.start()
        return False

    def _stopped(self, stop_signal: int) -> None:
        if self.on_stop is not None:
            self.on_stop(True)
        if proc.state(self.pid) != b"T":   # continued meanwhile: nothing to do
            return
        if stop_signal in (signal.SIGTTIN, signal.SIGTTOU) and self.terminal.ours():
            # It wanted the terminal while our group has it (run in the background, then `fg`):
            # give it the terminal and let it go on.
            self.terminal.hand(self.pid)
            _kill_group(self.pid, signal.SIGCONT)
        elif (stop_signal == signal.SIGTSTP and self.terminal.holds()) or (
                stop_signal in JOB_STOPS and self.terminal.fd >= 0 and not self.terminal.ours()):
            # ^Z at the terminal the command had, or a background job that wants the terminal:
            # the job stops, so the shell can take the terminal and `fg` or `bg` it.
            self._stop_self()

    def _stop_self(self) -> None:
        """Stop (SIGSTOP cannot be blocked or, in an orphaned group, discarded) and, continued,
        continue the group."""
        self.terminal.take_back()
        os.kill(os.getpid(), signal.SIGSTOP)
        self._resumed()

    def _resumed(self) -> None:
        """Continued (fg, bg, kill -CONT): the group too, with the terminal if ours has it."""
        if self.status is None and self.terminal.fd >= 0 and self.terminal.ours():
            self.terminal.hand(self.pid)
        _kill_group(self.pid, signal.SIGCONT)
        if self.on_stop is not None and self.status is None:
            # Said here too: a command that ignored the stop is never reported continued.
            self.on_stop(False)

    def _continue_if_stopped(self) -> None:
        """A stopped command cannot act on an ending signal: it would keep the lane until someone
        resumed it. Continue its group so it ends (as kill(1) users and systemd do: TERM, then
        CONT). Once the command has ended, the rest of the group is continued unasked."""
        if self.status is not None or proc.state(self.pid) == b"T":   # not t: a tracer's stop
            _kill_group(self.pid, signal.SIGCONT)


def end_group(pgid: int, kill: bool = False) -> None:
    """Stop a turn's process group from another thread (its lane was lost for good, run
    --on-lost stop): SIGTERM, and SIGCONT so a stopped group can act on it; kill: SIGKILL."""
    if kill:
        _kill_group(pgid, signal.SIGKILL)
        return
    _kill_group(pgid, signal.SIGTERM)
    _kill_group(pgid, signal.SIGCONT)


def _kill_group(pgid: int, signo: int) -> None:
    try:
        os.killpg(pgid, signo)
    except (ProcessLookupError, PermissionError):   # empty, or only another user's left
        pass


def reraise_terminal_signal(outcome: Outcome) -> None:
    """A child killed by the terminal's ^C or ^\\: die of the same signal, so the calling shell
    sees exactly what it would without lanelock. When the command had the terminal, the key
    would have signalled our whole group had we not handed the foreground on: the signal goes
    to our group, where a calling script's shell is (bash ends a loop only when it had the
    signal itself and its child died of it)."""
    if outcome.signal is not None and outcome.signal == outcome.tty_signal:
        from ..guard import flush_quietly

        flush_quietly()
        signal.signal(outcome.signal, signal.SIG_DFL)
        try:
            if outcome.handed:
                os.killpg(os.getpgrp(), outcome.signal)   # pending here until unblocked
            else:
                os.kill(os.getpid(), outcome.signal)
        except OSError:
            os.kill(os.getpid(), outcome.signal)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {outcome.signal})
