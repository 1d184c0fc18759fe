"""What every step of the duel shares: the turns' reports read back, the environment that lets
each turn import this very lanelock, and how long a phase may take."""

from __future__ import annotations

import functools
import json
import os
import select
import subprocess
import sys
import time

PHASE_TIMEOUT = 30.0
MINIMAL_PATH = "/usr/bin:/bin"


class Reports:
    """JSON lines from every turn's stand-in, read with a deadline."""

    def __init__(self, fd: int):
        self.fd, self.buffer, self.seen = fd, b"", []

    def wait(self, match, timeout: float = PHASE_TIMEOUT) -> dict | None:
        deadline = time.monotonic() + timeout
        while True:
            for report in self.seen:
                if match(report):
                    self.seen.remove(report)
                    return report
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            ready, _, _ = select.select([self.fd], [], [], remaining)
            if not ready:
                return None
            chunk = os.read(self.fd, 65536)
            if not chunk:
                return None
            self.buffer += chunk
            *lines, self.buffer = self.buffer.split(b"\n")
            for line in lines:
                try:
                    report = json.loads(line)
                except ValueError:
                    continue
                if isinstance(report, dict) and "role" in report:
                    self.seen.append(report)


def importable(env: dict[str, str]) -> dict[str, str]:
    """Running from a checkout (not installed): let the turns import the same lanelock."""
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if "site-packages" not in package_parent and not _installed_here(package_parent):
        env["PYTHONPATH"] = package_parent + (
            os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


@functools.lru_cache(maxsize=None)
def _installed_here(package_parent: str) -> bool:
    """An editable install finds the package from any cwd; a bare checkout only from its own."""
    try:
        probe = subprocess.run([sys.executable, "-c", "import lanelock, os; print(os.path.dirname("
                                "os.path.dirname(os.path.abspath(lanelock.__file__))))"],
                               cwd="/", env={"PATH": MINIMAL_PATH}, capture_output=True, text=True,
                               timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.stdout.strip() == package_parent
