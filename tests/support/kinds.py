"""The stand-in engine speaking another engine's words (`python -m lanelock.testing serve --kind
KIND`: llama-swap, vLLM, SGLang, Ollama shapes), in its own process, on a free loopback port."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

from support.cli import TIMEOUT


class KindEngine:
    def __init__(self, procs, tmp_path, *args, delay: float = 0.6):
        port_file = tmp_path / f"engine-{time.monotonic_ns()}.port"
        self.proc = procs.start([sys.executable, "-m", "lanelock.testing", "serve", "--port", "0",
                                 "--delay", str(delay), "--port-file", str(port_file),
                                 *map(str, args)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + TIMEOUT
        # The port file is written (renamed into place) once it listens: nothing else says so.
        while not port_file.exists():
            assert self.proc.poll() is None, "the stand-in exited"
            assert time.monotonic() < deadline, "the stand-in never listened"
            time.sleep(0.01)
        self.port = int(port_file.read_text())
        self.backend = f"127.0.0.1:{self.port}"
        self.url = f"http://{self.backend}"

    def stats(self) -> dict:
        with urllib.request.urlopen(self.url + "/stats", timeout=TIMEOUT) as response:
            return json.load(response)

    def ask(self, path: str, body: dict) -> None:
        """A generation straight at the engine (no lanelock)."""
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=TIMEOUT) as response:
            response.read()
