"""Nesting by hand-over: a process is part of a turn only when that turn handed it over.

Every held turn has a token of its own (random, in its holder record as "turn"). A turn hands
itself over through the environment: LANELOCK_TURNS lists the tokens of the turns a process is part
of. `lanelock run` puts it in its command's environment; the API's `turn.env` is the mapping a caller
passes to a subprocess it wants inside the turn. A request through `lanelock proxy` is handed over
by the same tokens in its X-Lanelock-Turns header (the API's `turn.headers`). A turn that finds its
lane busy runs through, as part of the holding turn ("nested"), only when all three hold:

  - the holder record describes the live holder (not released; the kernel or the store agrees),
  - its token is among the asking process's LANELOCK_TURNS (or the request's header),
  - the holder is an ancestor of the asking process -- or, for a request that sent the header,
    the asking process itself: the holder's own requests are part of its turn only by the header.

Why each: ancestry alone let every descendant of a holder in -- a job it started a moment before its
turn, a spawn worker, another thread's `lanelock run`: several generations at once. The token
names the turn itself, so a variable left over from an ended turn (a daemon it started, the next turn
of the same process) or copied into an unrelated shell never matches; ancestry keeps a copied token
in a process outside the holder's tree out. The asking process is this one, or for `lanelock proxy`
the client process behind the connection (proxy/client_process.py).

A request the holding process sends through the proxy without the header would wait for the very
turn that waits for its answer: the proxy asks holds_itself() and answers at once instead.
"""

from __future__ import annotations

import os

from . import proc
from .facts import boot_id

VARIABLE = "LANELOCK_TURNS"
HEADER = "X-Lanelock-Turns"   # the same tokens, sent with an HTTP request (turn.headers)
NESTED, ITSELF = "nested", "itself"   # verdict()'s answers


def new_token() -> str:
    return os.urandom(16).hex()


def tokens(value: str | None) -> list[str]:
    """The tokens in a LANELOCK_TURNS value (space-separated)."""
    return value.split() if value else []


def with_token(value: str | None, token: str) -> str:
    """LANELOCK_TURNS for a process handed `token` on top of the turns it is already part of (a
    turn on another lane, taken inside an outer turn, keeps the outer turn handed over too)."""
    kept = [word for word in tokens(value) if word != token][-15:]   # bounded: never grows per turn
    return " ".join(kept + [token])


class Asker:
    """The process asking to be part of the holding turn: its pid, its LANELOCK_TURNS and its
    ancestors (read once, when first needed)."""

    __slots__ = ("pid", "turns", "sent", "_ancestors")

    def __init__(self, pid: int, turns: list[str], ancestors: list[int] | None = None,
                 sent: bool = False):
        self.pid, self.turns = pid, turns
        self.sent = sent   # the tokens came with the request (turn.headers), not the environment
        self._ancestors = ancestors

    @property
    def ancestors(self) -> list[int]:
        if self._ancestors is None:
            found = proc.proc_stat(self.pid)
            self._ancestors = proc.ancestors(found[0]) if found and found[0] > 0 else []
        return self._ancestors


def this_process() -> Asker | None:
    """This process, or None when nothing was handed to it (the common case costs one lookup)."""
    turns = tokens(os.environ.get(VARIABLE))
    if not turns:
        return None
    return Asker(os.getpid(), turns, proc.ancestors())


def process(pid: int, sent: str | None = None) -> Asker | None:
    """Another process of this machine (a proxy's client): the tokens its request sent (the
    header's value), else those of its environment at exec time (none: it is part of no turn,
    yet still known by its pid). None when its environment cannot be read (another user's
    process, for a proxy that is not root: it is outside every turn)."""
    if sent is not None:
        return Asker(pid, tokens(sent), sent=True)
    try:
        raw = proc.environ(pid)
    except OSError:
        return None
    prefix = VARIABLE.encode() + b"="
    turns: list[str] = []
    for entry in raw.split(b"\0"):
        if entry.startswith(prefix):
            turns = tokens(entry[len(prefix):].decode("ascii", "replace"))
    return Asker(pid, turns)


def part_of(record: dict | None, asker: Asker | None, live: set[int] | None) -> bool:
    """Is the asker part of the turn this holder record describes? live: the pids on this machine
    the lock's own truth says hold the lane (None: the store cannot tell, the record is trusted)."""
    if asker is None or not isinstance(record, dict) or "released_at" in record:
        return False
    token, pid = record.get("turn"), record.get("pid")
    if not isinstance(token, str) or token not in asker.turns or not isinstance(pid, int):
        return False
    if record.get("boot_id") != boot_id():   # a pid means nothing on another machine or boot
        return False
    if live is not None and pid not in live:
        return False
    return (asker.sent and pid == asker.pid) or pid in asker.ancestors


def holds_itself(record: dict | None, asker: Asker | None, live: set[int] | None) -> bool:
    """Is the asker -- another process than this one -- the live holder itself? Its request
    (through the proxy) is not part of the turn unless handed over (part_of), and waiting would
    mean waiting for its own turn to end."""
    if asker is None or asker.pid == os.getpid() or not isinstance(record, dict) \
            or "released_at" in record or record.get("pid") != asker.pid:
        return False
    if record.get("boot_id") != boot_id():
        return False
    return live is None or asker.pid in live


def verdict(record: dict | None, askers: list, live: set[int] | None) -> str | None:
    """NESTED when every asker is part of the turn the record describes; ITSELF when an asker is
    the holder itself, not handed over (it must not wait for its own turn); else None."""
    if all(part_of(record, asker, live) for asker in askers):
        return NESTED
    if any(holds_itself(record, asker, live) for asker in askers):
        return ITSELF
    return None
