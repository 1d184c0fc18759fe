"""A real PostgreSQL server on loopback for the lane-store tests (Debian's postgresql package).

Started as the `postgres` user (the server refuses to run as root) in a temp directory, trust auth
on 127.0.0.1 only, stopped and removed at teardown. Its log (its stderr) is kept in log_path.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import time

from support.ports import free_port


LOG_LINE_PREFIX = "%m [%p] app=%a "   # the session's application_name after app=


def lanelock_errors(text: str) -> list[str]:
    """The ERROR lines of lanelock's sessions (application_name 'lanelock ...') in a log text."""
    return [line for line in text.splitlines() if " app=lanelock" in line and "ERROR:" in line]


def binaries() -> str | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"))
    return os.path.dirname(found[-1]) if found else (
        os.path.dirname(shutil.which("postgres")) if shutil.which("postgres") else None)


class Server:
    def __init__(self):
        self.bindir = binaries()
        if self.bindir is None:
            raise RuntimeError("no PostgreSQL server binaries (apt-get install postgresql)")
        self.user = "postgres" if os.geteuid() == 0 else pwd.getpwuid(os.geteuid()).pw_name
        self.dir = tempfile.mkdtemp(prefix="lanelock-pg-")
        os.chmod(self.dir, 0o755)
        self.data = os.path.join(self.dir, "data")
        self.log_path = os.path.join(self.dir, "server.log")
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.listen = "127.0.0.1"          # listen_addresses
        self.trust: str | None = None      # another client network to trust (a test host's)
        self.settings = {"max_connections": 60}   # -c NAME=VALUE for postgres (a test's own)

    @property
    def dsn(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _as_user(self, argv: list[str]) -> list[str]:
        return ["runuser", "-u", self.user, "--"] + argv if os.geteuid() == 0 else argv

    def start(self) -> "Server":
        if os.geteuid() == 0:
            entry = pwd.getpwnam(self.user)
            os.chown(self.dir, entry.pw_uid, entry.pw_gid)
        subprocess.run(self._as_user([os.path.join(self.bindir, "initdb"), "-D", self.data,
                                      "-U", "postgres", "--auth=trust", "-E", "UTF8"]),
                       check=True, capture_output=True)
        if self.trust:
            with open(os.path.join(self.data, "pg_hba.conf"), "a") as hba:
                hba.write(f"host all all {self.trust} trust\n")
        return self._launch()

    def _launch(self) -> "Server":
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self._as_user([
                os.path.join(self.bindir, "postgres"), "-D", self.data, "-p", str(self.port),
                "-c", f"listen_addresses={self.listen}",
                "-c", f"unix_socket_directories={self.dir}",
                "-c", "fsync=off",
                # each line says which client's session it is of: app=lanelock ... is lanelock's
                "-c", f"log_line_prefix={LOG_LINE_PREFIX}",
                *[arg for name, value in self.settings.items() for arg in ("-c", f"{name}={value}")]]),
                stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("postgres exited during startup")
            ready = subprocess.run([os.path.join(self.bindir, "pg_isready"), "-h", "127.0.0.1",
                                    "-p", str(self.port)], capture_output=True)
            if ready.returncode == 0:
                return self
            time.sleep(0.1)
        raise RuntimeError("postgres did not become ready")

    def postmaster_pid(self) -> int:
        with open(os.path.join(self.data, "postmaster.pid")) as pidfile:
            return int(pidfile.readline())

    def restart(self, kill: bool = False) -> None:
        """Stop the server and start it again on the same data and port: a fast shutdown (the
        first half of pg_ctl restart -m fast: SIGINT to the postmaster), or kill -9 of the
        postmaster alone (its backends end when they notice; until then a new postmaster refuses
        to start on their shared memory, so it is started again until it runs)."""
        os.kill(self.postmaster_pid(), 9 if kill else 2)
        self.proc.wait(timeout=60)   # runuser ends with its postmaster
        deadline = time.monotonic() + 60
        while True:
            try:
                self._launch()
                return
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)
