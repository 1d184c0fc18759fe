"""Who goes next: every rule of the order, written once for every store that keeps its waiters in
order. The classes and their aging are priority.py's; a store supplies only its medium, never the
policy: its entries (class, arrival, seconds waited at one reading, a tiebreak), whether each
still waits, whether a stopped one can be seen, who it is, and how to wait -- on the lane, or
behind an entry (a Line).

The rules among entries (one reading of the medium):
- the order: effective class first (one step up per `aging` seconds waited, up to the top), then
  arrival, then the medium's tiebreak (priority.order_key);
- a stopped waiter (kill -STOP, ^Z) is passed over while it is stopped: it sends no event a waiter
  behind it could block on. Its entry, arrival and class stay, and it goes next again once
  continued if it is still first. A waiter whose stop its medium cannot see is waited for;
- no barging: a free lane taken without queueing is let go again (busy) while a live waiter of
  that class or higher is queued;
- a killed turn's command that still runs (outlived.py) keeps the lane: taking it waits for that
  command within the same timeout, or lets the lane go again;
- `status` shows the live entries in this order (status_rows); a store whose waiters stand in
  two queues (a server's, and each host's own before it) shows them as one (merged).

The walk, for one waiting turn that has joined the queue:
- one look gives BOTH the live entry just ahead of it (None: it is first) and the seconds until
  its own class rises a step, from one reading of the medium's clock. Read twice, a step taken
  between the readings left a waiter waiting without a timeout on an entry by then behind it
  while that entry waited on it (a stall on flock, a deadlock on PostgreSQL);
- first: it takes the lane's lock, then looks again -- a later arrival of a higher class may have
  come first meanwhile: it lets go at once for it (no barging, either way);
- not first: it waits for the entry ahead to leave, at most until its own next step, and looks
  again. Every wait is on a waiter strictly ahead as it saw the order, or on the lane; the order
  changes only at arrivals and steps, and a waiter looks again at each of its own: no deadlock;
- the lane taken, a killed turn's command that still runs is waited for too, within the same
  timeout, and the lane let go again if it outlasts it;
- a queue that breaks while the turn waits (its medium says QueueBroken) never makes the turn
  ungated: it falls back to the lane's own lock, the kernel's or the server's order.

A turn that waits in two queues (PostgreSQL: on its host, then as its host's head in the
server's) walks the first part alone (until_first, wait_first): the same looks and waits, until
it is first in its host's order; the lane is then the server's walk.

The walk is a generator: it yields each blocking step (LOOK, LOCK, GONE, BEHIND) to a driver --
wait() in the calling thread, wait_async() in an event loop with no thread per waiter -- which
calls the line's method for it by name. So a thread and an asyncio task wait in the same order,
decided the same way.
"""

from __future__ import annotations

import time

from ..priority import CLASSES, effective, order_key

TYPE_CHECKING = False   # typing.TYPE_CHECKING without importing typing (the run path)
if TYPE_CHECKING:
    from typing import Any, Iterable, Protocol

    class Queued(Protocol):
        """One entry of a medium, as it stood at one reading."""
        rank: int          # its class (priority.CLASSES index)
        arrival: Any       # when it arrived, in the medium's own clock
        waited: float      # seconds it had waited at the reading
        tiebreak: Any      # the medium's last word between equals (a name, a ticket)

    class Entries(Protocol):
        """What the rules ask a medium about its entries."""
        def waits(self, entry: Queued) -> bool: ...            # its waiter still waits
        def stopped(self, entry: Queued) -> bool | None: ...    # None: cannot tell
        def who(self, entry: Queued) -> dict: ...               # pid, session, hostname

# The blocking steps a walk yields; the driver calls the line's method for each (look, lock, gone,
# behind, or its _async twin).
LOOK = "look"       # () -> (entry just ahead or None, seconds to this turn's next step or None)
LOCK = "lock"       # (timeout) -> the lane's lock taken: True, or False when timeout passed
GONE = "gone"       # (timeout) -> the killed turn's command has ended (True when there is none)
BEHIND = "behind"   # (entry, timeout) -> returns when the entry's waiter left, or timeout passed

# Times the lane's lock is taken again after the line found it taken on something no longer the
# lane's (a lock file replaced under it), before the gate is called unavailable.
AGAIN_TRIES = 3

# A waiter behind one whose stop its medium can see (Line.sees_stop) looks again this often, to
# pass it over once it stops -- the walk's one timed look.
STOPPED_LOOK = 1.0

# A hook point: when set, called with (ahead, step) after every look of a lane's walk in this
# process (walk; not a host queue's wait_first), before the wait that look decides -- whatever it
# does there (report, pause) happens between the two, and the walk must still hold (no wait past
# its own step). None: no call.
after_look = None


class QueueBroken(Exception):
    """The medium's queue cannot be read or waited on: the turn waits in the lane's own order."""


# -- the rules among entries -----------------------------------------------------------------------
def place(entry: "Queued", aging: float) -> tuple:
    """Where the entry stands at its reading (smaller goes first)."""
    return order_key(entry.rank, entry.arrival, entry.waited, aging, entry.tiebreak)


def counts_as(entry: "Queued", aging: float) -> int:
    """The class the entry counts as at its reading."""
    return effective(entry.rank, 0, int(entry.waited * 1e9), aging)


def first_waiting(entries: "Iterable[Queued]", medium: "Entries"):
    """The first of entries whose waiter still waits and is not stopped: each asked in turn, and
    only until one answers (a waiter alone asks nothing)."""
    for entry in entries:
        if medium.waits(entry) and not medium.stopped(entry):
            return entry
    return None


def first_in_order(entries: "Iterable[Queued]", aging: float, medium: "Entries"):
    """The live entry that goes first (None: none waits), asked in the order's order."""
    return first_waiting(sorted(entries, key=lambda entry: place(entry, aging)), medium)


def just_ahead(mine: "Queued", entries: "Iterable[Queued]", aging: float, medium: "Entries"):
    """The live entry just ahead of mine (None: mine is first), nearest first."""
    me = place(mine, aging)
    before = [(at, entry) for entry in entries if (at := place(entry, aging)) < me]
    before.sort(key=lambda pair: pair[0], reverse=True)
    return first_waiting((entry for _, entry in before), medium)


def waiting_at_or_above(entries: "Iterable[Queued]", rank: int, aging: float,
                        medium: "Entries") -> bool:
    """Does a live waiter of this class or higher (as it counts now) wait? No barging: a free
    lane is not taken past it."""
    return first_waiting((entry for entry in entries if counts_as(entry, aging) >= rank),
                         medium) is not None


def status_rows(entries: "Iterable[Queued]", aging: float, medium: "Entries") -> list[dict]:
    """The entries in order, for `status`: position, class, effective class, pid, session, host,
    waited (seconds), stopped (None: the medium cannot tell). The entries are the live ones."""
    rows = []
    for position, entry in enumerate(sorted(entries, key=lambda entry: place(entry, aging)), 1):
        who = medium.who(entry)
        rows.append({"position": position, "class": CLASSES[entry.rank],
                     "effective_class": CLASSES[counts_as(entry, aging)],
                     "pid": who.get("pid"), "session": who.get("session"),
                     "host": who.get("hostname"), "waited": round(entry.waited, 3),
                     # a stopped waiter keeps its place but is passed over meanwhile
                     "stopped": medium.stopped(entry)})
    return rows


def merged(server: list[dict], local: list[dict]) -> list[dict]:
    """status_rows of two media in one order -- a server's queue and its hosts' own queues,
    where a host's head waits in the server and its other waiters on their host: effective
    class, then the longest wait (one measure for both: a head's server arrival counts its wait
    on its host). Positions renumbered."""
    if not local:
        return server
    rows = sorted(server + local, key=lambda row: (-CLASSES.index(row["effective_class"]),
                                                   -(row.get("waited") or 0.0)))
    return [dict(row, position=position) for position, row in enumerate(rows, 1)]


class Line:
    """One waiting turn's place, as a store's medium gives it to the walk. A store implements:

      look()                    ONE reading: (entry just ahead or None, seconds to the next step
                                or None) -- just_ahead() over its entries; QueueBroken when the
                                queue cannot be read
      lock(timeout, cancel)     block on the lane's own lock: True / False (timeout)
      checked(got)              after lock: True (the lane is really ours), False (busy after all),
                                None (it was taken on something no longer the lane's: again)
      behind(entry, timeout, cancel)   block until the entry's waiter leaves (or timeout);
                                QueueBroken when it cannot be waited on
      hand_on()                 let the lane's lock go at once (another goes first)
      leave()                   leave the queue (never raises)
      waiting_at_or_above(rank) a live waiter of this class or higher is queued (no barging)
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

    def look(self, cancel=None) -> tuple:
        raise NotImplementedError

    def lock(self, timeout: float | None, cancel=None) -> bool:
        raise NotImplementedError

    def checked(self, got: bool) -> bool | None:
        return got

    def behind(self, entry, timeout: float | None, cancel=None) -> None:
        raise NotImplementedError

    def hand_on(self) -> None:
        raise NotImplementedError

    def leave(self) -> None:
        pass

    def waiting_at_or_above(self, rank: int) -> bool:
        return False

    async def look_async(self) -> tuple:
        raise NotImplementedError

    async def lock_async(self, timeout: float | None) -> bool:
        raise NotImplementedError

    async def behind_async(self, entry, timeout: float | None) -> None:
        raise NotImplementedError

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


def keep_free_lane(line: Line, rank: int) -> bool:
    """The lane's lock, just taken without queueing (a try), is kept only when no live waiter of
    this class or higher is queued (no barging; asked once the lock is ours: a busy lane, the
    usual case, never reads the queue) and no killed turn's command still runs; else it is let go
    again: busy."""
    if line.waiting_at_or_above(rank) or not line.gone(0):
        line.hand_on()
        return False
    line.outlived = None
    return True


def walk(line: Line, timeout: float | None, cancel=None):
    """The steps of one waiting turn: True once the lane is its own, False when timeout passes
    (None: never) or cancel (a threading.Event) is set."""
    if not line.queued:
        return (yield from take(line, timeout))
    deadline = _deadline(timeout)
    while True:
        first = yield from until_first(line, deadline, cancel)
        if first is None:   # the queue broke: the lane's own order
            return (yield from take(line, _left(deadline)))
        if not first:
            return False
        if not (yield from take(line, _left(deadline))):
            return False
        try:
            first = (yield LOOK,)[0] is None
        except QueueBroken:
            return True   # the lane is ours, and no order can be read to give it to
        if first:
            return True
        line.hand_on()   # a higher class came first meanwhile


def until_first(line: Line, deadline: float | None, cancel=None, hooked: bool = True):
    """The steps of a waiting turn until it is first in its line: True (first), False (the
    deadline, a time.monotonic() or None, passed, or cancel was set), None (the queue broke).
    The whole walk of a turn that waits for the lane elsewhere once first (a host's head:
    hooked False, after_look is the lane's)."""
    while not (cancel is not None and cancel.is_set()):
        looked_at = time.monotonic()
        try:
            ahead, step = yield LOOK,
        except QueueBroken:
            return None
        # The step is a moment, counted from before the look: however late the look returns
        # (a slow query, a busy machine) or the wait begins, it never waits past its own step.
        step_at = None if step is None else looked_at + step
        if hooked and after_look is not None:
            after_look(ahead, step)
        if ahead is None:
            return True
        left = _left(deadline)
        if left is not None and left <= 0:
            return False
        try:
            yield BEHIND, ahead, least(left, _left(step_at),
                                        STOPPED_LOOK if line.sees_stop(ahead) else None)
        except QueueBroken:
            return None
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
        return _drive(walking, cancel)


def wait_first(line: Line, timeout: float | None, cancel=None) -> bool:
    """until_first in this thread: True once first, or once the queue broke (the order the turn
    waits in next is then the only one); False on timeout or cancel. The line keeps its entry:
    the turn goes on waiting elsewhere (a host's head, in the server's queue)."""
    steps = until_first(line, _deadline(timeout), cancel, hooked=False)
    with _Walking(line, steps, leave=False) as walking:
        return _drive(walking, cancel) is not False


def _drive(walking: "_Walking", cancel):
    while (step := walking.next()) is not None:
        try:
            walking.answered(_step(walking.line, step, cancel))
        except QueueBroken as broken:
            walking.failed(broken)
    return walking.result


def _step(line: Line, step: tuple, cancel):
    kind, *args = step
    if kind == LOOK:
        return line.look(cancel=cancel)
    if kind == LOCK:
        return line.lock(*args, cancel=cancel)
    if kind == GONE:
        return line.gone(*args, cancel=cancel)
    return line.behind(*args, cancel=cancel)


async def wait_async(line: Line, timeout: float | None) -> bool:
    """Walk in the event loop (cancelling the task abandons the waits)."""
    with _Walking(line, walk(line, timeout)) as walking:
        while (step := walking.next()) is not None:
            try:
                walking.answered(await _step_async(line, step))
            except QueueBroken as broken:
                walking.failed(broken)
        return walking.result


async def _step_async(line: Line, step: tuple):
    kind, *args = step
    if kind == LOOK:
        return await line.look_async()
    if kind == LOCK:
        return await line.lock_async(*args)
    if kind == GONE:
        return await line.gone_async(*args)
    return await line.behind_async(*args)


class _Walking:
    """A walk as its drivers run it: the next step, sent what came of the last one (or the
    QueueBroken it raised); the line leaves the queue however it ends (unless leave is False:
    wait_first)."""

    def __init__(self, line: Line, steps, leave: bool = True):
        self.line, self.steps, self.result, self.leave = line, steps, None, leave
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
        if self.leave:
            self.line.leave()


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else deadline - time.monotonic()


def least(*bounds: float | None) -> float | None:
    """The shortest of some timeouts (None: no bound)."""
    given = [bound for bound in bounds if bound is not None]
    return max(0.0, min(given)) if given else None
