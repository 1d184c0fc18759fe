"""A turn's handle on a flock lane (store.py opens it): the lock's descriptor and name, the seat
it is on and the lane's count, the records and journal kept open while it holds, and why a
planted file is not locked. close() lets the lock go first: the next turn can come in."""

from __future__ import annotations

import os

from ..base import LockHandle
from . import seats, sidecar


class Handle(LockHandle):
    __slots__ = ("dir_fd", "fd", "name", "st", "caveat", "stem", "journal_fd", "record", "locked",
                 "queue", "asker", "outlived", "refused", "split", "seat", "seats", "past",
                 "lane_st", "seat_refused", "record_fd", "lane", "taker")

    def __init__(self, dir_fd: int, fd: int | None, name: str, st: os.stat_result | None,
                 caveat: str | None = None, stem: str = ""):
        self.dir_fd, self.fd, self.name, self.st = dir_fd, fd, name, st   # name: the lock file
        self.caveat = caveat   # e.g. the root is on a network filesystem
        self.stem = stem
        self.journal_fd: int | None = None   # a holder's events share one descriptor
        self.record: sidecar.Written | None = None   # this turn's record, kept open to extend
        self.locked = False   # this handle holds the lane (try_lock or wait_lock said True)
        self.queue = None     # the lane's queue.Queue, once asked
        self.asker: dict | None = None   # who waits (LockHandle.asker), for the queue's entry
        self.outlived = None   # a killed turn's command, still running (outlived.Command)
        self.refused: str | None = None   # why a file planted at the lock's name is not locked
        self.split: tuple | None = None   # (pid, inode): a live holder of the removed lock file
        # The seat the handle is on (its lock file: name), the lane's count read at open(), the
        # seats past it the setter made (held ones count against it: seating.py), and seat 1's
        # lock file (the lane's identity, whichever seat is held).
        self.seat, self.seats, self.past = 1, 1, ()
        self.lane_st: os.stat_result | None = None
        self.seat_refused: list[str] = []   # seats this turn found planted (their reasons)
        self.record_fd: int | None = None   # the record, opened writable as the lock was taken
        self.lane: str | None = None   # the lane's name, once its count was read (taking.count)
        self.taker = None   # its one lock or any of its seats (seating.taker), chosen at open()

    @property
    def exists(self) -> bool:
        return self.fd is not None or self.refused is not None

    @property
    def ident(self) -> tuple:
        # Seat 1's inode, which every spelling of the lane shares, whichever seat is held.
        st = self.lane_st or self.st
        return ("flock", st.st_dev, st.st_ino) if st is not None else ()

    @property
    def record_name(self) -> str:
        """The holder record of the seat the handle is on."""
        return seats.record_name(self.name)

    def close(self) -> None:
        # The lock's descriptor first: closing it lets the next turn in; the rest can follow.
        for fd in (self.fd, self.journal_fd, self.record_fd, self.dir_fd):
            if fd is not None and fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.fd = self.dir_fd = self.journal_fd = self.record_fd = None
        self.locked = False
        if self.queue is not None:
            self.queue.close()
            self.queue = None
        if self.record is not None:
            self.record.close()
            self.record = None
