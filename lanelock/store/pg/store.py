"""The PostgreSQL lane store: one gate for agents on several hosts sharing one GPU box.

A session-level advisory lock has the kernel's promise: held until released or until the session
ends, so a dead holder releases it with no heartbeat and no reaper. One dedicated connection per
holder, held for the turn's lifetime, and at most two per host with waiters (its head and its
next: hostqueue.py; a turn opens its connection only when it needs one); never through a transaction-mode pooler
(session locks would leak across clients), which is detected: the backend pid must stay the same.

Lane -> advisory key (two-int form): key1 = NAMESPACE (0x4C4E4C4B, "LNLK"), key2 = the first four
bytes of sha256(lane name) as a signed int. The holder row records the full lane name, so a hash
collision between two lanes is reported, never silent.

A vanished holder host: the server holds the lock until its own socket gives up, so every lanelock
session sets the server's keepalives (session.py): the lane frees within about 11 s of the
host's disappearance.

A restart is an outage, not a release: every session ends with it, the holder's and the waiters'.
The holder's row (updated before the server started) is its claim: a taker that gets the lock
within outage.CLAIM_GRACE of the server's start lets it go again and waits, while the holder takes
its lane back (outage.retake) and renews its row; a waiter whose session ended connects again and
waits on (outage.reconnect).
"""

from __future__ import annotations

import os
import time

from ...errors import GateUnavailable, ServerCrowded
from .. import order, seating
from . import kept, lease, outage, records, seats, shared, survey, taken
from . import queue as pg_queue
from ..base import LaneStore
from ...priority import DEFAULT_AGING
from .handle import PgHandle, lane_key
from .line import PgLine
from .session import (BOUND, connect, driver, ended, ensure_schema, first_line, redact, socket_of,
                      timed_out)

# A stop point (turn/stops.py) that wants the release written while the lane is still held.
_PAUSE, _DURING_RELEASE = "LANELOCK_DEBUG_PAUSE", "during-release"


class PgStore(LaneStore):
    kind = "postgresql"
    takes_lanes_away = True   # the server can end a holder's session
    _queue_warned = False   # the one warning of a queue that cannot be used, per process
    _unreachable = False    # this process found the server unreachable (event_handle: no retry)

    def __init__(self, dsn: str, priority_aging: float = DEFAULT_AGING, root=None):
        self.dsn = dsn
        self.aging = priority_aging
        self.root = root      # the lock root of this host's host lanes (hostqueue.py)
        self._flock = None    # the flock store of those host lanes, once a turn opens one

    def problems(self) -> list:
        return []   # `where` does not connect; an unreachable store fails open at the turn

    def qualify(self, lane):
        from ...lanes import as_seen_elsewhere

        # This machine's own LAN address or name, keyed as every other host keys it.
        lane = as_seen_elsewhere(lane)
        if lane.scope != "local":
            return lane
        from ...facts import hostname
        from ...lanes import qualified

        return qualified(lane, hostname())   # "localhost" is another machine on every host

    def locator(self, lane_name: str) -> str:
        key = lane_key(lane_name)
        return f"{redact(self.dsn)}#advisory({key[0]},{key[1]})"

    def where(self, lane) -> dict:
        # No files: the holder record and the events live in tables.
        return {"lock_path": self.locator(lane.name), "sidecar_path": None, "journal_path": None,
                "detail": f"PostgreSQL advisory locks at {redact(self.dsn)}: {BOUND}"}

    def connect(self, application_name: str):
        return connect(self.dsn, application_name)

    # -- values kept with the lanes (kept.py: lanelock_kept, one value every host reads) ---------
    def kept(self, name: str):
        return kept.read(self, name)

    def keep(self, name: str, value) -> None:
        kept.write(self, name, value)

    def open(self, lane_obj, *, create: bool = True) -> PgHandle:
        """A handle with no connection yet: a turn that waits behind another of this host never
        opens one (hostqueue.py); a try, the host's head and the records connect (connected())."""
        lane = lane_obj.name
        key = lane_key(lane)
        handle = PgHandle(None, lane, key, 0, ident=("pg", self.dsn, key))
        handle.local = self._local(lane)
        return handle

    def connected(self, handle: PgHandle) -> None:
        """The handle's own session, opened now when it has none. ServerCrowded: there, and
        busy (its next connection may be had); GateUnavailable: it cannot be reached."""
        if handle.conn is not None:
            return
        try:
            conn = self.connect(f"lanelock {handle.lane}")
        except ServerCrowded:
            raise
        except GateUnavailable:
            self._unreachable = True
            raise
        self._unreachable = False
        # The tables only label turns: a schema that cannot be set up (no CREATE privilege) must
        # not decide whether a turn is gated, so its failure shows later, as record warnings.
        ensure_schema(conn)
        backend, started = self._session(conn, handle)
        handle.conn, handle.backend_pid, handle.fd, handle.started = \
            conn, backend, socket_of(conn), started
        handle.taker = seating.taker(seats.PgSeats(self, handle))   # once: the count just read

    def disconnect(self, handle: PgHandle) -> None:
        """Close the handle's session (with it, any lock and ticket it held): a waiter that is
        not its host's head holds no connection."""
        if handle.conn is not None:
            handle.close()
        handle.conn, handle.fd, handle.held, handle.backend_pid = None, None, False, 0

    def _local(self, lane: str):
        """The turn's place on this host's host lane, or None (no usable lock root)."""
        from . import hostqueue

        if self._flock is None:
            self._flock = hostqueue.flock_store(self._root(), self.aging)
        return hostqueue.open_local(self._flock, self.dsn, lane)

    def _root(self):
        from ...paths import Root, default_root

        if self.root is not None:
            return self.root
        given = os.environ.get("LANELOCK_DIR")
        if given:
            return Root(os.path.abspath(given), "env", "set by LANELOCK_DIR")
        return default_root()

    def keeps_place(self, handle: PgHandle) -> bool:
        """A head that could not reach the server keeps its host lane while its turn runs
        ungated (the gate releases it at the turn's end): one at a time on this host."""
        return handle.local is not None and handle.local.ungated

    def _session(self, conn, handle: PgHandle | None = None) -> tuple[int, float]:
        """(backend pid, the server's start in epoch seconds) of a new connection; with a turn's
        handle, its lane's seat count too, in the same statement (seats.py)."""
        params = None if handle is None else seats.count_params(conn, handle.lane)
        try:
            with conn.cursor() as cursor:
                cursor.execute("SELECT pg_backend_pid(), "
                               "extract(epoch FROM pg_postmaster_start_time())::float8"
                               + ("" if params is None else ", " + seats.COUNT_COLUMNS), params)
                row = cursor.fetchone()
                problem = None if params is None else seats.counted(handle, *row[2:])
                if problem:   # said once; the lane is taken as one seat
                    self.seat_warning(f"lane store: {problem}")
                return row[:2]
        except driver().Error as error:
            conn.close()
            raise GateUnavailable(f"lane store {redact(self.dsn)}: {first_line(error)}") from None

    def reopen(self, handle: PgHandle) -> None:
        """A new session for a handle whose session ended: connection, backend and socket
        swapped in place (the old one is closed). GateUnavailable while the server does not
        answer."""
        conn = self.connect(f"lanelock {handle.lane}")
        backend, started = self._session(conn)
        handle.close()
        handle.conn, handle.backend_pid, handle.fd = conn, backend, socket_of(conn)
        handle.started, handle.held = started, False

    def watch_fd(self, handle: PgHandle) -> int | None:
        return handle.fd

    def try_lock(self, handle: PgHandle, rank: int = 1) -> bool:
        from . import hostqueue

        local = handle.local
        if local is None or local.ticket is not None:
            return self._try_server(handle, rank)
        # Busy with no connection: a turn of this host of this class or higher waits, or
        # another turn of this host is trying (or runs ungated: the host lane's lock).
        if hostqueue.ahead_here(local, rank) or not hostqueue.host_lock(local, 0):
            return False
        try:
            self.connected(handle)
        except ServerCrowded:
            hostqueue.host_unlock(local)
            raise
        except GateUnavailable as error:
            local.handle.asker = handle.asker
            hostqueue.place(local, rank)   # this host's next turns wait behind it
            raise hostqueue.ungated(local, error) from None   # the lock kept: keeps_place
        try:
            return self._try_server(handle, rank)
        finally:
            hostqueue.host_unlock(local)

    def _try_server(self, handle: PgHandle, rank: int) -> bool:
        self.connected(handle)
        if not handle.taker.try_():   # its one lock, or any of its seats
            return False
        return order.keep_free_lane(PgLine(self, handle), rank)

    def waiting_at_or_above(self, handle: PgHandle, rank: int) -> bool:
        """Is a live waiter of this class or higher in the lane's server queue? A queue that
        cannot be read counts as empty (said once)."""
        try:
            return self.queue_call(handle, pg_queue.waiting_at_or_above, handle.lane, rank,
                                   self.aging, self.taken_queue(handle))
        except GateUnavailable as error:
            self.queue_unusable(error)
            return False

    def _try_lane(self, handle: PgHandle) -> bool:
        handle.claimed = None
        backend = self._try_lane_lock(handle)
        return bool(backend) and self._same_session(handle, backend) and self._unclaimed(handle)

    def _try_lane_lock(self, handle: PgHandle) -> int:
        """The lane's lock tried: the backend pid the statement ran on when taken (for the pooler
        check), 0 when not. In the same round trip, when taken, what the take's checks read
        (handle.taken: handoff.py)."""
        from .handoff import try_and_read

        held, backend = try_and_read(self, handle)
        handle.held = held
        return backend if held else 0

    @staticmethod
    def taken_queue(handle: PgHandle) -> list | None:
        """The lane's queue as read with the try that just took the lock (once; None: read it
        now) -- the look the order takes once the lock is its (order.walk, keep_free_lane)."""
        taken = handle.taken
        if taken is None:
            return None
        rows, taken.queue = taken.queue, None
        return rows

    def _unclaimed(self, handle: PgHandle) -> bool:
        """The lock is ours: is the lane too, or does a turn that held it when the server went
        down still have time to take it back (handle.claimed, and the lock let go)?"""
        if handle.claimed is None:
            return True
        self.unlock_lane(handle)
        return False

    def unlock_lane(self, handle: PgHandle) -> None:
        # The unlock and the wake-up of the lane's first waiter in one statement: one round trip,
        # and no moment when the lane is free with its waiter asleep (queue.until_taken).
        from .handoff import flush_leave

        handle.held, handle.taken = False, None
        flush_leave(handle)
        self._call(handle, "SELECT pg_advisory_unlock(%s, %s), pg_notify(%s, '')",
                   (*handle.key, pg_queue.lane_channel(handle.key)))

    def cancel_wait(self, handle: PgHandle) -> None:
        """Give up a wait from another thread: a flag the waiting thread looks at between its
        tries (queue.until_taken) -- no statement waits in the server, so none is cancelled
        there (each such cancel was an ERROR in the server's log)."""
        handle.cancelled = True
        if handle.local is not None:   # a wait on the host lane: its own Event
            from . import hostqueue

            hostqueue.cancel(handle.local)

    # -- waiting in order (store/order.py walks it; line.py is this store's medium) ----------------
    def wait_lock(self, handle: PgHandle, timeout: float | None, cancel=None,
                  rank: int = 1) -> bool:
        """Behind this host's other waiters on its host lane, then -- as the host's head, its
        one connection -- in the server's queue (hostqueue.py)."""
        if handle.local is None:
            return self.wait_in_server(handle, timeout, cancel, rank)
        from . import hostqueue

        return hostqueue.wait(self, handle, timeout, cancel, rank)

    def wait_in_server(self, handle: PgHandle, timeout: float | None, cancel=None,
                       rank: int = 1, waited: float = 0.0) -> bool:
        """In the lane's queue, blocking in the server (never polling) until the lane is ours,
        timeout seconds pass (None: forever) or the wait is cancelled (cancel_wait). waited: the
        seconds the turn already waited on its host (its arrival is that much earlier). A wait
        whose session ends (a restart) is an outage, not a release: it connects again and waits
        on."""
        self.connected(handle)
        deadline = None if timeout is None else time.monotonic() + timeout
        began = time.monotonic() - waited   # a join after a reconnect counts the whole wait
        while True:
            try:
                return order.wait(PgLine(self, handle,
                                         self._join(handle, rank, time.monotonic() - began)),
                                  timeout, cancel)
            except GateUnavailable:
                if handle.cancelled:
                    return False
                if not ended(handle.conn):
                    raise
            if not outage.reconnect(self, handle, deadline, cancel):
                return False
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())

    def retake(self, handle: PgHandle) -> bool | None:
        return outage.retake(self, handle)

    def serve_many(self) -> None:
        shared.keep_open()

    def lease_holds(self) -> None:
        lease.watched()

    # -- the lease (lease.py): a lost link is not a restart ---------------------------------------
    DECIDE = lease.DECIDE
    KILL_BY = lease.KILL_BY

    def renews(self, handle: PgHandle) -> float | None:
        return lease.RENEW if handle.conn is not None and handle.held else None

    def renew(self, handle: PgHandle) -> bool:
        return lease.renew(handle)

    def rest(self, handle: PgHandle, seconds: float | None) -> None:
        lease.rest(handle, seconds)

    def lease_deadline(self, handle: PgHandle) -> float | None:
        return lease.deadline(handle)

    def _join(self, handle: PgHandle, rank: int, waited: float = 0.0) -> int | None:
        """This turn's ticket; None when the queue cannot be used (said once: the wait then
        takes the server's order, the lane's own lock alone)."""
        from . import hostqueue

        try:
            return self.queue_call(handle, pg_queue.join, handle.lane, rank,
                                    {**(handle.asker or {}), "pid": os.getpid(),
                                     "backend": handle.backend_pid}, waited)
        except GateUnavailable as error:
            if handle.cancelled or ended(handle.conn):
                raise   # the session is gone, not the queue (wait_lock connects again)
            self.queue_unusable(error)
            return None
        finally:
            hostqueue.joined(handle.local)

    def queue_unusable(self, error) -> None:
        """The queue cannot be used: said once per process; the waits then take the server's
        order (the lane's own lock)."""
        if not PgStore._queue_warned:
            PgStore._queue_warned = True
            self.warn(f"lane store queue unavailable ({error}); waiting in the server's order")

    def queue_call(self, handle: PgHandle, function, *args):
        """function(the handle's connection, *args), connected first; a server error is
        GateUnavailable."""
        psycopg = driver()
        self.connected(handle)
        try:
            return function(handle.conn, *args)
        except psycopg.Error as error:
            raise GateUnavailable(f"lane store: {first_line(error)}") from None

    def lock_lane(self, handle: PgHandle, timeout: float | None, cancelled=None) -> bool:
        """The lane's lock, within timeout (None: no bound); cancelled(): given up (besides
        cancel_wait)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            handle.claimed = None
            if self._lock_lane_once(handle, deadline, cancelled) and self._unclaimed(handle):
                return True
            if handle.claimed is None or handle.cancelled:
                return False
            # A claim from before a restart: its turn is taking the lane back. Asked again
            # shortly (only in the seconds after a restart), within the timeout.
            pause = min(handle.claimed, outage.CLAIM_PAUSE)
            if deadline is not None and deadline - time.monotonic() <= pause:
                return False
            time.sleep(pause)

    def _lock_lane_once(self, handle: PgHandle, deadline: float | None, cancelled) -> bool:
        """A try; then, while the lane is held, a sleep on the lane's channel (LISTENed before
        the second try: a release between the two is a notification), woken by the holder's
        unlock, by its death when it is a process of this host (its row names it), and every
        queue.RECHECK (a holder that died elsewhere notifies no one) -- queue.until_taken, the
        queue's own wait. No statement waits in the server: none times out, none is cancelled."""
        psycopg = driver()
        death, backend = None, 0

        def attempt() -> bool:
            nonlocal death, backend
            backend = self._try_lane_lock(handle)
            if backend:
                return True
            if death is None:
                death = taken.holder_death(handle)
            return False

        try:
            backend = self._try_lane_lock(handle)
            if backend:
                return self._same_session(handle, backend)
            pg_queue.listen(handle.conn, pg_queue.lane_channel(handle.key))
            given_up = (lambda: handle.cancelled or (cancelled is not None and cancelled()))
            if not pg_queue.until_taken(handle.conn, attempt, deadline, lambda: death,
                                        given_up):
                return False
        except psycopg.Error as error:
            if handle.cancelled:
                return False
            raise GateUnavailable(f"lane store: {first_line(error)}") from None
        finally:
            if death is not None:
                os.close(death)
        return self._same_session(handle, backend)

    def _same_session(self, handle: PgHandle, backend: int | None = None) -> bool:
        """The session is ours and the lane's row lets this take stand (taken.py)."""
        return taken.same_session(self, handle, backend)

    def release(self, handle: PgHandle, count: dict | None = None) -> None:
        local = handle.local
        try:
            with lease.Bounded(handle):
                self._let_go(handle, local)
        except GateUnavailable:
            pass   # the session is gone, and the lock with it
        self._released(handle, local, count)

    def _let_go(self, handle: PgHandle, local) -> None:
        from .handoff import let_go, write_alone

        if handle.held and local is not None:   # no gap for another host's later waiter
            from ...facts import hostname
            from . import hostqueue

            # each look lets go in its own round trip once a head of this host has joined
            hostqueue.await_next_head(local, lambda: let_go(self, handle, hostname()))
        # Only a lock this session holds: a turn that deflected or gave its wait up holds
        # none, and the server warns of every unlock of a lock not held ("you don't own a
        # lock"). The release's row and events go first, in the same round trip.
        if handle.held:
            let_go(self, handle)
        elif handle.releasing is not None:   # the lock gone meanwhile: written all the same
            write_alone(self, handle)

    def _released(self, handle: PgHandle, local, count: dict | None) -> None:
        # The count after the unlock, on the same connection: the next turn starts while this
        # one counts (the hand-off waits for no bookkeeping), and it is counted before release
        # returns.
        if count is not None and handle.conn is not None:
            from . import spool

            records.add_count(handle.conn, handle.lane, dict(count))
            spool.carry(self, handle.conn)   # what turns run ungated kept on this host
        elif count is not None and not self._unreachable:   # a waiter that never connected
            records.count_apart(self, handle.lane, dict(count))
        elif count is not None:   # the server could not be reached: kept on this host
            from . import spool

            spool.keep(self, handle.lane, count=dict(count))
        handle.close()
        if local is not None:
            local.close()

    def host_queued(self, handle: PgHandle) -> bool:
        """Is a turn of this host in the lane's server queue (its head joined)?"""
        try:
            return any(entry.here() for entry in
                       self.queue_call(handle, pg_queue.live, handle.lane))
        except GateUnavailable:
            return True   # nothing to wait for that can be seen

    def count(self, lane, outcome: str, **facts) -> None:
        records.count_apart(self, lane.name, dict(facts, outcome=outcome))

    def counts(self, facts) -> dict:
        return records.counts_of(self, facts)

    # -- holder record and events (records.py) -----------------------------------------------
    def write_holder(self, handle: PgHandle, record: dict) -> None:
        records.write_holder(handle, record)

    def holder_row(self, conn, key, lane) -> tuple[dict | None, str | None]:
        return survey.holder_row(conn, key, lane)

    def write_release(self, handle: PgHandle, full_record, fields: dict) -> None:
        """The release's row is written with the unlock, committed before it, in one round trip
        (release: handoff.let_go) -- unless a stop point asks to find it written while the lane
        is still held (during-release)."""
        from .handoff import Releasing

        if not handle.held or os.environ.get(_PAUSE) == _DURING_RELEASE:
            return super().write_release(handle, full_record, fields)
        handle.releasing = Releasing({**full_record(), **fields})

    def append_event(self, handle: PgHandle, *events: dict) -> None:
        if handle.conn is None and self._unreachable:   # a turn run ungated: kept on its host
            from . import spool

            for event in events:
                spool.keep(self, handle.lane, event=event)
            return
        records.append_event(self, handle, *events)

    def events(self, lane, since: float | None) -> tuple:
        return records.events(self, lane, since)

    # -- inspection (survey.py) ----------------------------------------------------------------
    def survey(self, lane=None, handle=None) -> list:
        """Facts for one lane (or every lane the store knows): survey.py."""
        return survey.survey(self, lane, handle)

    def survey_all(self, most: int) -> list:
        """At most `most` lanes' facts, those changed last (survey.py): one query chooses them."""
        found, self.left_out = survey.survey_all(self, most)
        return found

    def lane_names(self) -> list[str]:
        return survey.lane_names(self)

    def event_handle(self, lane, again: bool = False) -> PgHandle | None:
        """A connection of its own for an event no lock handle carries (an abandoned wait, a
        deflection settled busy, a fail-open turn whose store answered, a lost turn's release);
        None once this process found the server unreachable (unless asked again): a fail-open
        turn must not wait out a second connect timeout to say so."""
        if self._unreachable and not again:
            return None
        try:
            conn = self.connect(f"lanelock {lane.name}")
        except ServerCrowded:
            return None
        except GateUnavailable:
            self._unreachable = True
            return None
        return PgHandle(conn, lane.name, lane_key(lane.name), 0)

    def fail_open_handle(self, lane) -> PgHandle | None:
        """event_handle's; once this process found the server unreachable, a handle with no
        session whose event and count go to the host's spool (spool.py), carried to the server
        by a later turn: the turn asks the unreachable server once, not again to say so."""
        if self._unreachable:
            return PgHandle(None, lane.name, lane_key(lane.name), 0)
        return self.event_handle(lane)

    def claim_witness(self, lane, who: str | None = None) -> tuple:
        """One witness per lane across every host (witness_lock.py)."""
        from .witness_lock import claim

        return claim(self, lane, who)

    def lost(self, handle: PgHandle) -> bool:
        """Has the server ended our session (pg_terminate_backend, restart)? Then the lane is gone.
        A link that timed out (this host's keepalives gave up on a server that stopped answering:
        a partition) is handle.cut_off: the server's keepalives end the session within the same
        bound, so the lane is someone else's to take even while the server cannot be asked
        (outage.retake)."""
        handle.cut_off = timed_out(handle.fd)
        try:
            self._call(handle, "SELECT 1", ())
            return False
        except GateUnavailable:
            return True


    def _call(self, handle: PgHandle, sql: str, params, fetch: bool = True, row: bool = False):
        """One statement on the handle's session: its first column (fetch), its whole row (row),
        or nothing."""
        psycopg = driver()
        if handle.conn is None:   # a turn that never connected (it waited on its host): now
            if self._unreachable:
                raise GateUnavailable(f"cannot reach the lane store {redact(self.dsn)}")
            self.connected(handle)
        try:
            with handle.conn.cursor() as cursor:
                cursor.execute(sql, params)
                if row:
                    return cursor.fetchone()
                return cursor.fetchone()[0] if fetch else None
        except psycopg.Error as error:
            raise GateUnavailable(f"lane store: {first_line(error)}") from None
