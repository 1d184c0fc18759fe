"""`lanelock duel`: the live proof a single-process suite cannot give.

Real, separate processes, each started through `lanelock run` exactly as a user would:
  A  an ordinary session that takes the lane and holds it while "generating";
  B  a second session with another HOME and a profile-like environment: must deflect;
  C  a cron-like turn (env -i, minimal PATH, no XDG variables, another HOME and cwd): must deflect;
  D  a turn that waits (--wait) while A holds: must get the lane the moment A lets go.
Then the witness (duel_witness.py): a request straight to an engine is reported unseen, a gated
turn is not. Then seats (duel_seats.py): on a lane of two seats two turns hold at once, the third
deflects naming both.
Every turn reports the lock path its own process computed; any difference is "two gates".
Nothing is left running, even on Ctrl-C: every turn runs in its own session and is killed by group.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from ..gate import REASON_BUSY, Gate
from .duel_parts import MINIMAL_PATH, PHASE_TIMEOUT, Reports, importable

# The duel's turns take a lane of their own beside the backend's -- keyed by this model, in the same
# root -- so it proves the root every process computes without writing turns, deflections and
# counts into the history and metrics of the lane the user's sessions share (nor waiting for it).
LANE_MODEL = "lanelock-duel"


@dataclass
class Duel:
    gate: Gate
    hold: float = 1.0
    command: list[str] = field(default_factory=list)
    fallback: list[str] = field(default_factory=list)
    users: list[str] = field(default_factory=list)
    profile_env: dict[str, str] = field(default_factory=dict)
    cron_env: dict[str, str] = field(default_factory=dict)
    lock_dir: str | None = None
    store: str | None = None
    on_step: object = None                     # callable(step dict), for live output
    steps: list[dict] = field(default_factory=list)
    children: list[subprocess.Popen] = field(default_factory=list)

    # -- the report -----------------------------------------------------------------------------
    def step(self, name: str, ok: bool, detail: str) -> bool:
        entry = {"step": name, "ok": ok, "detail": detail}
        self.steps.append(entry)
        if self.on_step:
            self.on_step(entry)
        return ok

    def run(self) -> dict:
        workdir = tempfile.mkdtemp(prefix="lanelock-duel-")
        os.chmod(workdir, 0o755)
        result = {"lane": self.gate.lane.name, "backend": self.gate.lane.given,
                  "expected_lock_path": self.gate.lock_path, "root": self.gate.root.path,
                  "root_source": self.gate.root.source, "lock_paths": {}, "handoff_ms": None,
                  "next_command_ms": None}
        try:
            reason = self._duel(workdir, result)
        except _SpawnError as error:
            self.step(error.role, False, str(error))
            reason = f"could not start {error.role}: {error}"
        finally:
            self.cleanup()
            shutil.rmtree(workdir, ignore_errors=True)
        if reason is None:
            reason = self._after(result)
        result.update(result="PASS" if reason is None else "FAIL", reason=reason, steps=self.steps)
        return result

    # -- the duel proper ------------------------------------------------------------------------
    def _duel(self, workdir: str, result: dict) -> str | None:
        if not self.gate.gated:
            self.step("lane", False, f"{self.gate.lane.name} is not a local lane: nothing to duel")
            return "backend is not a gated lane"
        busy = self.gate.probe()
        if busy["state"] == "busy":
            self.step("lane free", False, "the lane is in use right now; try again when it is free")
            return "lane busy before the duel"
        self.step("lane free", True, f"{self.gate.lane.name} at {self.gate.lock_path}")
        read_fd, write_fd = os.pipe()
        go_read, go_write = os.pipe()
        reports = Reports(read_fd)
        try:
            a = self._spawn("A", self._a_argv(write_fd, go_read), self._session_env(workdir, "A"),
                            workdir, (write_fd, go_read))
            os.close(go_read)
            seen = reports.wait(lambda r: r["role"] == "A" and r["event"] == "start")
            if not seen:
                return self._fail_on("A", a, "A never started its turn")
            result["lock_paths"]["A"] = seen["lock_path"]
            if seen["state"] != "held":
                self.step("A holds the lane", False, f"A's state is {seen['state']}")
                return "A could not take the lane"
            self.step("A holds the lane", True, f"pid {a.pid}, generating ({self._what()})")
            for role, user in (("B", self._user(0)), ("C", self._user(1))):
                reason = self._deflector(role, user, workdir, write_fd, reports, result)
                if reason:
                    return reason
            d = self._spawn("D", self._d_argv(write_fd), self._session_env(workdir, "D"), workdir,
                            (write_fd,))
            if not self._until_waiting(d):
                return self._fail_on("D", d, "the waiting turn was never seen waiting for the lane")
            os.write(go_write, b"go\n")
            os.close(go_write)
            go_write = -1
            end = reports.wait(lambda r: r["role"] == "A" and r["event"] == "end")
            if not end:
                return self._fail_on("A", a, "A never finished")
            self._reap(a)
            self.step("A done", True, f"exit {a.returncode}")
            start = reports.wait(lambda r: r["role"] == "D" and r["event"] == "start")
            if not start:
                return self._fail_on("D", d, "the waiting turn never got the lane")
            self._reap(d)
            result["lock_paths"]["D"] = start["lock_path"]
            if start["state"] != "held":
                self.step("the way back", False, f"D's state is {start['state']}")
                return "the lane did not come back"
            result["next_command_ms"] = round((start["t"] - end["t"]) * 1000, 1)
            result["handoff_ms"] = self._handoff_ms(a.pid, d.pid)
            handoff = result["handoff_ms"]
            self.step("the way back", True,
                      f"a waiting turn took the lane {handoff if handoff is not None else '?'} ms "
                      f"after A released it; its command started "
                      f"{result['next_command_ms']} ms after A's ended")
        finally:
            for fd in (write_fd, go_write, read_fd):
                if fd >= 0:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
        return (self._compare(result) or self._witness(workdir, result)
                or self._seats(workdir, result))

    def _witness(self, workdir: str, result: dict) -> str | None:
        from .duel_witness import witness_step

        return witness_step(self, workdir, result)

    def _seats(self, workdir: str, result: dict) -> str | None:
        from .duel_seats import seats_step

        return seats_step(self, workdir, result)

    def _deflector(self, role, user, workdir, write_fd, reports, result) -> str | None:
        env = self._cron_env(workdir, role) if role == "C" else self._session_env(workdir, role)
        cwd = os.path.join(workdir, role.lower())
        proc = self._spawn(role, self._deflector_argv(role, write_fd), env, cwd, (write_fd,), user)
        seen = reports.wait(lambda r: r["role"] == role)
        self._reap(proc)
        if not seen:
            return self._fail_on(role, proc, f"{role} never reported")
        result["lock_paths"][role] = seen["lock_path"]
        who = "a cron-like turn (env -i)" if role == "C" else "a second session (other HOME)"
        if user:
            who += f" as {user}"
        if seen["state"] == "deflected" and seen["reason"] == REASON_BUSY:
            self.step(f"{role} deflects", True, f"{who}: {REASON_BUSY} -> fallback")
            return None
        self.step(f"{role} deflects", False,
                  f"{who}: state {seen['state']} with lock {seen['lock_path']}")
        if seen["state"] == "held":
            return (f"two gates: {role} locked {seen['lock_path']} while A held "
                    f"{result['lock_paths'].get('A')}")
        return f"{role} did not deflect (state {seen['state']})"

    def _compare(self, result: dict) -> str | None:
        paths = {"duel": self.gate.lock_path, **result["lock_paths"]}
        distinct = set(paths.values())
        if len(distinct) == 1:
            self.step("one gate", True, f"every process computed {self.gate.lock_path}")
            return None
        listing = "; ".join(f"{role}: {path}" for role, path in paths.items())
        self.step("one gate", False, f"TWO GATES: {listing}")
        return f"two gates: {listing}"

    def _after(self, result: dict) -> str | None:
        if not self.gate.gated:
            return "backend is not a gated lane"
        probe = self.gate.probe()
        if probe["state"] != "free":
            self.step("lane free after", False, f"the lane is {probe['state']}")
            return "lane left held"
        self.step("lane free after", True, "probe: free; nothing left running")
        return None

    # -- command lines and environments ------------------------------------------------------------
    def _base(self, role: str, model: str = LANE_MODEL) -> list[str]:
        argv = [sys.executable, "-m", "lanelock", "run", "--session", f"duel-{role}",
                "--key-by", "model", "--model", model]
        if self.gate.lane.given:
            argv += ["--backend", self.gate.lane.given]
        if self.lock_dir:
            argv += ["--lock-dir", self.lock_dir]
        if self.store:
            argv += ["--store", self.store]
        return argv

    def _duelist(self, role: str, report_fd: int) -> list[str]:
        return [sys.executable, "-m", "lanelock.testing.duelist", "--role", role,
                "--report-fd", str(report_fd)]

    def _a_argv(self, report_fd: int, go_fd: int) -> list[str]:
        return (self._base("A") + ["--"] + self._duelist("A", report_fd)
                + ["--go-fd", str(go_fd), "--hold", str(self.hold), "--"] + self.command)

    def _deflector_argv(self, role: str, report_fd: int) -> list[str]:
        import shlex

        fallback = shlex.join(self._duelist(role, report_fd) + ["--"] + self.fallback)
        primary = self._duelist(role, report_fd)
        return self._base(role) + ["--fallback", fallback, "--"] + primary

    def _d_argv(self, report_fd: int) -> list[str]:
        return self._base("D") + ["--wait", str(PHASE_TIMEOUT), "--"] + self._duelist("D", report_fd)

    def _session_env(self, workdir: str, role: str) -> dict[str, str]:
        home = _home(workdir, role)
        env = dict(os.environ, HOME=home, XDG_CONFIG_HOME=os.path.join(home, ".config"),
                   XDG_RUNTIME_DIR=os.path.join(home, "run"), XDG_STATE_HOME=os.path.join(home, "state"))
        env.pop("LANELOCK_SESSION", None)
        if role == "B":
            env.update(self.profile_env)
        return importable(env)

    def _cron_env(self, workdir: str, role: str) -> dict[str, str]:
        env = {"PATH": MINIMAL_PATH, "HOME": _home(workdir, role), "SHELL": "/bin/sh",
               "LOGNAME": "cron"}
        if os.environ.get("LANELOCK_DIR"):  # a crontab that sets it, as the user's does
            env["LANELOCK_DIR"] = os.environ["LANELOCK_DIR"]
        for name in ("LANELOCK_BACKEND", "LANELOCK_SYSTEM_CONFIG", "LANELOCK_STORE"):
            if os.environ.get(name):
                env[name] = os.environ[name]
        env.update(self.cron_env)
        return importable(env)

    def _what(self) -> str:
        if self.command:
            import shlex

            return shlex.join(self.command)
        return f"built-in stand-in, {self.hold:g}s"

    def _user(self, index: int) -> str | None:
        return self.users[index] if index < len(self.users) else None

    # -- processes -------------------------------------------------------------------------------
    def _spawn(self, role, argv, env, cwd, fds, user=None) -> subprocess.Popen:
        os.makedirs(cwd, exist_ok=True)
        extra = {}
        if user:
            import pwd

            entry = pwd.getpwnam(user)
            for path in (cwd, env.get("HOME")):
                if path and os.path.isdir(path):
                    os.chown(path, entry.pw_uid, entry.pw_gid)
            extra = {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}
            env = dict(env, USER=user, LOGNAME=user)
        # A session of its own: ^C reaches only the duel, which then kills each group cleanly.
        # ^C between fork and registering the child would leave a turn nobody kills: hold INT and
        # TERM off until it is on the list (the child unblocks them before it execs).
        stopping = {signal.SIGINT, signal.SIGTERM}
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, stopping)
        try:
            proc = subprocess.Popen(argv, env=env, cwd=cwd, pass_fds=fds, start_new_session=True,
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE,
                                    preexec_fn=lambda: signal.pthread_sigmask(
                                        signal.SIG_SETMASK, previous), **extra)
            proc.role = role
            self.children.append(proc)
        except OSError as error:
            as_user = f" as {user}" if user else ""
            raise _SpawnError(role, f"cannot start {argv[0]}{as_user}: {error.strerror} (is this "
                                    "Python readable by that user?)") from None
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        return proc

    def _reap(self, proc: subprocess.Popen) -> None:
        try:
            _, err = proc.communicate(timeout=PHASE_TIMEOUT)
        except subprocess.TimeoutExpired:
            self._kill(proc)
            err = b""
        proc.stderr_text = (err or b"").decode("utf-8", "replace")

    def _until_waiting(self, proc: subprocess.Popen) -> bool:
        """Until D waits for the lane -- blocked in flock (seen in /proc/locks), or in the lane's
        queue (a PostgreSQL waiter sleeps on its host's queue and holds nothing in the server) --
        so the hand-off is real. False: never seen within PHASE_TIMEOUT (or D ended first)."""
        from ..errors import GateUnavailable

        deadline = time.monotonic() + PHASE_TIMEOUT
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                (facts,) = self.gate.store.survey(self.gate.lane)
            except GateUnavailable:
                return True   # the store cannot be read: D's own report says how it went
            if facts.kernel_source == "probe" or facts.waiters or facts.queue:
                return True
            time.sleep(0.005)
        return False

    def _handoff_ms(self, a_pid: int, d_pid: int) -> float | None:
        """A's release to D's acquire, from both turns' journal lines (one monotonic clock)."""
        from ..errors import GateUnavailable

        try:
            events, _ = self.gate.store.events(self.gate.lane, None)
        except GateUnavailable:   # the hand-off figure is a nicety, not the proof
            return None
        released = [e for e in events if e.get("event") == "released" and e.get("pid") == a_pid]
        acquired = [e for e in events if e.get("event") == "acquired" and e.get("pid") == d_pid]
        if not released or not acquired:
            return None
        start, end = released[-1].get("monotonic"), acquired[-1].get("monotonic")
        if not isinstance(start, (int, float)) or not isinstance(end, (int, float)):
            return None
        return round((end - start) * 1000, 2)

    def _fail_on(self, role: str, proc: subprocess.Popen, why: str) -> str:
        self._kill(proc)
        err = getattr(proc, "stderr_text", "") or ""
        if not err and proc.stderr:
            try:
                err = proc.stderr.read().decode("utf-8", "replace")
            except (OSError, ValueError):
                err = ""
        detail = f"{why}; exit {proc.returncode}" + (f"; stderr: {err.strip()[-300:]}" if err else "")
        self.step(role, False, detail)
        return why

    def _kill(self, proc: subprocess.Popen) -> None:
        if proc.poll() is not None:
            return
        for signo, grace in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(proc.pid, signo)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                proc.wait(timeout=grace)
                return
            except subprocess.TimeoutExpired:
                continue

    def cleanup(self) -> None:
        for proc in self.children:
            self._kill(proc)
            if proc.stderr:
                proc.stderr.close()


class _SpawnError(Exception):
    def __init__(self, role: str, message: str):
        super().__init__(message)
        self.role = role


def _home(workdir: str, role: str) -> str:
    home = os.path.join(workdir, f"home-{role.lower()}")
    os.makedirs(home, exist_ok=True)
    return home
