"""A blocking flock(2) with a timeout, without polling: the kernel wakes the waiter the instant
the holder releases. On the main thread a timer signal interrupts the wait; elsewhere (signals
belong to the main thread) a helper thread blocks on its own open file description, and its wait
is called off when no turn wants it any more (interrupt.py)."""

from __future__ import annotations

import errno
import fcntl
import os
import signal

from . import interrupt

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
    if timeout < 1e-6:   # setitimer reads a zero (or sub-microsecond) timer as none: for ever
        try:
            fcntl.flock(handle.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError as error:
            if error.errno in CONTENDED:
                return False
            raise
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
    """Off the main thread there is no timer signal: the lane's waiter thread blocks in flock on
    an open file description of its own and hands it over when it gets the lock (see _Waiter).
    wake: an Event the waiter sets when this turn has the lock, and a canceller sets to give up."""
    import threading

    slot = _Slot(wake if wake is not None else threading.Event())
    waiter = _Waiter.join(handle, slot)
    slot.event.wait(timeout)
    got = _claim(waiter, slot, handle)
    if not got:
        waiter.call_off()
    return got


def _claim(waiter, slot, handle) -> bool:
    """After the wait: take the lock the waiter handed this slot (into handle.fd), or leave the
    queue for good. Under the waiter's guard, so a hand-off and a give-up never cross."""
    with waiter.guard:
        got = slot.fd is not None
        if got:
            os.close(handle.fd)
            handle.fd = slot.fd
        else:
            slot.abandoned = True
            if slot in waiter.queue:
                waiter.queue.remove(slot)
    if not got and slot.error is not None:
        raise slot.error
    return got


async def wait_async(handle, timeout: float | None) -> bool:
    """wait() for an asyncio task, without a thread of its own: the lane's waiter thread wakes
    the task through the event loop. Cancelling the task abandons the wait; if the lock came at
    that very moment it is in handle.fd, and the caller lets it go (as a cancelled wait's)."""
    import asyncio

    loop = asyncio.get_running_loop()
    woken = loop.create_future()
    slot = _Slot(_LoopEvent(loop, woken))
    waiter = _Waiter.join(handle, slot)
    try:
        await asyncio.wait_for(asyncio.shield(woken), timeout)
    except asyncio.TimeoutError:
        pass
    except asyncio.CancelledError:
        try:   # a lock handed over just now goes to handle.fd, for the caller to let go
            _claim(waiter, slot, handle)
        except OSError:
            pass   # the waiter failed too: the cancellation is what the caller hears
        await _call_off(waiter)
        raise
    got = _claim(waiter, slot, handle)
    if not got:
        await _call_off(waiter)
    return got


async def _call_off(waiter) -> None:
    """waiter.call_off() in a thread when it has a wait to call off (it waits for the waiter
    thread to leave, which must not stall the loop); a cancellation lets it finish first."""
    import asyncio

    if waiter.idle():
        await finished(asyncio.ensure_future(asyncio.to_thread(waiter.call_off)))


async def finished(future):
    """future's result, waiting for it to finish even if this task is cancelled meanwhile (the
    cancellation then propagates): a step in a thread is never left running unseen."""
    import asyncio

    cancelled = False
    while not future.done():
        try:
            await asyncio.shield(future)
        except asyncio.CancelledError:
            cancelled = cancelled or not future.done()
        except BaseException:   # noqa: BLE001 - the result is the caller's
            break
    if cancelled:
        raise asyncio.CancelledError
    return future.result()


class _LoopEvent:
    """The slot's event for an asyncio waiter: set() from the waiter thread resolves a future on
    the loop."""

    __slots__ = ("loop", "future")

    def __init__(self, loop, future):
        self.loop, self.future = loop, future

    def set(self) -> None:
        try:
            self.loop.call_soon_threadsafe(self._resolve)
        except RuntimeError:   # the loop is closed: nobody waits
            pass

    def _resolve(self) -> None:
        if not self.future.done():
            self.future.set_result(None)


class _Slot:
    __slots__ = ("event", "fd", "abandoned", "error")

    def __init__(self, event):
        self.event, self.fd, self.abandoned, self.error = event, None, False, None


# After the signal that calls a waiter's flock off, how long to wait for the thread to leave before
# sending it again (one that lands just before the thread enters flock(2) is lost), then giving up.
CALL_OFF_PAUSES = (0.01, 0.1, 1.0)


class _Waiter:
    """One thread per lock file and process blocks in flock(); the turns of this process that
    wait for the lane queue behind it, first come first served (a thread per waiting turn would
    be hundreds for a burst of proxy requests).

    When the last turn in its queue gives up, the thread's flock is called off (interrupt.py), so
    nothing waits in the kernel for a turn that is over: a busy answer or a client that hung up
    left a waiter in /proc/locks until the lane freed, which `status` counted as one waiting, and
    which then took the lane for a moment. Where it cannot be called off (no handler could be
    installed), the thread, once it gets the lock with nobody left to hand it to, lets go at
    once."""

    _all: dict = {}
    _all_guard = None

    def __init__(self, key, source_fd: int):
        import collections
        import threading

        self.key = key
        self.guard = threading.Lock()
        self.queue = collections.deque()
        # spare: a description of the same inode, never locked, to open the next one from.
        self.spare = os.open(f"/proc/self/fd/{source_fd}", os.O_RDONLY | os.O_CLOEXEC)
        self.fd = self._reopen()
        self.interruptible = interrupt.prepare()   # its flock can be called off
        self.left = threading.Event()   # set once the thread has left the kernel for good
        self.thread = threading.Thread(target=self._run, name="lanelock-wait", daemon=True)

    def _reopen(self) -> int:
        return os.open(f"/proc/self/fd/{self.spare}", os.O_RDONLY | os.O_CLOEXEC)

    @classmethod
    def join(cls, handle, slot: _Slot) -> "_Waiter":
        import threading

        if cls._all_guard is None:
            cls._all_guard = threading.Lock()
        st = os.fstat(handle.fd)
        key = (st.st_dev, st.st_ino)
        with cls._all_guard:
            waiter = cls._all.get(key)
            if waiter is not None:
                with waiter.guard:
                    if waiter.fd is not None:   # still waiting: queue behind it
                        waiter.queue.append(slot)
                        return waiter
            waiter = cls._all[key] = cls(key, handle.fd)
            waiter.queue.append(slot)
            waiter.thread.start()
            return waiter

    def idle(self) -> bool:
        """Does the thread wait in the kernel with nobody in its queue, a wait to call off?"""
        with self.guard:
            return self._idle()

    def _idle(self) -> bool:   # under self.guard
        return self.interruptible and self.fd is not None and not self.queue

    def call_off(self) -> None:
        """Nobody wants the lock any more: interrupt the thread's flock, so it leaves the kernel's
        waiters now rather than when the lane frees, and return once it has left (or a turn joined
        meanwhile: the wait is that turn's now)."""
        for pause in CALL_OFF_PAUSES:
            with self.guard:
                if not (self._idle() and interrupt.ready()):
                    return
                interrupt.send(self.thread.ident)   # alive: it leaves only under the guard
            if self.left.wait(pause):
                return

    def _block(self) -> OSError | None:
        """flock(LOCK_EX) on self.fd: None once held, else the error (EINTR: called off)."""
        if self.interruptible:
            code = interrupt.flock(self.fd)
            return None if code == 0 else OSError(code, os.strerror(code))
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX)
            return None
        except OSError as raised:
            return raised

    def _run(self) -> None:
        if self.interruptible and not interrupt.available():
            with self.guard:
                self.interruptible = False
        while True:
            error = self._block()
            with type(self)._all_guard, self.guard:
                if error is not None and error.errno == errno.EINTR:
                    if self.queue:
                        continue   # another signal, or a turn joined as it was called off
                elif error is not None:
                    self._fail_all(error)
                else:
                    while self.queue:
                        slot = self.queue.popleft()
                        if not slot.abandoned:
                            slot.fd, self.fd = self.fd, None
                            slot.event.set()
                            break
                if self.fd is not None:   # nobody left to take it (or called off): let go
                    os.close(self.fd)
                    self.fd = None
                if not self.queue:
                    self._leave()
                    return
                # More turns wait: a new description to wait on for the next release.
                try:
                    self.fd = self._reopen()
                except OSError as failed:   # out of descriptors: the turns still queued hear
                    self._fail_all(failed)  # it (a crowded gate: they deflect or try again),
                    self._leave()           # none is left waiting on a thread that is gone
                    return

    def _fail_all(self, error: OSError) -> None:   # under both guards
        for slot in self.queue:
            slot.error = error
            slot.event.set()
        self.queue.clear()

    def _leave(self) -> None:   # under both guards, the queue empty
        if type(self)._all.get(self.key) is self:
            del type(self)._all[self.key]
        os.close(self.spare)
        self.left.set()


# -- any of several locks (a lane's seats) ---------------------------------------------------------
def wait_any(seats: list, timeout: float | None, cancel=None) -> int | None:
    """Block up to timeout seconds (None: for ever) for an exclusive flock on any one of seats
    (objects with .fd, each on a lock file of its own): the index of the one got, its lock now in
    seats[i].fd; None when timeout passed or cancel (an Event) was set. A lock got beside it at
    the same moment is let go at once. One _Waiter per file, as for a single lock: the kernel
    wakes whichever seat frees first, nothing polls."""
    import threading

    event = cancel if cancel is not None else threading.Event()
    slots = [_Slot(event) for _ in seats]
    waiters = [_Waiter.join(seat, slot) for seat, slot in zip(seats, slots)]
    event.wait(timeout)
    return _claim_any(waiters, slots, seats)


async def wait_any_async(seats: list, timeout: float | None) -> int | None:
    """wait_any for an asyncio task: the waiter threads wake it through the event loop."""
    import asyncio

    loop = asyncio.get_running_loop()
    woken = loop.create_future()
    event = _LoopEvent(loop, woken)
    slots = [_Slot(event) for _ in seats]
    waiters = [_Waiter.join(seat, slot) for seat, slot in zip(seats, slots)]
    try:
        await asyncio.wait_for(asyncio.shield(woken), timeout)
    except asyncio.TimeoutError:
        pass
    except asyncio.CancelledError:
        got = _claim_any(waiters, slots, seats, call_off=False)
        if got is not None:   # nobody will use it: the caller is gone
            fcntl.flock(seats[got].fd, fcntl.LOCK_UN)
        for waiter in waiters:
            await _call_off(waiter)
        raise
    got = _claim_any(waiters, slots, seats, call_off=False)
    for waiter in waiters:
        await _call_off(waiter)
    return got


def _claim_any(waiters, slots, seats, call_off: bool = True) -> int | None:
    got, failed = None, None
    for index, (waiter, slot, seat) in enumerate(zip(waiters, slots, seats)):
        try:
            mine = _claim(waiter, slot, seat)
        except OSError as error:
            failed = error
            continue
        if not mine:
            if call_off:
                waiter.call_off()
        elif got is None:
            got = index
        else:   # two seats freed at once: one is enough, the other is the next turn's
            fcntl.flock(seat.fd, fcntl.LOCK_UN)
    if got is None and failed is not None:
        raise failed
    return got
