"""Who goes next: the waiting walk, written once for every store that keeps its waiters in order
(issue 30). The classes and their aging are priority.py's; a store supplies only its medium (a
Line: where the waiters' entries live and how one waits on another), never the policy.

The walk, for one waiting turn that has joined the queue:
- one look gives BOTH the live entry just ahead of it (None: it is first) and the seconds until
  its own class rises a step, from one reading of the medium's clock. Read twice, a step taken
  between the readings left a waiter waiting without a timeout on an entry by then behind it
  while that entry waited on it (a stall on flock, a deadlock on PostgreSQL: 2538e49, issue 30);
- first: it takes the lane's lock, then looks again -- a later arrival of a higher class may have
  come first meanwhile: it lets go at once for it (no barging, either way);
- not first: it waits for the entry ahead to leave, at most until its own next step, and looks
  again. Every wait is on a waiter strictly ahead as it saw the order, or on the lane; the order
  changes only at arrivals and steps, and a waiter looks again at each of its own: no deadlock;
- the lane taken, a killed turn's command that still runs (outlived.py) is waited for too, within
  the same timeout, and the lane let go again if it outlasts it;
- a queue that breaks while the turn waits (its medium says QueueBroken) never makes the turn
  ungated: it falls back to the lane's own lock, the kernel's or the server's order.

The walk is a generator: it yields each blocking step (LOOK, LOCK, GONE, BEHIND) to a driver --
wait() in the calling thread, wait_async() in an event loop with no thread per waiter -- which
asks the line. So a thread and an asyncio task wait in the same order, decided the same way.
"""

from __future__ import annotations

import time

# The blocking steps a walk yields; the driver calls the line's method of that name (or NAME_async).
LOOK = "look"       # () -> (entry just ahead or None, seconds to this turn's next step or None)
LOCK = "lock"       # (timeout) -> the lane's lock taken: True, or False when timeout passed
GONE = "gone"       # (timeout) -> the killed turn's command has ended (True when there is none)
BEHIND = "behind"   # (entry, timeout) -> returns when the entry's waiter left, or timeout passed

# Times the lane's lock is taken again after the line found it taken on something no longer the
# lane's (a lock file replaced under it), before the gate is called unavailable.
AGAIN_TRIES = 3

# A waiter stopped ahead (kill -STOP, ^Z) sends no event a waiter behind it could block on, and
# is passed over while stopped (the media skip it in look()): a waiter behind one whose stop its
# medium can see (Line.sees_stop) looks again this often -- the walk's one timed look.
STOPPED_LOOK = 1.0

# For tests only: called with (ahead, step) after every look, in the waiting process. A test puts
# an aging step between the look and the wait with it (tests/test_order.py); None in the product.
after_look = None


class QueueBroken(Exception):
    """The medium's queue cannot be read or waited on: the turn waits in the lane's own order."""


class Line:
    """One waiting turn's place, as a store's medium gives it to the walk. A store implements:

      look()                    ONE reading: (entry just ahead or None, seconds to the next step
                                or None); QueueBroken when the queue cannot be read
      lock(timeout, cancel)     block on the lane's own lock: True / False (timeout)
      checked(got)             after lock: True (the lane is really ours), False (busy after all),
                                None (it was taken on something no longer the lane's: again)
      behind(entry, timeout, cancel)   block until the entry's waiter leaves (or timeout);
                                QueueBroken when it cannot be waited on
      hand_on()                 let the lane's lock go at once (another goes first)
      leave()                   leave the queue (never raises)
      sees_stop(entry)          can it tell the entry's waiter is stopped? (look() then passes
                                over a stopped one; default: no)
      keeps_changing()          the GateUnavailable when checked() keeps saying None (default:
                                a plain one)
    and, for a store whose waits run in an event loop, look_async / lock_async / behind_async.
    Line(store, handle, ticket) keeps them; queued is False when the turn could not join (a
    ticket None: the lane's own order only). gone() is the same for every store (outlived.py):
    handle.outlived is the outlived.Command of a killed turn still running, or None."""

    def __init__(self, store, handle, ticket=None):
        self.store, self.handle, self.ticket = store, handle, ticket
        self.queued = ticket is not None

    @property
    def outlived(self):
        return getattr(self.handle, "outlived", None)

    @outlived.setter
    def outlived(self, value) -> None:
        self.handle.outlived = value

    def sees_stop(self, entry) -> bool:
        """Can this medium tell when the entry's waiter is stopped (a process of this host)?
        Default: no -- it is waited for like any other."""
        return False

    def keeps_changing(self):
        from ..errors import GateUnavailable

        return GateUnavailable("the lane's lock keeps changing under it")

    def gone(self, timeout: float | None, cancel=None) -> bool:
        from .outlived import gone

        return self.outlived is None or gone(self.outlived, timeout, cancel)

    async def gone_async(self, timeout: float | None) -> bool:
        from .outlived import gone_async

        return self.outlived is None or await gone_async(self.outlived, timeout)


def walk(line: Line, timeout: float | None, cancel=None):
    """The steps of one waiting turn: True once the lane is its own, False when timeout passes
    (None: never) or cancel (a threading.Event) is set."""
    if not line.queued:
        return (yield from take(line, timeout))
    deadline = _deadline(timeout)
    while not (cancel is not None and cancel.is_set()):
        looked_at = time.monotonic()
        try:
            ahead, step = yield LOOK,
        except QueueBroken:
            return (yield from take(line, _left(deadline)))
        # The step is a moment, counted from before the look: however late the look returns
        # (a slow query, a busy machine) or the wait begins, it never waits past its own step.
        step_at = None if step is None else looked_at + step
        if after_look is not None:
            after_look(ahead, step)
        left = _left(deadline)
        if ahead is None:   # first: the lane itself
            if not (yield from take(line, left)):
                return False
            try:
                first = (yield LOOK,)[0] is None
            except QueueBroken:
                return True   # the lane is ours, and no order can be read to give it to
            if first:
                return True
            line.hand_on()   # a higher class came first meanwhile
            continue
        if left is not None and left <= 0:
            return False
        try:
            yield BEHIND, ahead, _least(left, _left(step_at),
                                        STOPPED_LOOK if line.sees_stop(ahead) else None)
        except QueueBroken:
            return (yield from take(line, _left(deadline)))
    return False


def take(line: Line, timeout: float | None):
    """The lane's own lock (checked: really the lane's), then a killed turn's command."""
    deadline = _deadline(timeout)
    for _ in range(AGAIN_TRIES):
        ours = line.checked((yield LOCK, _left(deadline)))
        if ours is not None:
            break
    else:
        raise line.keeps_changing()
    if not ours:
        return False
    if (yield GONE, _left(deadline)):
        line.outlived = None
        return True
    line.hand_on()
    return False


def wait(line: Line, timeout: float | None, cancel=None) -> bool:
    """Walk in this thread (the kernel, the server or an event from another thread wakes it);
    the line leaves the queue however the walk ends."""
    with _Walking(line, walk(line, timeout, cancel)) as walking:
        while (step := walking.next()) is not None:
            kind, *args = step
            try:
                walking.answered(getattr(line, kind)(*args, cancel=cancel))
            except QueueBroken as broken:
                walking.failed(broken)
        return walking.result


async def wait_async(line: Line, timeout: float | None) -> bool:
    """Walk in the event loop (cancelling the task abandons the waits)."""
    with _Walking(line, walk(line, timeout)) as walking:
        while (step := walking.next()) is not None:
            kind, *args = step
            try:
                walking.answered(await getattr(line, f"{kind}_async")(*args))
            except QueueBroken as broken:
                walking.failed(broken)
        return walking.result


class _Walking:
    """A walk as its drivers run it: the next step, sent what came of the last one (or the
    QueueBroken it raised); the line leaves the queue however it ends."""

    def __init__(self, line: Line, steps):
        self.line, self.steps, self.result = line, steps, None
        self._answer, self._error = None, None

    def next(self):
        """The next step, or None once the walk has its result."""
        answer, error, self._answer, self._error = self._answer, self._error, None, None
        try:
            return self.steps.send(answer) if error is None else self.steps.throw(error)
        except StopIteration as done:
            self.result = done.value
            return None

    def answered(self, answer) -> None:
        self._answer = answer

    def failed(self, error: QueueBroken) -> None:
        self._error = error

    def __enter__(self) -> "_Walking":
        return self

    def __exit__(self, *exc) -> None:
        self.steps.close()
        self.line.leave()


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else deadline - time.monotonic()


def _least(*bounds: float | None) -> float | None:
    """The shortest of some timeouts (None: no bound)."""
    given = [bound for bound in bounds if bound is not None]
    return max(0.0, min(given)) if given else None
