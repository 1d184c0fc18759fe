"""The witness: the engine's own account of what it computes, held against the lane, sample by
sample. lanelock vouches only for the clients that use it; the engine knows every generation.

Each sample reads the engine first (engine.py: one GET), then the lane (store.seats_holding: how
many seats are held, from the holder records, no /proc/locks). Read in that order, a turn that
starts between the two readings can never be taken for an unseen generation; one that ends
between them is "outlived" (below).

Verdicts, per sample:
  covered    the engine generates and a turn holds the lane: each held seat covers one slot
             generating (a lane of N seats: up to N turns hold it at once)
  unseen     the engine generates with no turn holding the lane, or more slots generate than
             seats are held (an engine with --parallel 2 behind one seat): something reaches it
             without lanelock
  held idle  a turn holds the lane and the engine computes nothing (tool calls, a client
             thinking): worth knowing, never an error
  outlived   a generation goes on after its turn released (a client hung up, the engine ending
             its batch): covered for OUTLIVED_GRACE seconds after the release, then unseen. Where
             the engine names its tasks (llama.cpp) and the turn's own were seen, only those
             outlive it: another that starts after the release is unseen at once

An unseen incident is counted and said (one stderr line) when it is first seen (within two
intervals of its start: one to come, one for the GET), so a long bypass is known while it runs;
when it ends, a second line says how long and how many tokens, and it is journaled ("unseen":
when, how long, slots, turns, tokens, tokens_final, which witness) and its seconds added to the
lane's counts, which every process's metrics read. Its tokens are the engine's own final count
where the engine's account keeps one (engine.final_count), else at least the last sample's.
Before it accuses anyone the witness asks the lock's own truth once (store.survey: a holder
that writes no record, a plain flock(1), is a turn too).

Fail open, cost nothing: an engine that cannot be read is said once, and its recovery once; the
witness never touches a turn, and never asks the engine anything that makes it work.
"""

from __future__ import annotations

import os
import threading
import time

from . import engine as engines
from .errors import GateUnavailable, RecordNotWritten

INTERVAL = 0.25          # seconds between samples (the default; --interval)
OUTLIVED_GRACE = 2.0     # seconds a generation may outlive its turn's release before it is unseen
IDLE_FLUSH = 10.0        # seconds of held idle time kept in memory before it is counted
RETRY = 1.0              # seconds between looks at an engine that cannot be read
STANDBY = 2.0            # seconds between a standing-by witness's tries to take over
# Seconds one look may take (a slower engine is "not answering"): short enough that a look in
# flight never keeps `watch` past a second after SIGTERM.
LOOK_TIMEOUT = 0.75


class Incident:
    """One unseen generation, from its first sample to its end. tasks: each task's decoded
    tokens as last sampled; finals: the count the engine gave once the task ended (None: it
    could not tell), by task."""

    __slots__ = ("started", "started_wall", "slots", "turns", "tasks", "seen", "last", "finals",
                 "cut")

    def __init__(self, now: float, wall: float, account, turns: int):
        self.started, self.started_wall = now, wall
        self.slots, self.turns = account.generating, turns
        self.tasks: dict = {}
        self.last: dict = {}      # each task's SlotTask, as last sampled while it generated
        self.finals: dict = {}
        self.seen = now
        self.cut = False          # the witness stopped before the generation ended
        self.sample(now, account)

    def settle(self, account) -> None:
        """The tasks that ended since the last sample get the engine's final count, read now
        while their slots still name them (a slot the next task took has forgotten it)."""
        for task in self.tasks:
            if task not in account.tasks and task not in self.finals and task in self.last:
                self.finals[task] = engines.final_count(self.last[task], account.named.get(task))

    def sample(self, now: float, account) -> None:
        """A sample during the incident."""
        self.settle(account)
        self.slots = max(self.slots, account.generating)
        self.seen = now
        for task, tokens in account.tasks.items():
            self.tasks[task] = tokens
            named = account.named.get(task)
            if named is not None and (named.decoded or task not in self.last):
                self.last[task] = named   # the count of tokens is read from n_decoded >= 1

    def tokens(self) -> tuple[int | None, bool]:
        """(tokens decoded, final): final when every task's is the engine's count at its end;
        else at least the last samples' (None: the engine says no count)."""
        total, final, any_count = 0, not self.cut, False
        for task, sampled in self.tasks.items():
            count = self.finals.get(task)
            if count is None:
                final, count = False, sampled
            if count is not None:
                total, any_count = total + count, True
        return (total, final) if any_count else (None, False)


class Verdicts:
    """The verdict machine, fed one sample at a time (pure: no I/O, its clock given)."""

    def __init__(self, interval: float = INTERVAL, grace: float = OUTLIVED_GRACE):
        self.interval, self.grace = interval, grace
        self.incident: Incident | None = None
        self.idle = 0.0          # held idle seconds not yet counted
        self.verdict = None      # the last sample's: covered, unseen, held-idle, outlived, idle
        self.generating = None   # the last sample's slots generating
        self.turn_tasks: set = set()   # the last hold's tasks still generating when last seen
        self._was_held = False
        self._last: float | None = None

    def excess(self, account, held: int, released_ago: float | None) -> int:
        """Slots generating beyond the turns that may account for them: each held seat covers
        one generation. Within the grace after a release, the released turn's generation may go
        on (outlived). Where the engine names its tasks (llama.cpp's id_task) and the witness
        saw the turn's own: on a free lane only those outlive it, so a generation that begins
        after they ended is unseen at once; otherwise (a /metrics count, a turn too short to be
        sampled, other seats still held: whose task is whose cannot be told) one generation more
        may be the released turn's."""
        generating, held = account.generating, int(held or 0)
        if released_ago is None or released_ago > self.grace:
            return max(0, generating - held)
        if not held and self.turn_tasks and len(account.tasks) == generating:
            return sum(1 for task in account.tasks if task not in self.turn_tasks)
        return max(0, generating - held - 1)

    def observe(self, now: float, wall: float, account, held: int,
                released_ago: float | None) -> list[tuple[str, object]]:
        """[(what, incident)]: ("started", it) when an unseen incident begins, ("ended", it) when
        it is over. held: how many seats turns hold (a bool is 0 or 1). Held idle time
        accumulates in self.idle."""
        step = 0.0 if self._last is None else min(now - self._last, 2 * self.interval + 1.0)
        self._last = now
        generating = account.generating
        self.generating = generating
        seated, held = int(held or 0), bool(held)
        if held and generating == 0:
            self.idle += step
        if held and not self._was_held:
            self.turn_tasks = set()   # a new hold: its own tasks from now on
        self._was_held = held
        if held and account.tasks:
            # Only a task still generating can outlive the release (an engine never reuses a
            # task's id): the tasks of the hold's last sample that saw any, not every task of a
            # long hold (a lingering session, a batch job's turn: thousands). Never emptied
            # during the hold: the turn's own tasks were seen.
            self.turn_tasks = set(account.tasks)
        excess = self.excess(account, seated, released_ago)
        self.verdict = ("unseen" if excess else "covered" if generating and held else
                        "outlived" if generating else "held-idle" if held else "idle")
        found = []
        if excess:
            if self.incident is None:
                self.incident = Incident(now, wall, account, seated)
                found.append(("started", self.incident))
            else:
                self.incident.sample(now, account)
        elif self.incident is not None:
            self.incident.settle(account)   # what is generating now is no part of it
            found.append(("ended", self.end(now)))
        return found

    def gap(self) -> None:
        """A sample could not be read: time without a reading is neither idle nor covered, so the
        next sample starts afresh."""
        self._last = None

    def end(self, now: float) -> Incident | None:
        """Close the incident in progress (it ended by now)."""
        incident, self.incident = self.incident, None
        if incident is not None:
            incident.seen = now
        return incident


def _plural(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def _lane_side(incident: Incident, extra: str = "") -> str:
    """No turn held the lane, or how many slots generated beside how many turns; extra: more
    to say inside the parenthesis."""
    if not incident.turns:
        inside = ", ".join(filter(None, [_plural(incident.slots, "slot"), extra]))
        return f"while no turn held the lane ({inside})"
    holds = "holds" if incident.turns == 1 else "hold"
    inside = "; ".join(filter(None, [f"{incident.slots} slots generating, "
                                     f"{_plural(incident.turns, 'turn')} {holds} the lane",
                                     extra]))
    turn = "the turn that" if incident.turns == 1 else "the turns that"
    return f"beside {turn} held the lane ({inside})"


def first_seen(lane: str, incident: Incident) -> str:
    """Said when an unseen generation is first seen, while it goes on."""
    at = time.strftime("%H:%M:%S", time.localtime(incident.started_wall))
    tokens, _ = incident.tokens()
    so_far = "" if tokens is None else f"{_plural(tokens, 'token')} so far"
    return (f"unseen generation on {lane}: the engine is generating, first seen at {at} "
            f"{_lane_side(incident, so_far)} -- a client reaches the engine without lanelock")


def ended(lane: str, incident: Incident) -> str:
    """Said when it ends (or when the witness stops first): how long, and its tokens -- the
    engine's final count where it gives one, else at least the last sample's."""
    tokens, final = incident.tokens()
    count = ("" if tokens is None or not (final or tokens) else
             f", {'' if final else 'at least '}{_plural(tokens, 'token')}")
    how = "was still going when this witness stopped" if incident.cut else "ended"
    return (f"the generation unseen on {lane} {how}: the engine generated "
            f"{incident.seen - incident.started:.1f} s {_lane_side(incident)}{count}")


class Witness:
    """Watch one engine for one lane (a Place: its store and lane) until stop is set.

    tell(message): a stderr line (`lanelock: ` is added by the caller's say). name: which witness
    ("proxy", "watch"), in the journal and the counts. Runs in the caller's thread (run()) or a
    thread of its own (start())."""

    def __init__(self, place, url: str, *, interval: float = INTERVAL, tell=None,
                 name: str = "watch", grace: float = OUTLIVED_GRACE):
        self.place, self.url, self.interval, self.name = place, url, interval, name
        self.engine = engines.Engine(url, min(LOOK_TIMEOUT, max(interval * 4, 0.5)))
        self.verdicts = Verdicts(interval, grace)
        self.tell = tell or (lambda message: None)
        self.stop = threading.Event()
        self.cannot: str | None = None     # why this engine cannot be witnessed (then run ends)
        self.failing: str | None = None    # the engine cannot be read now (said once)
        self.samples = 0
        self._handle = None
        self._thread: threading.Thread | None = None
        self._remembered = False
        self._recalled = False
        self._claim = None
        self.standing_by: str | None = None   # the other witness this one waits behind
        self._flushed = time.monotonic()

    # -- running ---------------------------------------------------------------------------------
    def start(self) -> "Witness":
        """Run in a thread of its own; an engine that cannot be witnessed is said once."""
        def run():
            why = self.run()
            if why:
                self.tell(f"witness: cannot witness {self.url} ({why}); turns are not affected")

        self._thread = threading.Thread(target=run, name="lanelock-witness", daemon=True)
        self._thread.start()
        return self

    def close(self, timeout: float = 2.0) -> None:
        self.stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def recall(self) -> None:
        """Which way of reading this engine the lane's last witness used (its counts say), so
        that an engine down from the start is named by its own kind's endpoint. Once."""
        if self._recalled:
            return
        self._recalled = True
        store = self.place.store
        try:
            facts = store.survey(self.place.lane)
            engine = store.counts(facts[0]).get("engine") if facts else None
        except (GateUnavailable, OSError):
            return   # said by the first sample that needs the store
        if isinstance(engine, dict) and engine.get("url") == self.url \
                and isinstance(engine.get("source"), str):
            self.engine.known = engine["source"]

    def detect(self) -> str | None:
        """The engine's kind, or None while it cannot be read (said once); CannotWitness when
        there is nothing to witness."""
        self.recall()
        try:
            kind = self.engine.detect()
        except engines.Unreadable as error:
            self._failing(str(error))
            return None
        self._recovered()
        self._remembered = False   # said with the next count, once the lane's store can be
        return kind

    def run(self) -> str | None:
        """Sample until stop is set; returns why it stopped early (cannot witness) or None."""
        try:
            while not self.stop.is_set():
                try:
                    self.stop.wait(self._step())
                except OSError as error:   # out of descriptors (a lazy import opens a file
                    # too): the witness is a bystander, said once and tried again, never a
                    # thread dead with a traceback
                    self._failing(error.strerror or str(error), "the lane's store")
                    self.stop.wait(RETRY)
        except engines.CannotWitness as error:   # the caller says it (start(), watch.py)
            self.cannot = str(error)
        finally:
            self.finish()
        return self.cannot

    def _step(self) -> float:
        """Claim, detect or sample, whichever is due; the seconds to wait before the next."""
        if self._claim is None and not self.claim():
            return STANDBY
        if self.engine.kind is None and self.detect() is None:
            return RETRY
        started = time.monotonic()
        self.sample_once()
        return max(0.0, self.interval - (time.monotonic() - started))

    def sample_once(self) -> None:
        try:
            account = self.engine.sample()
        except engines.Unreadable as error:
            self._failing(str(error))
            return
        self._recovered()
        now, wall = time.monotonic(), time.time()
        try:
            held, released_ago = self._holding()
            # Asked of the lock itself before an incident begins, and on a free lane while it
            # goes on (a plain flock(1) holder may come): never every sample of a held one.
            if (not held or self.verdicts.incident is None) \
                    and self.verdicts.excess(account, held, released_ago):
                held, released_ago = self._confirm(held, released_ago)
        except GateUnavailable as error:
            self._failing(str(error), "the lane's store")
            return
        self.samples += 1
        if not self._remembered:   # which engine this lane's witness watches, for `status`
            self._remembered = True
            self._count()
        for what, incident in self.verdicts.observe(now, wall, account, held or 0, released_ago):
            if what == "started":
                self._count(witness={"unseen": 1})
                self.tell(first_seen(self.place.lane.name, incident))
            else:
                self._report(incident)
        if self.verdicts.idle and (not held or now - self._flushed >= IDLE_FLUSH):
            self._flush_idle(now)

    def claim(self) -> bool:
        """Become the lane's one witness (store.claim_witness), or stand by, said once: two
        witnesses of one engine would count each unseen generation twice."""
        from .facts import hostname

        lane = self.place.lane.name
        try:
            self._claim, other = self.place.store.claim_witness(
                self.place.lane, f"{self.name} pid {os.getpid()} on {hostname()}")
        except GateUnavailable as error:
            self._failing(str(error), "the lane's store")
            return False
        if self._claim is None:
            if self.standing_by is None:
                self.tell(f"witness: {lane} is witnessed already ({other}); standing by, to take "
                          "over when that witness ends")
            self.standing_by = other
            return False
        if self.standing_by is not None:
            self.tell(f"witness: taking over on {lane} ({self.standing_by} ended)")
            self.standing_by = None
        return True

    def finish(self) -> None:
        """At the end: an incident in progress is reported as far as it was seen, idle time
        counted, the store let go."""
        incident = self.verdicts.end(time.monotonic()) if self.verdicts.incident else None
        if incident is not None:
            incident.seen = max(incident.seen, incident.started)
            incident.cut = True   # its tokens: at least what was sampled
            self._report(incident)
        if self.verdicts.idle:
            self._flush_idle(time.monotonic())
        self._drop_handle()
        if self._claim is not None:
            self._claim.close()
            self._claim = None

    def now(self) -> dict:
        """What it sees now, for the proxy's /lanelock/status: {engine, kind, interval, samples,
        verdict (covered, unseen, held-idle, outlived, idle, or None before a sample),
        generating, failing, cannot, standing_by (the witness it waits behind, or None)}."""
        return {"engine": self.url, "kind": self.engine.kind, "interval": self.interval,
                "samples": self.samples, "verdict": self.verdicts.verdict,
                "generating": self.verdicts.generating, "failing": self.failing,
                "cannot": self.cannot, "standing_by": self.standing_by}

    # -- the lane ----------------------------------------------------------------------------------
    def _open(self):
        """Somewhere to journal (and for a network store, a connection to read the lane
        through): the store's event handle where it has one, which creates no lock file -- a
        lane no turn ever used stays one -- else an unlocked handle on the lane."""
        if self._handle is None:
            store = self.place.store
            self._handle = store.event_handle(self.place.lane) or store.open(self.place.lane)
        return self._handle

    def _holding(self) -> tuple:
        """(seats held, None when the store cannot tell; seconds since a seat's last release)."""
        try:
            return self.place.store.seats_holding(self.place.lane, self._open())
        except GateUnavailable:
            self._drop_handle()
            raise

    def _confirm(self, held, released_ago) -> tuple:
        """Before calling a generation unseen: the lock's own truth (/proc/locks, pg_locks), read
        only now -- a holder that writes no record is a turn too, on any seat."""
        facts = self.place.store.survey(self.place.lane, self._open())[0]
        seated = sum(1 for seat in (facts, *facts.other_seats)
                     if seat.held or seat.ending is not None)
        if seated > (held or 0):
            return seated, None
        return held, released_ago

    def _drop_handle(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None

    # -- what it says --------------------------------------------------------------------------------
    def _failing(self, why: str, what: str | None = None) -> None:
        if self.failing is None:
            self.tell(f"witness: cannot read {what or f'the engine at {self.url}'} ({why}); "
                      "turns are not affected, still trying")
        self.failing = why
        self.verdicts.gap()

    def _recovered(self) -> None:
        if self.failing is not None:
            self.failing = None
            self.tell(f"witness: the engine at {self.url} and the lane's store answer again "
                      f"({self.engine.kind or 'kind not known yet'})")

    def _report(self, incident: Incident) -> None:
        from .facts import utc_now

        lane = self.place.lane.name
        duration = round(max(incident.seen - incident.started, 0.0), 3)
        tokens, final = incident.tokens()
        # tokens_final: tokens is the engine's own count at the end (else at least that many)
        fields = {"started": utc_now(incident.started_wall), "duration": duration,
                  "slots": incident.slots, "turns": incident.turns,
                  "tokens": tokens, "tokens_final": final if tokens is not None else None,
                  "witness": self.name, "engine": self.url, "kind": self.engine.kind}
        event = {"event": "unseen", "time": fields["started"],
                 "ts": round(incident.started_wall, 6), "monotonic": round(incident.started, 6),
                 "lane": lane, "pid": os.getpid(), "session": f"witness ({self.name})",
                 **fields}
        try:
            self.place.store.append_event(self._open(), event)
        except (RecordNotWritten, GateUnavailable) as error:
            self.tell(f"witness: the unseen generation was not journaled: {error}")
            self._drop_handle()
        self._count(witness={"unseen_seconds": duration},
                    last_unseen={key: fields[key] for key in
                                 ("started", "duration", "slots", "turns", "tokens",
                                  "tokens_final", "witness")})
        self.tell(ended(lane, incident))   # last: once said, it is journaled and counted

    def _flush_idle(self, now: float) -> None:
        idle, self.verdicts.idle = round(self.verdicts.idle, 3), 0.0
        self._flushed = now
        if idle > 0:
            self._count(witness={"held_idle_seconds": idle})

    def _count(self, **facts) -> None:
        """Add to the lane's counts, saying which engine this witness watches (status looks
        there)."""
        engine = {"url": self.url, "kind": self.engine.kind, "witness": self.name,
                  "pid": os.getpid(), "source": self.engine.source}
        try:
            self.place.store.count(self.place.lane, None, engine=engine, **facts)
        except GateUnavailable:
            pass   # the counts are the metrics' business; the journal line still says it


def engine_url(lane, given: str | None = None) -> str | None:
    """The engine a lane's backend names (scheme://HOST:PORT), or None for a lane on another
    machine (a PostgreSQL store's localhost@OTHER)."""
    from .facts import hostname
    from .lanes import BackendError, origin

    if lane.machine and lane.machine != hostname():
        return None
    try:
        return origin(given or lane.given or f"{lane.host}:{lane.port}")
    except BackendError:
        return None


def parse_engine(text: str) -> str:
    """--engine URL: http(s)://HOST[:PORT][/PATH], as given (no trailing slash). UsageProblem
    names what is wrong."""
    from urllib.parse import urlsplit

    from .errors import UsageProblem

    shown = repr(text if len(text) <= 200 else text[:200] + "…")
    text = text.strip()
    # A space or control character (or a non-ASCII one) anywhere is refused here: the HTTP client
    # would refuse it at the first look, in its own words (InvalidURL: an internal error).
    if any(not " " < ch < "\x7f" for ch in text):
        raise UsageProblem(f"--engine {shown}: not a URL (spaces, control or non-ASCII "
                           "characters); expected e.g. http://127.0.0.1:8080")
    if "://" not in text and text:   # HOST:PORT, as -b takes it: the engine speaks http
        text = f"http://{text}"
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError as error:
        raise UsageProblem(f"--engine {shown}: {error}") from None
    if parts.scheme.lower() not in ("http", "https"):
        raise UsageProblem(f"--engine {shown}: expected an http:// or https:// URL of the engine "
                           "(e.g. http://127.0.0.1:8080)")
    if not parts.hostname:
        raise UsageProblem(f"--engine {shown}: the URL names no host")
    labels = parts.hostname.removesuffix(".").split(".")
    if ":" not in parts.hostname and "" in labels:
        raise UsageProblem(f"--engine {shown}: not a host name (an empty label)")
    if port == 0:
        raise UsageProblem(f"--engine {shown}: port 0 is no engine's port")
    if len(parts.hostname) > 253 or any(len(label) > 63 for label in parts.hostname.split(".")):
        raise UsageProblem(f"--engine {shown}: not a host name (longer than DNS allows)")
    if parts.username or parts.password or parts.query or parts.fragment:
        raise UsageProblem(f"--engine {shown}: give the engine's base URL only (no user, query "
                           "or fragment)")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return (f"{parts.scheme.lower()}://{host}{f':{port}' if port else ''}"
            f"{parts.path.rstrip('/')}")
