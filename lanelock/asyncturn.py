"""`async with gate.turn(...) as turn:` -- the same turn for asyncio code, without blocking the loop.

On the flock store a free lane is taken on the loop (a few local system calls); a busy one waits
without a thread of its own: the short steps before and after the wait run in the loop's thread
pool, and the lane's one waiter thread (store/flock/waiting.py) wakes the task through the loop, so 200
waiting requests cost no more threads than one. On a store whose every step may block on the
network (PostgreSQL), the turn runs in a thread of its own. Either way other tasks go on.

Guarantees, as for `with`: the lane is let go on leaving the block, also on an exception; a gate
error fails open. The turn is recorded (holder record, journal) only once the task resumes with
the lane, so cancelling the task while it waits leaves no trace: the wait is abandoned, and a lock
it got at that very moment goes back unrecorded before CancelledError propagates. Each task is
its own owner: two tasks of one process are two turns (only the same task nests), and the kernel
keeps them apart as it keeps processes apart.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import weakref

# A task's owner token. Not id(task): a finished task's id is reused by the next task allocated
# at the same address, which would then "nest" in a turn it does not own (the proxy's lingering
# turn outlives the request task that took it).
_TOKENS: "weakref.WeakKeyDictionary[asyncio.Task, int]" = weakref.WeakKeyDictionary()
_NEXT = itertools.count(1)


def _owner() -> tuple:
    task = asyncio.current_task()
    token = _TOKENS.get(task)
    if token is None:
        token = _TOKENS[task] = next(_NEXT)
    return ("task", token)


async def acquire(turn):
    """Take turn for this task: the steps of turn/acquisition.py, its wait off the loop."""
    loop = asyncio.get_running_loop()
    steps = turn.acquisition
    steps.begin(_owner())
    if not turn.gate.store.blocking_io:
        # A free lane is a few local system calls: take it here, without a thread's start and
        # wake-up (the proxy's time to first byte). Busy: wait in a thread, as below.
        from .errors import WouldBlock

        try:
            steps.take(try_only=True)
            return steps.record()
        except WouldBlock:
            pass
        try:
            await _take_without_a_thread(turn)
        except asyncio.CancelledError:
            steps.give_back()   # a lock the wait got as it was cancelled goes back unrecorded
            raise
        return steps.record()   # the task resumed: only now is the turn recorded
    done = loop.create_future()

    def work() -> None:
        try:
            result, error = steps.take(), None   # records nothing: the task records it below
        except BaseException as raised:   # noqa: BLE001 - handed to the awaiting task
            result, error = None, raised
        try:
            loop.call_soon_threadsafe(_settle, done, result, error)
        except RuntimeError:   # the loop is closed: nobody waits, so nobody keeps the lane
            steps.give_back()

    threading.Thread(target=work, name="lanelock-turn", daemon=True).start()
    try:
        await asyncio.shield(done)
    except asyncio.CancelledError:
        steps.stop_waiting()
        await finished(done)
        steps.give_back()   # a lock the wait got too late goes back unrecorded
        await release(turn, None)
        raise
    # The task resumed: only now is the turn recorded (a cancellation before this point leaves
    # no trace). A flock store's records are local writes; a network store's go to a thread.
    if not turn.gate.store.blocking_io:
        return steps.record()
    try:
        await finished(asyncio.ensure_future(asyncio.to_thread(steps.record)))
    except asyncio.CancelledError:
        await release(turn, None)
        raise
    return turn


def held_unrecorded(turn) -> bool:
    """A free lane of one seat, taken for this task on the loop: True when the turn holds it
    (Acquisition.hold()), its record and journal not yet written -- turn.acquisition.record()
    writes them, and the release does if nothing did. False, nothing taken and nothing
    recorded: the lane is busy or has seats, or the store is not the local flock store, or the
    gate is off or broken -- take a new turn as usual (it records what it finds)."""
    from .errors import GateUnavailable, WouldBlock
    from .turn.states import HELD

    gate, steps = turn.gate, turn.acquisition
    if gate.store.blocking_io or gate.config_error or not gate.gated:
        return False
    steps.begin(_owner())
    try:
        if steps.try_first(try_only=True, seats=False) is None and \
                steps.decision is not None and steps.decision.state == HELD:
            steps.hold()
            return True
    except (WouldBlock, GateUnavailable):
        pass
    steps.give_back()
    return False


async def _take_without_a_thread(turn) -> None:
    """take() on a store whose wait can be awaited (the flock store): its short steps in the
    loop's thread pool, the wait itself on the loop, so a waiting request costs no thread of
    its own. A cancellation lets each step finish first, so whatever it took is known, then
    propagates."""
    from .errors import GateUnavailable

    gate, steps = turn.gate, turn.acquisition
    if gate.config_error or not gate.gated:
        steps.take()
        return
    try:
        waiting = await _off_loop(steps.try_first, False)
        if waiting is None:
            return
        got = await gate.store.wait_lock_async(waiting.handle, waiting.timeout, rank=turn.rank)
        await _off_loop(steps.decide, waiting.handle, got)
    except GateUnavailable as error:
        steps.cannot_take(error)   # crowded: deflect; broken: fail open


async def _off_loop(function, *args):
    """function(*args) in the loop's thread pool; a cancellation waits for it to end, then
    propagates (so what it took is known and let go)."""
    future = asyncio.ensure_future(asyncio.to_thread(function, *args))
    await finished(future)
    return future.result()


async def release(turn, exit_status, ended: str | None = None) -> None:
    """Let the lane go: on the flock store here, as a free lane is taken (a few local writes and
    an unlock; its count waits for nobody on the loop: store/flock/store.py); elsewhere in a
    thread (a PostgreSQL release is a round trip), which a cancellation of the awaiting task
    does not stop. ended: as Turn.release's."""
    if turn.state is None:
        return
    if not turn.gate.store.blocking_io:
        turn.release(exit_status, ended=ended)
        return
    await finished(asyncio.ensure_future(asyncio.to_thread(turn.release, exit_status,
                                                            ended=ended)))


async def settle(turn, outcome: str | None = None) -> None:
    """turn.settle() off the loop: counting is store work (a lock on the counts file, a
    PostgreSQL round trip) that must not stall the other tasks."""
    if turn.unsettled:
        await finished(asyncio.ensure_future(asyncio.to_thread(turn.settle, outcome)))


def _settle(future, result, error) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


async def finished(future) -> None:
    """Wait for future to finish even if this task is cancelled meanwhile (then re-raise)."""
    cancelled = False
    while not future.done():
        try:
            await asyncio.shield(future)
        except asyncio.CancelledError:
            if future.done():
                break
            cancelled = True
        except BaseException:   # noqa: BLE001 - the result is the caller's business
            break
    if cancelled:
        raise asyncio.CancelledError
