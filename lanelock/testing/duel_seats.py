"""The duel's seats step: a lane of two seats holds two turns at once, and the third deflects
naming both holders.

On a lane of its own beside the duel's (keyed by SEATS_MODEL, in the duel's root or store), its
count set to 2 with `lanelock seats` and set back to 1 after, so the user's lanes and the duel's
own are never touched. Every turn is `lanelock run` in a process of its own, as a user's would be:
S1 and S2 each report the seat they were given and hold until the duel lets them go; S3 must
deflect, and its one line must name both holders (the words are the deflection's own).
Where the count cannot be set (a store that keeps none, a lock root of another owner: exit 69)
there are no seats to prove: the step says so and is skipped.
"""

from __future__ import annotations

import os
import subprocess
import sys

from .. import exitcodes
from .duel_parts import PHASE_TIMEOUT, Reports, importable

SEATS_MODEL = "lanelock-duel-seats"
SEATS = 2
TIMEOUT = 15.0


def seats_step(duel, workdir: str, result: dict) -> str | None:
    """Run the step; returns the failure's reason or None. The turns go on duel's list."""
    where = _where(duel)
    env = importable(dict(os.environ))
    lane = f"{duel.gate.lane.name.partition('#')[0]}#{SEATS_MODEL}"
    kept = _lanelock(["seats", *where, str(SEATS)], env, workdir)
    if kept.returncode == exitcodes.GATE_UNAVAILABLE:
        said = kept.stderr.strip().splitlines()[-1:] or [f"exit {kept.returncode}"]
        duel.step("seats", True, f"skipped: the seat count of {lane} cannot be set here "
                  f"({said[0]})")
        result["seats"] = {"lane": lane, "skipped": said[0]}
        return None
    if kept.returncode != 0:
        duel.step("seats", False, f"lanelock seats {SEATS} failed: exit {kept.returncode}; "
                  f"{kept.stderr.strip()[-300:]}")
        return "the seat count could not be set"
    read_fd, write_fd = os.pipe()
    go_read, go_write = os.pipe()
    reports = Reports(read_fd)
    try:
        holders = {}
        for role in ("S1", "S2"):
            argv = (duel._base(role, SEATS_MODEL) + ["--"] + duel._duelist(role, write_fd)
                    + ["--go-fd", str(go_read), "--hold", "0"])
            holders[role] = duel._spawn(role, argv, duel._session_env(workdir, role), workdir,
                                        (write_fd, go_read))
        os.close(go_read)
        go_read = -1
        seats = {}
        for role, proc in holders.items():
            seen = reports.wait(lambda r, role=role: r["role"] == role and r["event"] == "start",
                                PHASE_TIMEOUT)
            if not seen:
                return duel._fail_on(role, proc, f"{role} never started its turn")
            if seen["state"] != "held":
                duel.step("seats: two hold", False, f"{role}'s state is {seen['state']} (seats "
                          f"taken: {seats or 'none'})")
                return f"a lane of {SEATS} seats did not hold two turns"
            seats[role] = seen.get("seat")
        if sorted(seats.values()) != ["1", "2"]:
            duel.step("seats: two hold", False, f"seats given: {seats}")
            return "two turns were not on two seats"
        duel.step("seats: two hold", True, f"{lane}: S1 on seat {seats['S1']} (pid "
                  f"{holders['S1'].pid}), S2 on seat {seats['S2']} (pid {holders['S2'].pid}), "
                  "both running")
        reason = _third(duel, workdir, write_fd, reports, holders)
        result["seats"] = {"lane": lane, "seats": seats, "deflection": reason[1]}
        if reason[0]:
            return reason[0]
        os.close(go_write)                       # S1 and S2 end their turns
        go_write = -1
        for role, proc in holders.items():
            if not reports.wait(lambda r, role=role: r["role"] == role and r["event"] == "end",
                                PHASE_TIMEOUT):
                return duel._fail_on(role, proc, f"{role} never finished")
            duel._reap(proc)
        return None
    finally:
        for fd in (write_fd, go_read, go_write, read_fd):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        # Set back whatever happened (a turn holding still keeps its seat: nobody is evicted).
        _lanelock(["seats", *where, "1"], env, workdir)


def _third(duel, workdir, write_fd, reports, holders) -> tuple:
    """S3 while S1 and S2 hold: (the failure's reason or None, S3's deflection line)."""
    import shlex

    fallback = shlex.join(duel._duelist("S3", write_fd))
    argv = (duel._base("S3", SEATS_MODEL) + ["--fallback", fallback, "--"]
            + duel._duelist("S3", write_fd))
    proc = duel._spawn("S3", argv, duel._session_env(workdir, "S3"), workdir, (write_fd,))
    seen = reports.wait(lambda r: r["role"] == "S3")
    duel._reap(proc)
    if not seen:
        return duel._fail_on("S3", proc, "S3 never reported"), None
    lines = [line for line in proc.stderr_text.splitlines() if line.startswith("lanelock: ")]
    said = lines[0] if lines else ""
    if seen["state"] != "deflected":
        duel.step("seats: S3 deflects", False, f"S3's state is {seen['state']} on seat "
                  f"{seen.get('seat')} while S1 and S2 held")
        return f"a third turn ran on a lane of {SEATS} seats", said
    missing = [role for role, proc in holders.items()
               if f"pid {proc.pid}" not in said or f"session duel-{role}" not in said]
    if missing:
        duel.step("seats: S3 deflects", False, f"its line does not name {', '.join(missing)}: "
                  f"{said or 'nothing said'}")
        return "the deflection did not name every holder", said
    duel.step("seats: S3 deflects", True, said.partition("lanelock: ")[2][:240])
    return None, said


def _where(duel) -> list[str]:
    """The seats lane, spelled as the duel's turns spell theirs."""
    argv = ["--key-by", "model", "--model", SEATS_MODEL]
    if duel.gate.lane.given:
        argv += ["--backend", duel.gate.lane.given]
    if duel.lock_dir:
        argv += ["--lock-dir", duel.lock_dir]
    if duel.store:
        argv += ["--store", duel.store]
    return argv


def _lanelock(args: list[str], env: dict, cwd: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([sys.executable, "-m", "lanelock", *args], env=env, cwd=cwd,
                              stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(args, 124, "", f"lanelock {args[0]} took over "
                                                          f"{TIMEOUT:g} s")
