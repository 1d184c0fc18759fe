"""A turn's handle on a PostgreSQL lane (store.py opens it): its session, the lane's advisory
key, and what the turn learnt on the way -- its fence, its lease, its seat, the hand-off's
statements still to go with the next one."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from ..base import LockHandle
from .session import NAMESPACE


def lane_key(lane_name: str) -> tuple[int, int]:
    """The documented advisory key of a lane: (NAMESPACE, signed int32 of sha256(name)[:4])."""
    return NAMESPACE, int.from_bytes(hashlib.sha256(lane_name.encode()).digest()[:4], "big",
                                     signed=True)


@dataclass
class PgHandle(LockHandle):
    conn: object
    lane: str
    key: tuple[int, int]
    backend_pid: int
    ident: tuple = ()              # ("pg", dsn, key): every spelling of the lane shares it
    fd: int | None = None          # the connection's socket, watched for a lost session
    caveat: str | None = None
    cancelled: bool = False        # cancel_wait() gave up the wait
    held: bool = False             # this session holds the lane's lock (release unlocks it then)
    asker: dict | None = None      # who waits (LockHandle.asker)
    outlived: object = None  # a killed turn's command still running (outlived.Command)
    started: float | None = None   # the server's start (epoch s) when this session began
    claimed: float | None = None   # seconds left of another turn's claim (the take was let go)
    fence: int | None = None       # the lane row's generation this turn wrote (write_holder)
    unreleased: dict | None = None  # the row of a turn that never released, when this one took
    cut_off: bool = False          # the session's link timed out (lost(): a partition)
    local: object = None           # its place on the host lane (hostqueue.Local), or None
    # The lease (lease.py): renewed by the watch's thread while the turn holds the lane.
    lease: float | None = None     # seconds the row's lease lasts after a renewal (None: none)
    lease_from: float | None = None  # monotonic: when the last answered renewal was sent
    frozen: bool = False           # a renewal went unanswered: the session is not trusted
    exists = True                  # a lock row exists as soon as anyone asks
    # The hand-off's round trips (handoff.py): what the try that took the lock read after it,
    # the queue leave and the release that go with the session's next statement.
    taken: object = None           # handoff.Taken
    reads: bool = True             # the try may read the row and the queue with it
    leaving: tuple | None = None   # (ticket, listening) of the queue left once the lane is had
    unlisten: tuple = ()           # the seats' channels a head listened on, unlistened with it
    releasing: object = None       # handoff.Releasing: the release's row and events, unwritten
    # Seats (seats.py): the lane's count read as the session began, the seats past it some row
    # names, and the seat the handle is on (key is that seat's: ident keeps the lane's).
    seats: int = 1
    past: tuple = ()
    seat: int = 1
    taker: object = None           # its one lock or any of its seats (seating.taker), per session

    def close(self) -> None:
        try:
            self.conn.close()
        except Exception:  # closing a broken connection: nothing left to do
            pass

