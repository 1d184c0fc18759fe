"""The seats of a lane: every rule of them, written once for every store, as order.py writes the
queue's. A store supplies only its medium (Medium below), never the policy.

The rules:
- the count is the lane's, kept with it (store.keep) under KEY + the lane's name: 1..MOST. A
  kept value that is no count is one seat, said once (reckon): fewer seats can only make a turn
  wait, never run beside one too many;
- which seat a turn takes (preference): the one its session held last (the engine's slot keeps
  that session's cache), else the one released least recently (never held first), so the seats
  other sessions just used stay theirs; the ones held now last. A seat whose holder died (kill
  -9: no release written) counts as released when it died -- at most since it was taken, as
  nobody saw the death -- so its session comes back to it;
- never one too many: a smaller count evicts nobody; seats past it that are still held count
  against it, and a seat is kept only while fewer than the count hold (too_many). Seats past the
  count are never taken again;
- the queue's head waits on ANY seat: every seat within the count while all are held; when too
  many hold, on the ones that hold (a free seat would wake the wait at once, for nothing).

The walk is a generator (take): it yields each step (RECORDS, TRY, HELD, LET_GO, WAIT) to a
driver -- wait() in the calling thread, wait_async() in an event loop -- which calls the
medium's method of that name. A try (try_lock) is the same walk with no time to wait.

One lane lock, or any of N seats, is decided here too, once per handle (taker(): as the store
learns the lane's count): a lane of one seat takes its own lock the medium's own way (OneLock:
one lock, no record read, no seat looked at -- the hand-off as fast as it ever was); a lane of
seats walks them (AnySeat). The store's try and its order's lock call the one chosen, never ask
which; a store writes its medium only.
"""

from __future__ import annotations

import time

KEY = "seats/"
MOST = 256   # a count past this is a typo, not an engine

# The steps a walk yields; the driver calls the medium's method for each.
RECORDS = "records"   # () -> (the count, the seats past it, {seat: its record or None} for
                      # 1..the count, the set of seats held or None: the medium cannot tell)
TRY = "try_seats"     # (order) -> the first seat of order this turn took (checked), or None
HELD = "held"         # (seats) -> the set of those held by a turn now
LET_GO = "let_go"     # () -> the seat just taken let go again, without waking anyone
WAIT = "wait_any"     # (seats, timeout) -> a seat now this turn's (its lock got: the walk decides
                      # whether to keep it), AGAIN (woken: look again), or None (timeout, cancel)
AGAIN = 0


def key(lane_name: str) -> str:
    """The lane's count's name among the values kept with the lanes."""
    return KEY + lane_name


def count_of(value) -> int | None:
    """A kept count, checked (None: not a count a lane can have)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MOST:
        return None
    return value


def reckon(value, lane_name: str) -> tuple[int, str | None]:
    """(the count a turn takes, why the kept value was not believed or None): nothing kept is
    one seat; a kept value that is no count is one seat too, and the reason is said."""
    if value is None:
        return 1, None
    number = count_of(value)
    if number is None:
        shown = repr(value)
        shown = shown if len(shown) <= 40 else shown[:40] + "..."
        return 1, f"{shown} is not a seat count; taking {lane_name} as one seat"
    return number, None


def seat_number(value) -> int | None:
    """A seat's number as a store spells it (an int, or digits), checked: 1..MOST, else None."""
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 3:
        value = int(value)
    return count_of(value)


# -- which seat a turn takes -------------------------------------------------------------------------
def preference(records: dict, seats: int, session: str | None, held=None) -> list[int]:
    """The seats 1..seats in the order a turn of session tries them (records: seat -> its record
    or None; held: the seats a turn holds now, or None when the medium cannot tell cheaply): its
    session's latest first, then the least recently released (never held first), the ones held
    now last. A seat whose holder died counts as released when it died (released_ago)."""
    ranked = []
    for seat in range(1, seats + 1):
        record = records.get(seat)
        ago = released_ago(record, None if held is None else seat in held)
        if record is None:
            ranked.append(((1, 0.0), seat))          # never held: as least recent as can be
        elif ago is None:
            ranked.append(((3, 0.0), seat))          # held now (or unreadable): tried last
        elif session is not None and record.get("session") == session:
            ranked.append(((0, ago), seat))          # this session's: the latest first
        else:
            ranked.append(((2, -ago), seat))         # least recently released first
    return [seat for _, seat in sorted(ranked)]


def released_ago(record: dict | None, held: bool | None = None) -> float | None:
    """Seconds since the seat's last turn let it go: its release, or its death (a record never
    released whose seat nobody holds -- held False, as the medium saw it -- or whose process of
    this boot is gone). None while it holds, or when nothing can say."""
    from ..holder import released_ago as released

    ago = released(record)
    if ago is not None or not isinstance(record, dict):
        return ago
    if held is True:
        return None
    return died_ago(record, known_dead=held is False)


def died_ago(record: dict, known_dead: bool = False) -> float | None:
    """Seconds since the unreleased record's turn died, at most (it died after it took the seat;
    nobody saw when): None while it lives, or when no clock can say. known_dead: the medium saw
    its seat free (the server dropped the lock); else its process of this boot is asked."""
    from .. import proc
    from ..facts import boot_id, hostname, parse_utc
    from ..holder import field

    since = field(record, "acquired_monotonic", float)
    here = record.get("boot_id") == boot_id() and record.get("hostname") in (None, hostname())
    if not known_dead:
        pid, ticks = field(record, "pid", int), field(record, "start_ticks", int)
        if pid is None or ticks is None or since is None or not here:
            return None
        if proc.start_ticks(pid) == ticks:
            return None   # alive: held (or letting go)
    if since is not None and here:
        return max(0.0, time.monotonic() - since)
    text = record.get("acquired_at")
    taken = parse_utc(text) if isinstance(text, str) else None
    return None if taken is None else max(0.0, time.time() - taken)


def too_many(seat: int, seats: int, past: tuple, held: set) -> bool:
    """Holding seat, does this turn make more holders than the count (held: the seats a turn
    holds now, among 1..seats and past)? Only while seats past the count are still held."""
    if not any(other in held for other in past):
        return False
    others = sum(1 for other in (*range(1, seats + 1), *past) if other != seat and other in held)
    return others + 1 > seats


# -- the walk ------------------------------------------------------------------------------------------
def take(session: str | None, timeout: float | None):
    """The steps of one turn taking a seat: the seat once one is its own (its lock held, within
    the count, no more holders than the count), None when timeout passes (0: a try, one look;
    None: never) or the wait is cancelled. Each look reads the count afresh (RECORDS)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        seats, past, records, held = yield RECORDS,
        got = yield TRY, preference(records, seats, session, held)
        busy = list(range(1, seats + 1))   # every seat was held: wait on any
        if got is not None:
            if not past or not (yield from _too_many(got, seats, past)):
                return got
            yield LET_GO,
            holding = yield HELD, (*busy, *past)
            busy = [seat for seat in (*busy, *past) if seat in holding]
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            return None
        woke = yield WAIT, busy, left
        if woke is None:
            return None
        if woke is AGAIN:
            continue
        if woke <= seats and not (past and (yield from _too_many(woke, seats, past))):
            return woke   # the usual hand-off: the freed seat's lock, kept with no second look
        yield LET_GO,     # past the count (never taken again), or too many hold: look again


def _too_many(seat: int, seats: int, past: tuple):
    holding = yield HELD, (*range(1, seats + 1), *past)
    return too_many(seat, seats, past, set(holding) | {seat})


def wait(medium, session: str | None, timeout: float | None, cancel=None) -> int | None:
    """Walk in this thread: the seat taken, or None (timeout, cancel)."""
    steps = take(session, timeout)
    answer = None
    try:
        while True:
            kind, *args = steps.send(answer)
            if kind == WAIT:
                answer = medium.wait_any(*args, cancel=cancel)
            else:
                answer = getattr(medium, kind)(*args)
    except StopIteration as done:
        return done.value
    finally:
        steps.close()


async def wait_async(medium, session: str | None, timeout: float | None) -> int | None:
    """Walk in the event loop: only the wait itself is awaited (the other steps are a few system
    calls or one statement)."""
    steps = take(session, timeout)
    answer = None
    try:
        while True:
            kind, *args = steps.send(answer)
            if kind == WAIT:
                answer = await medium.wait_any_async(*args)
            else:
                answer = getattr(medium, kind)(*args)
    except StopIteration as done:
        return done.value
    finally:
        steps.close()


# -- one lane lock, or any of N seats: decided once ------------------------------------------------
def taker(medium) -> "OneLock | AnySeat":
    """How the medium's turn takes its lane, chosen once (the store asks as its handle learns the
    lane's count): any of the seats while the lane has more than one, or seats past its count
    may still be held (handle.seated); else the lane's one lock."""
    return AnySeat(medium) if medium.handle.seated else OneLock(medium)


class OneLock:
    """A lane of one seat: its own lock, taken the medium's own way. Its record is claimed once
    the lane is kept (kept()), after the queue's look: one descriptor fewer at once."""

    def __init__(self, medium: "Medium"):
        self.medium = medium

    def try_(self) -> bool:
        """One try, never blocking: True once the lane is this turn's (checked)."""
        return self.medium.try_lane()

    def lock(self, timeout: float | None, cancel=None) -> bool:
        """The order's LOCK: block on the lane's lock (the order checks what it got: checked)."""
        return self.medium.lock_lane(timeout, cancel)

    async def lock_async(self, timeout: float | None) -> bool:
        return await self.medium.lock_lane_async(timeout)

    def checked(self, got: bool) -> bool | None:
        return self.medium.checked(got, claim=False)

    def kept(self) -> bool:
        """The lane just kept: its record claimed now, else let go (busy)."""
        return self.medium.claim()

    def waits(self) -> bool:
        """Anything to wait on? Not while something planted keeps this turn off the lane's one
        lock (until someone removes it)."""
        return not self.medium.refused()


class AnySeat:
    """A lane of seats: the walk (take) over the medium. A seat's record is claimed as its lock
    is taken (checked), so a refused one passes the turn on to the next seat."""

    def __init__(self, medium: "Medium"):
        self.medium = medium

    def try_(self) -> bool:
        medium, got = self.medium, None
        with medium.walking(waits=False):
            got = wait(medium, medium.session(), 0)
        return got is not None

    def lock(self, timeout: float | None, cancel=None) -> bool:
        medium, got = self.medium, None
        with medium.walking(waits=True, cancel=cancel):   # a cancelled wait's error: got None
            got = wait(medium, medium.session(), timeout, cancel)
        return got is not None

    async def lock_async(self, timeout: float | None) -> bool:
        medium, got = self.medium, None
        with medium.walking(waits=True):
            got = await wait_async(medium, medium.session(), timeout)
        return got is not None

    def checked(self, got: bool) -> bool | None:
        return self.medium.checked(got, claim=True)

    def kept(self) -> bool:
        return True   # its seat's record was claimed as the seat was taken

    def waits(self) -> bool:
        return True   # a seat refused: the others


class _Plain:
    """A walk with nothing around it (Medium.walking's default)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        return False


class Medium:
    """What a store gives the walk (one turn's handle on the lane), Medium(store, handle):

      records()                (the count, the seats past it that may be held, {seat: its
                               record or None} for 1..the count, the set of seats held now --
                               None when it cannot tell without a lock try each)
      try_seats(order)         the first seat of order this turn took, its lock checked as any
                               lock taken (a replaced file, a claim after a restart), or None
      held(seats)              the set of those seats a turn holds now
      let_go()                 the seat just taken let go again, with no wake-up (it frees
                               nothing a waiter could have)
      wait_any(seats, timeout, cancel)   block until any of the seats frees: the seat whose
                               lock it got, AGAIN (woken: look again), None (timeout, cancel)
      wait_any_async(seats, timeout)     the same in an event loop
      walking(waits, cancel)   a context around one walk (a try: waits False): what a wait
                               needs set up and undone, the medium's errors said its way; a
                               cancelled wait's error may be swallowed (the walk took nothing)

    and the lane's own lock, as a lane of one seat takes it (OneLock):

      try_lane()               one try, never blocking, checked: True when the lane is ours
      lock_lane(timeout, cancel)   block on it: True / False (timeout, cancel)
      lock_lane_async(timeout)     the same in an event loop
      checked(got, claim)      after a lock: True (ours), False (busy after all), None (taken
                               on something no longer the lane's: again); claim: the record
                               claimed with it (a seat's)
      claim()                  the lane just kept by a one-seat turn: its record claimed, else
                               the lane let go (False). Default: nothing to claim
      refused()                something planted keeps this turn off the lane's one lock.
                               Default: never
    """

    def __init__(self, store, handle):
        self.store, self.handle = store, handle

    def session(self) -> str | None:
        """The turn's session: its own seat first (preference)."""
        return (self.handle.asker or {}).get("session")

    def records(self) -> tuple:
        raise NotImplementedError

    def try_seats(self, order: list) -> int | None:
        raise NotImplementedError

    def held(self, seats) -> set:
        raise NotImplementedError

    def let_go(self) -> None:
        raise NotImplementedError

    def wait_any(self, seats: list, timeout: float | None, cancel=None):
        raise NotImplementedError

    async def wait_any_async(self, seats: list, timeout: float | None):
        raise NotImplementedError

    def walking(self, waits: bool, cancel=None):
        return _Plain()

    def try_lane(self) -> bool:
        raise NotImplementedError

    def lock_lane(self, timeout: float | None, cancel=None) -> bool:
        raise NotImplementedError

    async def lock_lane_async(self, timeout: float | None) -> bool:
        raise NotImplementedError

    def checked(self, got: bool, claim: bool) -> bool | None:
        return got

    def claim(self) -> bool:
        return True

    def refused(self) -> bool:
        return False
