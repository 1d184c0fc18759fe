"""The routing stand-in (`python -m lanelock.testing.routed`): an engine that runs each request on
the model its real counterpart's source would pick, recording every run by model."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

from support.cli import TIMEOUT


class RoutedEngine:
    def __init__(self, procs, tmp_path, engine: str, models: str, *args, delay: float = 0.2):
        port_file = tmp_path / f"routed-{time.monotonic_ns()}.port"
        self.proc = procs.start([sys.executable, "-m", "lanelock.testing.routed", "--engine",
                                 engine, "--models", models, "--delay", str(delay),
                                 "--port-file", str(port_file), *args],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + TIMEOUT
        # The port file is renamed into place once it listens: nothing else says so.
        while not port_file.exists():
            assert self.proc.poll() is None, "the routed stand-in exited"
            assert time.monotonic() < deadline, "the routed stand-in never listened"
            time.sleep(0.01)
        self.port = int(port_file.read_text())
        self.backend = f"127.0.0.1:{self.port}"

    def stats(self) -> dict:
        with urllib.request.urlopen(f"http://{self.backend}/stats", timeout=TIMEOUT) as answer:
            return json.load(answer)

    def ran(self, model: str) -> int:
        """How many runs of model the engine has started."""
        return sum(1 for run in self.stats()["runs"] if run["model"] == model)
