"""The stand-in that runs inside each duel turn (``python -m lanelock.testing.duelist``).

It reports, on a pipe inherited from the duel, what its turn looked like from the inside: the lock
path its own `lanelock run` computed, the state it was given, its HOME and user. The holder (A) then
keeps the lane busy until the duel says "go" and --hold seconds have passed, running the user's
COMMAND meanwhile if one was given; the others report and exec their COMMAND, if any.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
import time


def report(fd: int, event: str, role: str, **extra) -> None:
    line = {"event": event, "role": role, "pid": os.getpid(), "t": time.monotonic(),
            "state": os.environ.get("LANELOCK_STATE"),
            "lock_path": os.environ.get("LANELOCK_LOCK_PATH"),
            "lane": os.environ.get("LANELOCK_LANE"), "seat": os.environ.get("LANELOCK_SEAT"),
            "reason": os.environ.get("LANELOCK_FAILOVER_REASON"),
            "home": os.environ.get("HOME"), "uid": os.getuid(), "cwd": os.getcwd(), **extra}
    # One write() under PIPE_BUF: lines from several turns never interleave.
    os.write(fd, (json.dumps(line)[:4000] + "\n").encode())


def hold(go_fd: int, seconds: float, command: list[str]) -> int:
    started = time.monotonic()
    child = subprocess.Popen(command) if command else None
    os.set_blocking(go_fd, True)
    select.select([go_fd], [], [])          # the duel writes or closes: B and C are done
    remaining = seconds - (time.monotonic() - started)
    if remaining > 0:
        time.sleep(remaining)               # "generating": the lane stays busy for --hold
    return child.wait() if child else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lanelock.testing.duelist")
    parser.add_argument("--role", required=True)
    parser.add_argument("--report-fd", type=int, required=True)
    parser.add_argument("--go-fd", type=int)
    parser.add_argument("--hold", type=float, default=0.0)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    report(args.report_fd, "start", args.role)
    if args.go_fd is not None:
        status = hold(args.go_fd, args.hold, command)
        report(args.report_fd, "end", args.role, status=status)
        return status
    if command:
        os.close(args.report_fd)
        try:
            os.execvp(command[0], command)
        except OSError as error:
            sys.stderr.write(f"lanelock duel: {command[0]}: {error.strerror}\n")
            return 127
    return 0


if __name__ == "__main__":
    sys.exit(main())
