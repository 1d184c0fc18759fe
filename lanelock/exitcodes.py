"""The exit status contract, in one place.

Every code here is documented in README.md and man/lanelock.1 and has a test.
"""

OK = 0
PROBE_BUSY = 1        # `probe`: the lane is held by someone
FAILED = 1            # `duel`: the proof failed
OUTPUT_FAILED = 1     # a read command's output could not be written (/dev/full), as coreutils
USAGE = 2             # bad flags, malformed backend, bad config for read commands
GATE_UNAVAILABLE = 69  # EX_UNAVAILABLE: `status`: a lane's gate cannot be taken (turns run ungated)
CANNOT_LISTEN = 69     # EX_UNAVAILABLE: `proxy`: its address is in use or not ours to take
INTERNAL = 70         # EX_SOFTWARE: a lanelock bug (LANELOCK_DEBUG=1 shows the traceback)
RESOURCES = 71        # EX_OSERR: too few file descriptors (ulimit -n) or no memory to start anything
BUSY = 75             # EX_TEMPFAIL: lane busy and no fallback ran (--busy-exit-code)
LOST = 75             # EX_TEMPFAIL: `run --on-lost stop` stopped the command, its lane lost for
                      # good: not done, try again (busy's code, not --busy-exit-code's: the
                      # command did not finish, whatever busy is set to mean)
CANNOT_EXECUTE = 126  # command found but not executable
NOT_FOUND = 127       # command not found
SIGNAL_BASE = 128     # child died of signal N -> 128 + N


def from_wait_status(status: int) -> int:
    """Map a waitpid() status to the shell's convention."""
    import os

    if os.WIFSIGNALED(status):
        return SIGNAL_BASE + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)
