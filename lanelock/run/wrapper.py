"""`lanelock run`: one turn, from the gate to the exit status.

Held, ungated or fail-open: run the command. Deflected: walk the fallback chain, or exit with the
busy code (75, EX_TEMPFAIL) when no entry ran. The lane is released the moment the child ends,
before anything else is done.
"""

from __future__ import annotations

import os

from .. import exitcodes, key
from . import runner
from ..facts import holder_words
from ..gate import BUSY_WORDS, DEFLECTED, HELD, REASON_BUSY, Gate, Turn

TYPE_CHECKING = False   # typing.TYPE_CHECKING without importing typing (milliseconds per turn)
if TYPE_CHECKING:
    from .chain import Entry


class Options:
    """How one `lanelock run` behaves (a plain class: the run path avoids importing dataclasses)."""

    def __init__(self, *, session: str | None = None, model: str | None = None,
                 wait: float | None = 0.0, fallbacks: list[Entry] | None = None,
                 busy_exit_code: int = exitcodes.BUSY, kill_after: float | None = None,
                 quiet: bool = False, verbose: bool = False, lock_dir: str | None = None,
                 store: str | None = None):
        self.session, self.model, self.wait = session, model, wait
        self.fallbacks = list(fallbacks or [])
        self.busy_exit_code, self.kill_after = busy_exit_code, kill_after
        self.quiet, self.verbose = quiet, verbose
        self.lock_dir = lock_dir        # passed on to the gates of fallback entries
        self.store = store


class Say:
    """lanelock's own stderr lines: notes obey -q; errors always print."""

    def __init__(self, quiet: bool):
        self.quiet = quiet

    def note(self, message: str) -> None:
        if not self.quiet:
            os.write(2, f"lanelock: {message}\n".encode("utf-8", "replace"))

    def warn(self, message: str) -> None:
        self.note(f"warning: {message}")

    def error(self, message: str) -> None:
        os.write(2, f"lanelock: {message}\n".encode("utf-8", "replace"))


class UsageProblem(Exception):
    """Bad input found once the arguments are parsed (a malformed backend or fallback): exit 2."""


def start(params: dict) -> int:
    """`lanelock run` with its parsed parameters (from click, or from runargs on the fast path)."""
    say = Say(params["quiet"])
    try:
        gate = Gate(params["backend"], model=params["model"], key_by=params["key_by"],
                    lock_dir=params["lock_dir"], gate=params["gate_override"],
                    grace=params["grace"], store=params["store"], warn=say.warn)
    except key.BackendError as error:
        raise UsageProblem(str(error)) from None
    settings = gate.config
    entries = []
    if params["fallbacks"] or params["chain"]:   # shlex and the chain module only when needed
        from . import chain as chains

        try:
            entries = [chains.parse(text) for text in params["fallbacks"]]
            if params["chain"]:
                entries += chains.from_config(params["chain"], settings.get("chains"))
        except chains.ChainError as error:
            raise UsageProblem(str(error)) from None
    wait = params["wait"]
    if wait is None and settings.get("wait") is not None:
        wait = float(settings.get("wait"))
    busy_exit_code, kill_after = params["busy_exit_code"], params["kill_after"]
    options = Options(
        session=params["session"], model=params["model"],
        wait=None if wait == float("inf") else (wait or 0.0), fallbacks=entries,
        quiet=params["quiet"], verbose=params["verbose"], lock_dir=params["lock_dir"],
        store=params["store"],
        busy_exit_code=busy_exit_code if busy_exit_code is not None
        else settings.get("busy_exit_code", exitcodes.BUSY),
        kill_after=kill_after if kill_after is not None else settings.get("kill_after"))
    return run_turn(gate, list(params["command"]), options, say)


def run_turn(gate: Gate, argv: list[str], options: Options, say: Say) -> int:
    # The child is forked now and parked: after the lock, every millisecond delays the hand-off.
    starter = _starter(argv)
    try:
        turn = gate.turn(session=options.session, model=options.model, argv=argv,
                         wait=options.wait).acquire()
        if turn.state == DEFLECTED:
            if starter is not None:
                starter.cancel()
            starter = None
            return _deflect(gate, turn, options, say)
        if options.verbose:
            _verbose(gate, turn, say)
        outcome, starter = _run(argv, env_changes(turn), options, say, turn, starter), None
    finally:
        if starter is not None:   # an exception (^C while waiting): the parked child goes too
            starter.cancel()
    if outcome is None:
        return exitcodes.CANNOT_EXECUTE
    if outcome.error:
        say.error(outcome.error)
    runner.reraise_terminal_signal(outcome)
    return outcome.exit_code


def _starter(argv: list[str]) -> runner.Starter | None:
    try:
        return runner.Starter(argv)
    except OSError:   # cannot fork now: _run tries again once the turn is decided
        return None


def _run(argv, changes, options: Options, say: Say, turn: Turn | None,
         starter: runner.Starter | None = None) -> runner.Outcome | None:
    """Run and release; None when the process could not even be forked."""
    outcome = None
    watch = LaneWatch(turn, say) if turn is not None and turn.held and not turn.nested else None

    try:
        if starter is None:
            starter = runner.Starter(argv)
        outcome = runner.run(starter, changes, kill_after=options.kill_after,
                             on_spawn=watch.start if watch else None)
    except OSError as error:
        if starter is not None:
            starter.cancel()
        say.error(f"cannot start {argv[0]}: {error.strerror}")
    finally:
        if watch:
            watch.stop()
        if turn is not None:
            turn.release(outcome.exit_code if outcome else None)
    return outcome


class LaneWatch:
    """For a store that can take the lane away (a PostgreSQL session can be terminated), notice
    it while the child runs and say so once. A flock store has nothing to watch."""

    def __init__(self, turn: Turn, say: Say):
        self.turn, self.say = turn, say
        self.fd = turn.gate.store.watch_fd(turn.handle) if turn.handle is not None else None
        self.thread = None
        self.stop_read = self.stop_write = -1

    def start(self) -> None:
        if self.fd is None:
            return
        import threading

        self.stop_read, self.stop_write = os.pipe()
        self.thread = threading.Thread(target=self._watch, name="lanelock-watch", daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        import select

        while True:
            ready, _, _ = select.select([self.fd, self.stop_read], [], [])
            if self.stop_read in ready:
                return
            if self.turn.gate.store.lost(self.turn.handle):
                self.turn.lost = True
                self.say.warn(f"lane {self.turn.lane} lost: the lane store ended this turn's "
                              "session; the command goes on, no longer gated")
                return

    def stop(self) -> None:
        if self.thread is None:
            return
        os.write(self.stop_write, b"x")
        self.thread.join()
        os.close(self.stop_read)
        os.close(self.stop_write)


def _verbose(gate: Gate, turn: Turn, say: Say) -> None:
    if turn.state == HELD:
        how = "nested in the holder's turn" if turn.nested else f"waited {turn.waited * 1000:.1f} ms"
        say.note(f"lane {gate.lane.name} held ({how}; {gate.lock_path})")
    elif turn.state == "ungated":
        say.note(f"lane {gate.lane.name} ungated (not a local lane; no lock taken)")


def _deflect(gate: Gate, turn: Turn, options: Options, say: Say) -> int:
    who = holder_words(turn.holder)
    waited = f", waited {turn.waited:.2f}s" if options.verbose or options.wait else ""
    if not options.fallbacks:
        say.note(f"{REASON_BUSY}: {BUSY_WORDS} ({who}{waited}); no fallback, "
                 f"exit {options.busy_exit_code}")
        return options.busy_exit_code
    for index, entry in enumerate(options.fallbacks, 1):
        fallback_turn, skip = _fallback_gate(gate, entry, options)
        if skip:
            say.note(f"fallback {index} skipped: {skip}")
            continue
        say.note(f"{REASON_BUSY}: {BUSY_WORDS} ({who}{waited}); deflecting to fallback "
                 f"{index}: {entry.text}")
        changes = env_changes(turn, fallback_turn, index)
        outcome = _run(list(entry.argv), changes, options, say, fallback_turn)
        if outcome is None or outcome.error:
            say.warn(f"fallback {index} did not start: "
                     f"{outcome.error if outcome else 'fork failed'}")
            continue
        runner.reraise_terminal_signal(outcome)
        return outcome.exit_code
    say.note(f"{REASON_BUSY}: {BUSY_WORDS} ({who}); no fallback could run, "
             f"exit {options.busy_exit_code}")
    return options.busy_exit_code


def _fallback_gate(primary: Gate, entry: Entry, options: Options) -> tuple[Turn | None, str | None]:
    """(turn held on the entry's own lane or None, reason to skip or None)."""
    if entry.backend is None:
        return None, None
    from ..key import BackendError

    try:
        gate = Gate(entry.backend, model=options.model, lock_dir=options.lock_dir,
                    store=options.store, warn=primary.warn)
    except BackendError as error:   # parse() checks entries; a config chain could still slip by
        return None, str(error)
    if not gate.gated:
        return None, None
    if gate.lock_path == primary.lock_path:
        return None, f"@{entry.backend} is the busy lane itself"
    turn = gate.turn(session=options.session, model=options.model, argv=list(entry.argv),
                     wait=0.0).acquire()
    if turn.state == DEFLECTED:
        return None, f"@{entry.backend} is a busy local lane ({holder_words(turn.holder)})"
    return turn, None


def env_changes(turn: Turn, fallback_turn: Turn | None = None,
                index: int | None = None) -> dict[str, str | None]:
    """What the child's environment adds to ours (None: removed): LANELOCK_* facts of its turn."""
    changes: dict[str, str | None] = {
        "LANELOCK_STATE": turn.state or "", "LANELOCK_LANE": turn.lane,
        "LANELOCK_LOCK_PATH": turn.lock_path, "LANELOCK_SESSION": turn.session,
        "LANELOCK_FAILOVER_REASON": None,
        "LANELOCK_DEBUG_PAUSE": None,   # the hook is for this wrapper, not nested turns
    }
    if turn.model:
        changes["LANELOCK_MODEL"] = turn.model
    if turn.state == DEFLECTED:
        changes["LANELOCK_FAILOVER_REASON"] = REASON_BUSY
        changes["LANELOCK_FALLBACK_INDEX"] = str(index or 0)
    holding = fallback_turn if fallback_turn is not None and fallback_turn.held else turn
    if holding.held and not holding.nested:
        # Lets a nested `lanelock run` recognise its holder when /proc/locks is unreadable.
        changes["LANELOCK_HELD"] = holding.lock_path
        changes["LANELOCK_HOLDER_PID"] = str(os.getpid())
    return changes
