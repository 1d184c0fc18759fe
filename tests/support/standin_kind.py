"""A stand-in engine of a given kind (`python -m lanelock.testing serve --kind K ...`) in a process
of its own, for the tests that ask an engine's own account: its URL once it listens, its /stats.
The serve command says it listens only in its port file (written whole, by rename), so the file
is looked for with a deadline, or the process's end."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

from support.processes import wait_for


class Served:
    def __init__(self, procs, tmp_path, *args: str, name: str = "stand-in"):
        number = len(list(tmp_path.glob("served-*.stderr")))
        port_file = tmp_path / f"served-{number}.port"
        self.stderr = tmp_path / f"served-{number}.stderr"
        with open(self.stderr, "wb") as stderr:
            self.proc = procs.start([sys.executable, "-m", "lanelock.testing", "serve",
                                     "--port", "0", "--port-file", port_file, "--name", name,
                                     *args], stdout=subprocess.DEVNULL, stderr=stderr)
        wait_for(lambda: port_file.exists() or self.proc.poll() is not None,
                 what="the stand-in's port file", timeout=30)
        assert self.proc.poll() is None, self.stderr.read_text()
        self.port = int(port_file.read_text())
        self.backend = f"127.0.0.1:{self.port}"
        self.url = f"http://{self.backend}"

    def get(self, path: str):
        with urllib.request.urlopen(self.url + path, timeout=10) as response:
            return json.load(response)

    def stats(self) -> dict:
        return self.get("/stats")
