"""`lanelock watch`: a witness in the foreground, for a box without the proxy (a systemd unit
beside the proxy's). Ends within a second of SIGTERM or SIGINT, reporting an unseen generation
still in progress as far as it was seen."""

from __future__ import annotations

import signal

from . import exitcodes
from .witness import Witness
from .witness_models import witness_for


def watch(place, url: str, interval: float, say) -> int:
    """Exit 0 when stopped by a signal; 69 when the engine cannot be witnessed (Ollama, slots
    disabled with no metrics): nothing to compare, so the unit should not be restarted."""
    witness = witness_for(place, url, interval=interval, tell=say.note, name="watch")
    # No signal handler: one that set witness.stop (an Event, which takes a lock) could run while
    # the interrupted main thread held that very lock, inside its own stop.wait(), and the watch
    # hung for ever, deaf to SIGTERM. The signals are blocked and taken with sigtimedwait()
    # while the witness runs in a thread (which inherits the block).
    signal.pthread_sigmask(signal.SIG_BLOCK, STOPPING)
    kind, why = _first_look(witness)
    if witness.cannot is None:
        shown = f"{kind}, {witness.engine.source}" if kind else f"not answering yet: {why}"
        say.note(f"watching the engine at {url} ({shown}) for lane {place.lane.name} every "
                 f"{interval:g} s")
        witness.failing = why   # said just now: the next line about it is its recovery
        _run_until_signalled(witness)
    if witness.cannot is not None:
        say.error(f"cannot witness {url}: {witness.cannot}")
        return exitcodes.GATE_UNAVAILABLE
    return exitcodes.OK


STOPPING = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
LOOK = 0.2   # how often the main thread looks whether the witness ended by itself


def _run_until_signalled(witness: Witness) -> None:
    import threading

    runner = threading.Thread(target=witness.run, name="lanelock-witness-run", daemon=True)
    runner.start()
    while runner.is_alive():
        if signal.sigtimedwait(STOPPING, LOOK) is not None:
            witness.stop.set()
    runner.join()


def _first_look(witness: Witness) -> tuple:
    """(the engine's kind, None), or (None, why it cannot be read yet); an engine that cannot
    be witnessed at all sets witness.cannot."""
    from .engine import CannotWitness, Unreadable

    witness.recall()
    try:
        return witness.engine.detect(), None
    except Unreadable as error:
        return None, str(error)
    except CannotWitness as error:
        witness.cannot = str(error)
        return None, None
