"""A blocking flock(2) with a timeout, without polling: the kernel wakes the waiter the instant
the holder releases. On the main thread a timer signal interrupts the wait; elsewhere (signals
belong to the main thread) a helper thread blocks on its own open file description."""

from __future__ import annotations

import errno
import fcntl
import os
import signal

CONTENDED = frozenset({errno.EWOULDBLOCK, errno.EAGAIN})


class _Timeout(Exception):
    pass


def wait(handle, timeout: float | None, cancel=None) -> bool:
    """Block up to timeout seconds (None: forever) for an exclusive flock on handle.fd (which may
    be replaced by an equivalent descriptor). cancel: a threading.Event that, once set, abandons
    the wait (an asyncio turn whose task was cancelled). OSError other than contention
    propagates."""
    if cancel is not None:
        return _wait_in_thread(handle, timeout, cancel)
    if timeout is None:
        fcntl.flock(handle.fd, fcntl.LOCK_EX)
        return True
    try:
        return _wait_with_alarm(handle.fd, timeout)
    except _NotMainThread:
        return _wait_in_thread(handle, timeout)


class _NotMainThread(Exception):
    pass


def _wait_with_alarm(fd: int, timeout: float) -> bool:
    """A blocking flock with a timer whose handler raises: no polling, wakes the instant the holder
    releases. Python retries a flock interrupted by a signal (PEP 475), so the handler must raise."""
    armed = [True]

    def on_alarm(signum, frame):
        if armed[0]:
            raise _Timeout

    try:
        previous = signal.signal(signal.SIGALRM, on_alarm)
    except ValueError:  # signals belong to the main thread
        raise _NotMainThread from None
    try:
        old_timer = signal.setitimer(signal.ITIMER_REAL, timeout)
        if old_timer[0] > 0:   # someone else's timer: put it back and wait without signals
            signal.setitimer(signal.ITIMER_REAL, *old_timer)
            signal.signal(signal.SIGALRM, previous)
            raise _NotMainThread
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except _Timeout:
            pass
        finally:
            armed[0] = False
            signal.setitimer(signal.ITIMER_REAL, 0)
    except _Timeout:
        pass  # the alarm landed between flock's return and the disarm
    finally:
        signal.signal(signal.SIGALRM, previous)
    # Either we already hold it (re-locking our own description is a no-op) or this is the last look.
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as error:
        if error.errno in CONTENDED:
            return False
        raise


def _wait_in_thread(handle, timeout: float | None, wake=None) -> bool:
    """Off the main thread there is no timer signal: a helper thread blocks in flock on its own open
    file description; if it is too late, it releases the moment it gets the lock. wake: an Event
    the helper sets when it has the lock, and a canceller sets to give up."""
    import threading

    fd2 = os.open(f"/proc/self/fd/{handle.fd}", os.O_RDONLY | os.O_CLOEXEC)
    guard = threading.Lock()
    done = wake if wake is not None else threading.Event()
    state = {"abandoned": False, "got": False}

    def blocker():
        try:
            fcntl.flock(fd2, fcntl.LOCK_EX)
        except OSError:
            os.close(fd2)
            done.set()
            return
        with guard:
            if state["abandoned"]:
                os.close(fd2)
            else:
                state["got"] = True
        done.set()

    threading.Thread(target=blocker, name="lanelock-wait", daemon=True).start()
    done.wait(timeout)
    with guard:
        if state["got"]:
            os.close(handle.fd)
            handle.fd = fd2
            return True
        state["abandoned"] = True
    return False
