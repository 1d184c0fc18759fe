"""A server process that says on stderr when it listens; the rest of its stderr drained by a
thread, so it never blocks on a full pipe."""

from __future__ import annotations

import re
import signal
import subprocess
import threading
import time

from support.cli import TIMEOUT, environ
from support.processes import read_line


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
