"""How a turn waits for a flock lane: its steps written once, run by a blocking driver or an
asyncio one.

The steps (lane(), queued()) are generators: each yields what to wait for -- the lane's lock,
the entry ahead in the queue (store/queue.py), the command of a killed turn (outlived.py) -- and
is sent what came of it. run() waits in the calling thread (the kernel, a pidfd, or an event from
another thread); run_async() in the event loop, with no thread per waiter (waiting.wait_async),
and the queue's reading (a look at every waiter's file) in the loop's thread pool. So the order
of waiting, and every decision in it, is the same for a thread and for an asyncio task.
"""

from __future__ import annotations

import fcntl
import time

from . import outlived, queue, waiting

# Times a turn locks the lane's file again after finding it replaced under its lock, before the
# gate is called unavailable (something keeps replacing it: a misbehaving cleaner).
REPLACED_TRIES = 3
# How often a waiter looks again when the entry ahead cannot be opened to wait on (only a file
# made unreadable by hand: lanelock's own are 0644 whatever the umask).
UNREADABLE_LOOK = 0.1

# What a step waits for (the first word of what it yields).
AHEAD = "ahead"     # (now): the queue's entry ahead of this turn at `now` -> Entry or None
LOCK = "lock"       # (seconds): block on the lane's lock -> True, False, or the OSError raised
GONE = "gone"       # (seconds): the killed turn's command (handle.outlived) ends -> bool
MINE = "mine"       # (entry, seconds): this process's own turn ahead leaves
ENTRY = "entry"     # (EntryWait, seconds): the waiter ahead leaves (an OSError: it already did)
SLEEP = "sleep"     # (seconds): only to look again at an entry that cannot be opened


def lane(store, handle, timeout: float | None, cancel=None):
    """Steps to take the lane's lock itself (try_lock's checks on every lock taken): True once
    it is ours, False when timeout passes."""
    deadline = _deadline(timeout)
    for _ in range(REPLACED_TRIES):
        left = _left(deadline)
        if left is not None and left <= 0 and cancel is None:
            got = store._flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        else:
            got = yield LOCK, left
            if isinstance(got, OSError):
                got = store._contended(handle, got)
        ours = store._ours(handle, got)
        if ours is None:
            continue   # the file was replaced under the lock: lock the new one
        if ours and handle.outlived is not None:
            if not (yield GONE, _left(deadline)):
                store._hand_on(handle)
                return False
            handle.outlived = None
        return ours
    raise store._keeps_being_replaced(handle)


def queued(store, handle, ticket, timeout: float | None, cancel=None):
    """Steps to wait in the lane's queue (ticket: this turn's place): the first in order waits
    for the lane, each other turn for the one just ahead of it, until its class's aging step."""
    deadline = _deadline(timeout)
    while not (cancel is not None and cancel.is_set()):
        now = time.monotonic_ns()   # one reading for the order and the next step
        ahead = yield AHEAD, now
        left, step = _left(deadline), ticket.next_step(now)
        if ahead is None:   # first: wait for the lane itself
            if not (yield from lane(store, handle, left, cancel)):
                return False
            if (yield AHEAD, time.monotonic_ns()) is None:
                return True
            store._hand_on(handle)   # a higher class came first meanwhile
            continue
        if left is not None and left <= 0:
            return False
        if queue.is_mine(ahead):   # a turn of this process: no kernel wait, no thread
            yield MINE, ahead, _least(left, step)
            continue
        try:
            wait = queue.EntryWait(ticket.queue, ahead)
        except FileNotFoundError:
            continue   # the waiter ahead left as we looked: look again
        except OSError:   # a file we may not open (a hand-made 0600): look again soon
            yield SLEEP, _least(left, step, UNREADABLE_LOOK)
            continue
        try:
            yield ENTRY, wait, _least(left, step)
        finally:
            wait.close()
    return False


def run(steps, handle, ticket=None, cancel=None) -> bool:
    """Run the steps in this thread. cancel: a threading.Event that abandons the waits."""
    answer = None
    try:
        while True:
            try:
                kind, *args = steps.send(answer)
            except StopIteration as done:
                return done.value
            answer = None
            if kind == AHEAD:
                answer = ticket.ahead(args[0])
            elif kind == LOCK:
                try:
                    answer = waiting.wait(handle, args[0], cancel)
                except OSError as error:
                    answer = error
            elif kind == GONE:
                answer = outlived.gone(*handle.outlived, args[0], cancel)
            elif kind == MINE:
                queue.wait_mine(args[0], args[1], cancel)
            elif kind == ENTRY:
                try:
                    waiting.wait(args[0], args[1], cancel)
                except OSError:
                    pass   # the entry ahead went away as we waited: look again
            else:
                time.sleep(args[0])
    finally:
        steps.close()


async def run_async(steps, handle, ticket=None) -> bool:
    """Run the steps in the event loop (cancelling the task abandons the waits)."""
    import asyncio

    answer = None
    try:
        while True:
            try:
                kind, *args = steps.send(answer)
            except StopIteration as done:
                return done.value
            answer = None
            if kind == AHEAD:
                answer = await waiting.finished(asyncio.ensure_future(asyncio.to_thread(
                    ticket.ahead, args[0])))
            elif kind == LOCK:
                try:
                    answer = await waiting.wait_async(handle, args[0])
                except OSError as error:
                    answer = error
            elif kind == GONE:
                answer = await outlived.gone_async(*handle.outlived, args[0])
            elif kind == MINE:
                await queue.wait_mine_async(args[0], args[1])
            elif kind == ENTRY:
                try:
                    await waiting.wait_async(args[0], args[1])
                except OSError:
                    pass
            else:
                await asyncio.sleep(args[0])
    finally:
        steps.close()


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else deadline - time.monotonic()


def _least(*bounds: float | None) -> float | None:
    """The shortest of some timeouts (None: no bound)."""
    given = [bound for bound in bounds if bound is not None]
    return max(0.0, min(given)) if given else None
