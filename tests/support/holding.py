"""A lane held by a real `lanelock run` in the background: its command says "ready PID" on a
pipe the test reads and holds until the test writes its exit status (never a sleep)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from support.cli import TIMEOUT, environ
from support.processes import Processes, read_line


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
