"""`lanelock run` waits for its command's SIGCHLD: no thread of the wrapper may take it.

A thread that does not block SIGCHLD can be handed the command's SIGCHLD by the kernel whenever
the waiting thread is not in sigwaitinfo at that moment (the command ended while the turn was
still recording it); its action being to ignore it, it was lost, and the wrapper waited for ever
-- holding the lane, deaf to SIGTERM. Seen in the PostgreSQL hand-off bench (2 of 62 runs). The
wrapper's threads (a flock wait's, a host queue's, the lane watch) start during the turn; here a
thread is started at the same point, and the command ends before the wrapper waits for it.
"""

from __future__ import annotations

import subprocess
import sys

from support.cli import TIMEOUT

SLOW_TO_WAIT = """
import sys, threading, time
from lanelock.run import runner

original = runner.run


def run(*args, on_spawn=None, **kwargs):
    # A thread of the turn's own, as its waits and watches start them.
    threading.Thread(target=time.sleep, args=(30,), daemon=True).start()

    def spawned():
        time.sleep(0.3)   # the command ends meanwhile (a record written to a distant server)
        if on_spawn is not None:
            on_spawn()

    return original(*args, on_spawn=spawned, **kwargs)


runner.run = run
from lanelock.__main__ import entry

sys.argv = ["lanelock", "run", "--", *sys.argv[1:]]
entry()
"""


def test_a_command_that_ends_before_the_wrapper_waits_is_still_reaped(procs):
    proc = procs.start([sys.executable, "-c", SLOW_TO_WAIT, "sh", "-c", "exit 7"],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _, stderr = proc.communicate(timeout=TIMEOUT / 4)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise AssertionError("the wrapper never saw its command end (its SIGCHLD was lost)")
    assert (proc.returncode, stderr) == (7, ""), stderr


def blocked_sigchld(text: str) -> bool:
    (line,) = [line for line in text.splitlines() if line.startswith("SigBlk:")]
    return bool(int(line.split()[1], 16) & (1 << (17 - 1)))   # SIGCHLD is 17


def test_the_command_and_a_fallback_get_the_mask_lanelock_was_started_with(lanelock, holder):
    """The wrapper blocks SIGCHLD for its own threads; a command and a fallback get the mask
    lanelock was started with (a shell that waits for its children needs SIGCHLD)."""
    shown = lanelock("run", "--", "cat", "/proc/self/status")
    assert shown.returncode == 0 and not blocked_sigchld(shown.stdout), shown
    held = holder()
    deflected = lanelock("run", "-f", "cat /proc/self/status", "--", "true")
    assert deflected.returncode == 0 and not blocked_sigchld(deflected.stdout), deflected
    held.release()
