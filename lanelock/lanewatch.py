"""Watching a held lane that its store can take away, for whoever holds it: `run`'s command and
the proxy's request.

A flock lane is held until its holder lets go; a PostgreSQL lane lives in a server session, and
the server can end that session under the turn. Two endings, told apart by store.retake()
(store/pg/outage.py):
- a restart is an outage, not a release: the lane is taken back as soon as the server answers
  (Turn.regain; 'regained' journaled with the seconds it was ungated), and the holder goes on;
- a session the server ended itself (pg_terminate_backend), or a lane not taken back before its
  lease runs out (a link reset, cut or frozen while the server is up for the others: the
  store's lease, store/pg/lease.py, which the watch renews), leaves the lane lost for good:
  someone else may hold it now. on_lost() is then called once, and the holder decides (run: go
  on, or stop the command; the proxy: cut the request).

One thread per watched turn, blocked in select() on the session's socket and a stop pipe: every
step after a wake-up (is the session gone? reconnect, retake, rewrite the row) is a blocking round
trip to the server, which must not run on the proxy's event loop, and only a holder is watched --
one turn per lane at a time in a process (a nested turn is not), so it is one thread, not one per
waiting request. A flock store has nothing to watch: no thread at all.
"""

from __future__ import annotations

import os

from .duration import backoff

TYPE_CHECKING = False   # typing.TYPE_CHECKING without importing typing (the run path)
if TYPE_CHECKING:
    from .gate import Turn


# Why a lane is lost for good, in words: the server ended the session itself, or the link to it
# timed out (a partition: the server's keepalives end the session within the same bound).
ENDED = "the lane store ended this turn's session"
CUT_OFF = "the link to the lane store timed out, and the lane store ends its session for that"


def unreachable(seconds: float) -> str:
    """A leased lane not taken back in time: this host cannot reach the store, which may be up
    for the others (a cut link) -- the lease, not a restart, is what to go by."""
    return (f"the lane store cannot be reached from here and this turn's lease on the lane ends "
            f"in {seconds:.0f} s, when another host may take it")


class Words:
    """What a watched turn says, and how often, while its lane is lost (`run`'s lines: the
    proxy has its own, proxy/lost.py). None: nothing said."""

    # While a lost lane is not back, the line is said again this often (None: once).
    SAY_AGAIN: float | None = 10.0

    def __init__(self, stop: bool = False):
        self.stop = stop

    def lost(self, lane: str, why: str = ENDED) -> str | None:
        then = ("stopping the command (--on-lost stop)" if self.stop else
                "the command goes on, no longer gated")
        return f"lane {lane} lost: {why}; {then}"

    def pending(self, lane: str, seconds: float) -> str | None:
        return (f"lane {lane} lost its lane store session {seconds:.0f} s ago; taking the lane "
                "back (its lease keeps other hosts off meanwhile)")

    def regained(self, lane: str, seconds: float) -> str | None:
        return (f"lane {lane} taken back after {seconds:.1f} s ungated: the lane store "
                "restarted under this turn")

    def unfinished(self, lane: str, seconds: float) -> str | None:
        """The turn ended while its lane was still lost and not yet lost for good."""
        return None


class LaneWatch:
    """start() once the holder's work runs, stop() before the turn is released. on_lost(): called
    once, from the watch's thread, when the lane is lost for good."""

    def __init__(self, turn: Turn, warn, words: Words | None = None, on_lost=None):
        self.turn, self.warn, self.words = turn, warn, words or Words()
        self.on_lost = on_lost
        self.fd = turn.gate.store.watch_fd(turn.handle) if turn.handle is not None else None
        self.thread = None
        self.stop_read = self.stop_write = -1
        self.gone = False         # lost for good
        self.paused = False       # no renewals: the holder is stopped with its command (pause)
        self._renewing = None     # held by the watch's thread around a renewal (pause waits)
        self.deadline = None      # monotonic: a lost leased lane's lease ends (store/pg/lease.py)
        self._since = None        # monotonic: when the session was found gone, until taken back

    def start(self) -> None:
        if self.fd is None or self.thread is not None:
            return
        import threading

        self.stop_read, self.stop_write = os.pipe2(os.O_CLOEXEC)
        self._renewing = threading.Lock()
        self.thread = threading.Thread(target=self._watch, name="lanelock-watch", daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        store = self.turn.gate.store
        while True:
            # A store that leases its lanes (store/pg/lease.py) is renewed every `every` s; an
            # unanswered renewal is a lost link as much as a socket that ends.
            every = store.renews(self.turn.handle)
            if every is not None and not self._renew(store):
                woke = self.fd
            else:
                # poll(), not select(): a proxy with many connections has descriptors past
                # select()'s 1024.
                woke = self._wait(every, self.fd)
                if woke == self.stop_read:
                    return
            if woke is not None and self.turn.gate.store.lost(self.turn.handle):
                self.turn.lost = True
                if not self._regain():
                    return
                self.fd = self.turn.gate.store.watch_fd(self.turn.handle)

    def _renew(self, store) -> bool:
        with self._renewing:
            return self.paused or store.renew(self.turn.handle)

    def pause(self) -> None:
        """No renewals until resume(): the holder is about to stop with its command (^Z), and its
        store was told to keep the hold through the silence (store.rest). Returns once no renewal
        is under way: one caught by the stop would find its answer's time long past when the
        process is continued and take the link for lost, and one sent after the rest would put
        the lease's silence limit back under the stopped holder."""
        if self._renewing is None:
            self.paused = True
            return
        with self._renewing:
            self.paused = True

    def resume(self) -> None:
        """Renewals again (the command was continued): the next one sets the lease anew."""
        self.paused = False

    def _regain(self) -> bool:
        """The session is gone: take the lane back as soon as the server answers, if it restarted
        (its claim keeps other turns off), saying so until then. True: held again; False: lost for
        good (on_lost called) or stopped meanwhile. A leased lane (store/pg/lease.py) not back by
        DECIDE s before its lease ends is lost too: this host cannot tell a cut link from an
        outage, and the server hands the lane on once the lease ends."""
        import time

        lane, turn = self.turn.lane, self.turn
        store = turn.gate.store
        lost_at, said, tries = time.time(), None, 0
        since = self._since = time.monotonic()
        self.deadline = store.lease_deadline(turn.handle)
        decide = None if self.deadline is None else self.deadline - store.DECIDE
        while True:
            got = turn.regain(lost_at)
            if got:
                self._since = None
                self._say(self.words.regained(lane, time.monotonic() - since))
                return True
            now = time.monotonic()
            if got is False or (decide is not None and now >= decide):
                self.gone = True
                turn.record.lost_for_good = True
                cut_off = getattr(turn.handle, "cut_off", False)   # a store's handle may say
                why = CUT_OFF if cut_off else ENDED if got is False else \
                    unreachable(max(0.0, self.deadline - now))
                self._say(self.words.lost(lane, why))
                if self.on_lost is not None:
                    self.on_lost()
                return False
            again = self.words.SAY_AGAIN
            if said is None or (again is not None and now - said >= again):
                self._say(self.words.pending(lane, now - since))
                said = now
            pause = backoff(tries)
            if decide is not None:
                pause = max(0.0, min(pause, decide - now))
            tries += 1
            if self._stopped(pause):
                return False

    def kill_within(self) -> float | None:
        """Seconds left before the lost lane's command must be gone (the lease's end less the
        store's margin); None: no such bound (a lane that is not leased)."""
        import time

        if self.deadline is None:
            return None
        return max(0.0, self.deadline - self.turn.gate.store.KILL_BY - time.monotonic())

    def stopped_within(self, seconds: float) -> bool:
        """From the watch's thread (on_lost): wait up to seconds for stop(); True once stopped."""
        return self._stopped(seconds)

    def _stopped(self, seconds: float | None) -> bool:
        """Wait up to seconds (None: for ever) for stop(); True: stopped."""
        return self._wait(seconds) == self.stop_read

    def _wait(self, seconds: float | None, fd: int | None = None) -> int | None:
        """Wait up to seconds (None: for ever) for stop() or for fd to wake: the descriptor that
        woke (stop_read first), or None when the time ran out."""
        import select

        poller = select.poll()
        poller.register(self.stop_read, select.POLLIN)
        if fd is not None:
            poller.register(fd, select.POLLIN)
        ready = [where for where, _ in
                 poller.poll(None if seconds is None else int(seconds * 1000))]
        if self.stop_read in ready:
            return self.stop_read
        return ready[0] if ready else None

    def _say(self, text: str | None) -> None:
        if text:
            self.warn(text)

    def stop(self) -> None:
        """Stop watching (the turn's work ended); a lane still lost and not back is said
        (Words.unfinished)."""
        if self.thread is None:
            return
        import time

        os.write(self.stop_write, b"x")
        self.thread.join()
        self.thread = None
        os.close(self.stop_read)
        os.close(self.stop_write)
        since = self._since
        if since is not None and not self.gone:
            self._say(self.words.unfinished(self.turn.lane, time.monotonic() - since))
