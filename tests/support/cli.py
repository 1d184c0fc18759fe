"""Running lanelock from a test: its argv, the default lane's names, an environment with
overrides, a command to completion under the process registry, and the CLI asked in-process (the
suite pays for hundreds of process starts otherwise)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest


LANELOCK = [sys.executable, "-m", "lanelock"]


LANE = "localhost:8080"          # the default lane, and its lock root file names' stem


STEM = "localhost-8080"


needs_flock = pytest.mark.skipif(shutil.which("flock") is None,
                                 reason="flock(1) (util-linux) not found")


TIMEOUT = 60.0          # no single process a test starts may run longer than this


COLOUR_VARIABLES = ("NO_COLOR", "FORCE_COLOR", "CLICOLOR_FORCE")


# Every process a test starts inherits this test's mark: the teardown check tells its lanes in a
# shared root from those of other turns on the machine.
TEST_MARK = "PYTEST_LANELOCK_MARK"


def environ(env: dict | None = None) -> dict:
    """os.environ with overrides; a value of None removes the variable."""
    merged = dict(os.environ)
    for name, value in (env or {}).items():
        if value is None:
            merged.pop(name, None)
        else:
            merged[name] = str(value)
    return merged


def communicate(procs, argv, *, env=None, input=None, timeout=TIMEOUT, **kwargs):
    """Run argv to completion under the registry; CompletedProcess with text stdout/stderr and
    the process's .pid."""
    proc = procs.start(argv, env=environ(env), text=True,
                       stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs)
    try:
        out, err = proc.communicate(input, timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{argv} did not finish in {timeout}s (deadlock?)\nstdout: {out}\nstderr: {err}")
    done = subprocess.CompletedProcess([str(word) for word in argv], proc.returncode, out, err)
    done.pid = proc.pid
    return done


def cli_in_process(args) -> subprocess.CompletedProcess:
    """`lanelock ARGS` through the CLI's own entry point, without a process start (the suite pays
    for those hundreds of times)."""
    from lanelock.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(list(args))
    return subprocess.CompletedProcess(["lanelock", *args], status, out.getvalue(), err.getvalue())


def probe_in_process(args) -> subprocess.CompletedProcess:
    """`lanelock probe ARGS` in this process. It opens its own descriptor, so a lane this very
    process still holds (a leaked API turn) shows as busy as it would to anyone else."""
    return cli_in_process(["probe", *args])


def json_of(args) -> dict:
    """The JSON a read command prints (`where --json`, `status --json`...), asked in-process."""
    import json

    done = cli_in_process(args)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


TIMELINE = re.compile(r"^\S+ \d\d:00 \S+  [#~x.!]{60}$")   # one hour of `history` piped


def history_json(lanelock, *args) -> dict:
    """`lanelock history --json ARGS`, parsed: it must succeed, with no traceback."""
    done = lanelock("history", "--json", *args)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done
    return json.loads(done.stdout)
