"""Calling off a flock(2) that another thread of this process is blocked in.

Closing the descriptor does not: the blocked call holds its own reference to the open file
description, so the wait goes on (and shows in /proc/locks) until the lock comes. A signal does,
if its handler does not restart the call, and only in the thread it is sent to (pthread_kill).
Two things make that work from Python:
- Python's fcntl.flock retries a call a signal interrupted (PEP 475: its handlers run on the
  main thread, so in another thread there is nothing to raise): the waiter thread calls libc's
  flock through ctypes, which hands EINTR back;
- the signal is SIGURG, which is ignored by default, so a stray one harms no one; our handler
  does nothing, it only makes the signal interrupt. It can be installed only from the main thread
  (signal.signal's rule), and only while nobody else handles SIGURG; without it a wait that
  nobody wants goes on until the lock comes, and then lets go at once.
"""

from __future__ import annotations

import fcntl
import signal

SIGNAL = signal.SIGURG

_libc_flock = None   # libc's flock once looked up; False when there is none to call


def _on_signal(signum, frame) -> None:
    """Nothing: interrupting the wait is all the signal is for."""


def prepare() -> bool:
    """Can this process call a waiter thread's flock off? Installs the handler when it can (on the
    main thread, SIGURG not handled by anyone else)."""
    current = signal.getsignal(SIGNAL)
    if current is _on_signal:
        return True
    if current is not signal.SIG_DFL:   # someone else's handler (None: one set outside Python)
        return False
    try:
        signal.signal(SIGNAL, _on_signal)
    except ValueError:   # not the main thread
        return False
    return True


def ready() -> bool:
    """Is our handler still SIGURG's (a signal sent then interrupts, and does nothing else)?"""
    return signal.getsignal(SIGNAL) is _on_signal


def available() -> bool:
    """Can the waiter thread call libc's flock (ctypes, looked up once: in the waiter thread,
    where its few milliseconds stall no event loop)?"""
    global _libc_flock
    if _libc_flock is None:
        try:
            import ctypes

            function = ctypes.CDLL(None, use_errno=True).flock
            function.argtypes, function.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
            _libc_flock = function
        except (ImportError, OSError, AttributeError):
            _libc_flock = False
    return _libc_flock is not False


def flock(fd: int) -> int:
    """Block for an exclusive flock on fd, with the GIL released: 0 once held, else the errno
    (EINTR: called off, or another signal landed in this thread)."""
    import ctypes

    return 0 if _libc_flock(fd, fcntl.LOCK_EX) == 0 else ctypes.get_errno()


def send(thread_ident: int) -> None:
    signal.pthread_kill(thread_ident, SIGNAL)
