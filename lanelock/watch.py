"""`lanelock watch`: a witness in the foreground, for a box without the proxy (a systemd unit
beside the proxy's). Ends within a second of SIGTERM or SIGINT, reporting an unseen generation
still in progress as far as it was seen."""

from __future__ import annotations

import signal

from . import exitcodes
from .witness import Witness


def watch(place, url: str, interval: float, say) -> int:
    """Exit 0 when stopped by a signal; 69 when the engine cannot be witnessed (Ollama, slots
    disabled with no metrics): nothing to compare, so the unit should not be restarted."""
    witness = Witness(place, url, interval=interval, tell=say.note, name="watch")

    def stop(signo, frame):
        witness.stop.set()

    for signo in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signo, stop)
    kind, why = _first_look(witness)
    if witness.cannot is None:
        shown = f"{kind}, {witness.engine.source}" if kind else f"not answering yet: {why}"
        say.note(f"watching the engine at {url} ({shown}) for lane {place.lane.name} every "
                 f"{interval:g} s")
        witness.failing = why   # said just now: the next line about it is its recovery
        witness.run()
    if witness.cannot is not None:
        say.error(f"cannot witness {url}: {witness.cannot}")
        return exitcodes.GATE_UNAVAILABLE
    return exitcodes.OK


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
