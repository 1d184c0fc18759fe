"""How every command ends: its status, or one `lanelock:` line and a documented code -- never a
traceback. Shared by the click commands and the click-free fast path of `run`."""

from __future__ import annotations

import errno
import os
import sys

from . import exitcodes, say
from .errors import crowded


def guarded(call) -> int:
    protect_streams()
    try:
        result = call()
    except KeyboardInterrupt:
        return die_of_sigint()
    except OSError as error:
        if not crowded(error) or os.environ.get("LANELOCK_DEBUG"):
            return _internal(error)
        # Out of descriptors or memory where nothing could be done about it (a module to
        # import opens a file too): no bug, a limit -- one line and EX_OSERR.
        say.error(f"out of resources: {error.strerror or error}")
        return exitcodes.RESOURCES
    except Exception as error:  # a bug: one line, not a traceback, unless asked for
        return _internal(error)
    return result if isinstance(result, int) else exitcodes.OK


def _internal(error: Exception) -> int:
    if os.environ.get("LANELOCK_DEBUG"):
        raise error
    say.error(f"internal error: {type(error).__name__}: {error} "
              "(LANELOCK_DEBUG=1 shows the traceback)")
    return exitcodes.INTERNAL


def die_of_sigint() -> int:
    """^C while waiting for the lane: die of SIGINT so a calling shell loop stops, as it would."""
    import signal

    flush_quietly()
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)
    return exitcodes.SIGNAL_BASE + signal.SIGINT


def usage(message: str, command_path: str) -> int:
    hint = f" (see '{command_path} --help')" if command_path else ""
    say.error(f"{message}{hint}")
    return exitcodes.USAGE


class _Dropping:
    """sys.stdout or sys.stderr, dropping what cannot be written: a closed descriptor (`>&-`,
    where Python makes the stream None), a full or failing file (/dev/full) or a reader that
    went away (`| head -1`). Nothing is raised: `run`'s own lines must never change what runs
    or its exit status. What was lost is kept (`lost`) for the read commands, whose output is
    the point: they say so and fail (output_status)."""

    def __init__(self, stream, fd: int):
        self._stream, self._fd = stream, fd
        self.broken = stream is None
        self.lost: OSError | None = None   # why text was dropped (a reader gone: EPIPE)

    def write(self, text: str) -> int:
        if not self.broken:
            try:
                return self._stream.write(text)
            except (OSError, ValueError) as error:
                self._break(error)
        if text and self.lost is None:
            self.lost = OSError(errno.EBADF, os.strerror(errno.EBADF))
        return len(text)

    def flush(self) -> None:
        if not self.broken:
            try:
                self._stream.flush()
            except (OSError, ValueError) as error:
                self._break(error)

    def isatty(self) -> bool:
        return not self.broken and self._stream.isatty()

    def __getattr__(self, name):
        if self._stream is None:
            raise AttributeError(name)
        return getattr(self._stream, name)

    def _break(self, error: Exception | None = None) -> None:
        if error is not None and self.lost is None:
            self.lost = error if isinstance(error, OSError) else OSError(
                errno.EBADF, os.strerror(errno.EBADF))   # ValueError: a closed file
        self.broken = True
        # What Python still buffers for this descriptor is flushed again at exit: point the
        # descriptor at /dev/null so that flush succeeds instead of failing a second time.
        try:
            null = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
            os.dup2(null, self._fd)
            os.close(null)
        except OSError:
            pass


def output_status(status: int, failed: int = exitcodes.OUTPUT_FAILED) -> int:
    """A read command's status once its output is flushed: `failed`, with one line, when some
    of it could not be written (/dev/full, a closed stdout), as coreutils do. A reader that went
    away (`| head -1`, EPIPE) wanted no more: the command's own status stands."""
    stream = sys.stdout
    if isinstance(stream, _Dropping):
        stream.flush()
        lost = stream.lost
        if lost is not None and lost.errno != errno.EPIPE:
            say.error(f"cannot write the output: {lost.strerror or lost}")
            return failed
    return status


def protect_streams() -> None:
    if not isinstance(sys.stdout, _Dropping):
        sys.stdout = _Dropping(sys.stdout, 1)
    if not isinstance(sys.stderr, _Dropping):
        sys.stderr = _Dropping(sys.stderr, 2)


def stdout_gone(within: float) -> bool:
    """Wait up to `within` seconds; True, at once, when nobody can read stdout any more: it was
    closed (`>&-`), a write to it failed, or -- a pipe -- its reader went away, which the kernel
    tells poll(2) as POLLERR before anything is written. A loop that only writes (`status
    --watch`) would otherwise refresh forever into a pipe that `head -1` has left."""
    import select

    stream = sys.stdout
    if stream is None or getattr(stream, "broken", False):
        return True
    poller = select.poll()
    poller.register(1, 0)   # no events asked: poll reports only POLLERR, POLLHUP and POLLNVAL
    if not poller.poll(within * 1000):
        return False
    if isinstance(stream, _Dropping):
        stream._break()     # what is still buffered must not fail again at exit
    return True


def flush_quietly() -> None:
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
