"""How every command ends: its status, or one `lanelock:` line and a documented code -- never a
traceback. Shared by the click commands and the click-free fast path of `run`."""

from __future__ import annotations

import os
import sys

from . import exitcodes, say


def guarded(call) -> int:
    try:
        result = call()
    except KeyboardInterrupt:
        return die_of_sigint()
    except BrokenPipeError:
        return exitcodes.OK
    except Exception as error:  # a bug: one line, not a traceback, unless asked for
        if os.environ.get("LANELOCK_DEBUG"):
            raise
        say.error(f"internal error: {type(error).__name__}: {error} "
                  "(LANELOCK_DEBUG=1 shows the traceback)")
        return exitcodes.INTERNAL
    return result if isinstance(result, int) else exitcodes.OK


def die_of_sigint() -> int:
    """^C while waiting for the lane: die of SIGINT so a calling shell loop stops, as it would."""
    import signal

    sys.stderr.flush()
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)
    return exitcodes.SIGNAL_BASE + signal.SIGINT


def usage(message: str, command_path: str) -> int:
    hint = f" (see '{command_path} --help')" if command_path else ""
    say.error(f"{message}{hint}")
    return exitcodes.USAGE
