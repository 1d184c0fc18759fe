"""`lanelock run`: one turn, from the gate to the exit status.

Held, ungated or fail-open: run the command. Deflected: walk the fallback chain, or exit with the
busy code (75, EX_TEMPFAIL) when no entry ran. The lane is released the moment the command's
process group is empty (the command and whatever it started that stayed in its group: the turn,
runner.py), before anything else is done.
"""

from __future__ import annotations

import errno
import os

from .. import exitcodes, lanes
from ..errors import GateUntrusted, UsageProblem
from ..facts import default_session
from ..gate import DEFLECTED, HELD, UNGATED, Gate, Turn, busy_sentence
from ..holder import words as holder_words
from ..say import Say
from ..settings import Settings
from . import runner

UNTRUSTED = GateUntrusted.reason
TYPE_CHECKING = False   # typing.TYPE_CHECKING without importing typing (milliseconds per turn)
if TYPE_CHECKING:
    from .args import Request
    from .chain import Fallback


class Options:
    """How one `lanelock run` behaves, resolved (a plain class: the run path avoids dataclasses)."""

    def __init__(self, request: Request, settings: Settings, fallbacks: list[Fallback]):
        # Without a label, the turn is named for whoever started `lanelock run` (facts.py): this
        # process is only the wrapper.
        self.session = request.session or settings.get("session") or default_session(os.getppid())
        self.model = request.model
        wait = settings.get("wait")
        self.wait = None if wait == float("inf") else float(wait or 0.0)
        self.fallbacks = fallbacks
        self.busy_exit_code = settings.get("busy_exit_code")
        self.kill_after = settings.get("kill_after")
        self.on_lost = settings.get("on_lost")   # "continue" or "stop" (lanewatch.py)
        self.quiet, self.verbose = request.quiet, request.verbose
        self.settings = settings        # fallback entries' gates read the same files


def start(request: Request) -> int:
    """`lanelock run` with its parsed command line (from click, or from args.parse)."""
    say = Say(request.quiet)
    settings = Settings(request.settings_flags())
    try:
        gate = Gate(settings=settings, warn=say.warn)
    except lanes.BackendError as error:
        raise UsageProblem(str(error)) from None
    entries = []
    if request.fallbacks or request.chain:   # shlex and the chain module only when needed
        from . import chain as chains

        try:
            entries = [chains.parse(text) for text in request.fallbacks]
            if request.chain:
                entries += chains.from_config(request.chain, settings.get("chains"))
        except chains.ChainError as error:
            raise UsageProblem(str(error)) from None
    options = Options(request, settings, entries)
    return run_turn(gate, list(request.command), options, say)


def run_turn(gate: Gate, argv: list[str], options: Options, say: Say) -> int:
    # The child is forked now and parked: after the lock, every millisecond delays the hand-off.
    # Leaving the block without starting it (deflected, ^C while waiting) lets it go.
    try:
        parked = _starter(argv)
    except OSError as error:   # too few descriptors to start any child: the command, a fallback
        say.error(f"cannot start {argv[0]}: {_resources(error)}; nothing ran")
        return exitcodes.RESOURCES
    runner.hold_sigchld()   # before the turn starts a thread; the parked child has its mask
    if gate.store.takes_lanes_away:   # loaded while the turn waits, not on its hand-off (~3 ms)
        from .. import lanewatch  # noqa: F401

        gate.store.lease_holds()   # its hold is watched (_watch): the store may lease it
    with parked:
        turn = gate.turn(session=options.session, model=options.model, argv=argv,
                         wait=options.wait, command_pid=parked.pid,
                         fallback=bool(options.fallbacks)).acquire()
        if turn.state == DEFLECTED:
            parked.cancel()   # before the fallbacks fork children of their own
            return _deflect(gate, turn, options, say)
        if options.verbose:
            _verbose(gate, turn, say)
        outcome = _run(argv, env_changes(turn), options, say, turn, parked)
    if outcome is None:
        return exitcodes.CANNOT_EXECUTE
    if outcome.error:
        say.error(outcome.error)
    runner.reraise_terminal_signal(outcome)
    return outcome.exit_code


def _starter(argv: list[str]):
    """The parked child, or Unforked when it cannot be forked now (_run tries again once the
    turn is decided). OSError (EMFILE) when this process is short of descriptors: the child
    needs 4 at once for its pipes, and a turn only adds its own -- no child could start later."""
    try:
        return runner.Starter(argv)
    except OSError as error:
        if error.errno == errno.EMFILE:
            raise
        return runner.Unforked()


def _resources(error: OSError) -> str:
    """'Too many open files (the open-file limit, ulimit -n, is 6)'."""
    words = error.strerror or str(error)
    if error.errno == errno.EMFILE:
        try:
            import resource   # a C extension: loading it needs a descriptor too
        except (ImportError, OSError):
            return words
        words += f" (the open-file limit, ulimit -n, is {resource.getrlimit(resource.RLIMIT_NOFILE)[0]})"
    return words


def _run(argv, changes, options: Options, say: Say, turn: Turn | None,
         starter: runner.Starter | None = None) -> runner.Outcome | None:
    """Run and release; None when the process could not even be forked."""
    outcome = None
    group: list[int] = []   # the command's process group, once it runs
    watch = _watch(turn, options, say, group)

    try:
        if not isinstance(starter, runner.Starter):
            starter = runner.Starter(argv)
        holding = turn is not None and turn.held and not turn.nested

        def spawned(started=starter) -> None:
            if holding:
                turn.command_started(started.pid)
            if watch:
                group.append(started.pid)
                watch.start()

        def lingering(pids: list[int]) -> None:
            from ..holder import group_words

            kept = f"lane {turn.lane} stays held" if holding else "lanelock waits"
            count = "1 process" if len(pids) == 1 else f"{len(pids) or 'some'} processes"
            say.warn(f"the command ended, but {count} of its process group still "
                     f"run{'s' if len(pids) == 1 else ''} ({group_words(pids)}); {kept} until "
                     f"{'it ends' if len(pids) == 1 else 'they end'}")

        def stopped(now: bool) -> None:
            if now and watch:   # the wrapper stops too: no renewals until it is continued
                watch.pause()
                turn.gate.store.rest(turn.handle, None)
            elif watch:
                watch.resume()
            turn.mark_stopped(now)

        outcome = runner.run(starter, changes, kill_after=options.kill_after,
                             on_spawn=spawned, on_stop=stopped if holding else None,
                             on_linger=lingering)
    except OSError as error:
        if starter is not None:
            starter.cancel()
        say.error(f"cannot start {argv[0]}: {_resources(error)}")
    finally:
        if watch:
            watch.stop()
        if turn is not None:
            turn.release(outcome.exit_code if outcome else None)
    if watch and watch.gone and options.on_lost == "stop" and outcome is not None \
            and not outcome.error:
        outcome.exit_code = exitcodes.LOST   # stopped because its lane was lost, not its own end
    return outcome


def _watch(turn: Turn | None, options: Options, say: Say, group: list[int]):
    """The lane's watch (lanewatch.py) for a holder whose store can take the lane away (a
    PostgreSQL session); None for a flock lane, which nothing takes away. With --on-lost stop,
    a lane lost for good stops the command's process group: SIGTERM, then SIGKILL after
    --kill-after (at the latest before a leased lane's lease ends) if it is still there. From the watch's thread, not through the wrapper's own
    signals: a signal sent to the wrapper just as the command ended would still be pending when
    runner.run unblocks them, and kill the wrapper before it releases."""
    if turn is None or not turn.held or turn.nested or turn.handle is None or \
            turn.gate.store.watch_fd(turn.handle) is None:
        return None
    from ..lanewatch import LaneWatch, Words

    stop = options.on_lost == "stop"

    def lost() -> None:
        if not stop or not group:
            return
        runner.end_group(group[0])
        # A leased lane: the command is gone before another host may take the lane, whatever
        # --kill-after says (store/pg/lease.py's margin).
        after, bound = options.kill_after, watch.kill_within()
        if bound is not None:
            after = bound if after is None else min(after, bound)
        if after is not None and not watch.stopped_within(after):
            runner.end_group(group[0], kill=True)

    watch = LaneWatch(turn, say.warn, Words(stop=stop), on_lost=lost)
    return watch


def _verbose(gate: Gate, turn: Turn, say: Say) -> None:
    if turn.state == HELD:
        how = "nested in the holder's turn" if turn.nested else f"waited {turn.waited * 1000:.1f} ms"
        say.note(f"lane {gate.lane.name} held ({how}; {gate.lock_path})")
    elif turn.state == UNGATED:
        say.note(f"lane {gate.lane.name} ungated (not a local lane; no lock taken)")


def _deflect(gate: Gate, turn: Turn, options: Options, say: Say) -> int:
    who = holder_words(turn.holder)
    waited = f", waited {turn.waited:.2f}s" if options.verbose or options.wait else ""
    if not options.fallbacks:
        say.note(_sent_away(gate, turn, who + waited, f"no fallback, exit {options.busy_exit_code}"))
        turn.settle("busy")
        return options.busy_exit_code
    for index, entry in enumerate(options.fallbacks, 1):
        fallback_turn, skip = _fallback_gate(gate, entry, options)
        if skip:
            say.note(f"fallback {index} skipped: {skip}")
            continue
        say.note(_sent_away(gate, turn, who + waited, f"deflecting to fallback {index}: {entry.text}"))
        changes = env_changes(turn, fallback_turn, index)
        outcome = _run(list(entry.argv), changes, options, say, fallback_turn)
        if outcome is None or outcome.error:
            say.warn(f"fallback {index} did not start: "
                     f"{outcome.error if outcome else 'fork failed'}")
            continue
        turn.settle("deflected")
        runner.reraise_terminal_signal(outcome)
        return outcome.exit_code
    turn.settle("busy")
    say.note(_sent_away(gate, turn, who, f"no fallback could run, exit {options.busy_exit_code}"))
    return options.busy_exit_code


def _sent_away(gate: Gate, turn: Turn, who: str, then: str) -> str:
    """The deflection's one line: the holder's words, or -- a crowded gate's turn could not
    look (gate.Turn._crowded) -- why it cannot tell whether anyone holds the lane."""
    if turn.crowded and turn.reason == UNTRUSTED:
        return (f"{turn.reason}: lane {gate.lane.name}'s gate is not to be trusted "
                f"({turn.crowded}), so not running beside a holder it cannot see; {then}")
    if turn.crowded:
        return (f"{turn.reason}: cannot tell whether lane {gate.lane.name} is held "
                f"({turn.crowded}), so not running beside a holder; {then}")
    return busy_sentence(who, then)


def _fallback_gate(primary: Gate, entry: Fallback, options: Options) -> tuple[Turn | None, str | None]:
    """(turn held on the entry's own lane or None, reason to skip or None): fallback_lane.py's
    rule, the proxy's too."""
    if entry.backend is None:
        return None, None
    from ..fallback_lane import busy_fallback, fallback_gate

    gate, skip = fallback_gate(primary, entry.backend, options.model)
    if gate is None:
        return None, skip
    turn = gate.turn(session=options.session, model=options.model, argv=list(entry.argv),
                     wait=0.0).acquire()
    if turn.state == DEFLECTED:
        return None, busy_fallback(entry.backend, turn.holder)
    return turn, None


def env_changes(turn: Turn, fallback_turn: Turn | None = None,
                index: int | None = None) -> dict[str, str | None]:
    """What the child's environment adds to ours (None: removed): the turn's hand-over (turn.env:
    a child is part of the turn it was handed, handover.py) and the LANELOCK_* facts of its turn."""
    changes: dict[str, str | None] = {
        "LANELOCK_FAILOVER_REASON": None, "LANELOCK_FALLBACK_INDEX": None,
        "LANELOCK_DEBUG_PAUSE": None,   # the hook is for this wrapper, not nested turns
    }
    changes.update(turn.env)
    if turn.state == DEFLECTED:
        changes["LANELOCK_FALLBACK_INDEX"] = str(index or 0)
        if fallback_turn is not None and fallback_turn.held:   # handed the fallback lane's turn
            handed = fallback_turn.env
            changes["LANELOCK_TURNS"] = handed["LANELOCK_TURNS"]
            changes["LANELOCK_HELD"] = handed["LANELOCK_HELD"]
    return changes
