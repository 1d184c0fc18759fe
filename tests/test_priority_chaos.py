"""Who goes next under chaos: three classes of turns from every kind of client at once,
random kill -9 of holders and waiters, and the order proven from the records afterwards.

One stand-in engine (the contention detector, lanelock/testing/standin.py) stands behind one lane.
Twelve turn loops per class take turns at it, each turn one short generation: three `lanelock run
--wait --priority CLASS -- curl ...` loops, three processes looping `with gate.turn(priority=...)`,
three asyncio tasks (one of each class in each of three processes) looping `async with
gate.turn(...)`, and three proxy clients (one of each class through each of three `lanelock proxy
--wait`s, sending X-Lanelock-Priority). Loops think a random moment between turns (deliberate
pacing, so the queue is sometimes long and sometimes empty). Meanwhile a killer sends SIGKILL, about
twice a second, to the lane's holder or to a queued waiter -- or, for the proxy's turns, mostly to
the client, whose proxy must then give the request's wait or generation up; whatever it kills is
restarted. Aging is short (AGING seconds a step), so it decides many grants within the run.

The records nobody in the load can fake:

- the engine's: how many generations were in flight (/stats), and, per generation, when it began
  and ended (the stand-in's own counter, written down as it counts, with the X-Lanelock-Session
  header each request carries);
- a token, an flock the curl of a `lanelock run` turn takes before it starts and keeps for as long
  as it lives, and every other generation finds free as it begins (the Python workers look
  themselves, the engine looks for the proxy's requests, each with a shared lock for a moment,
  so two looks never collide: two Python turns at once are the engine's to count): the kernel's
  word that no turn's command still runs when the next turn generates, whatever the engine noticed;
- the journal (`waited` / `acquired` / `released`, each appended by a holder while it holds the
  lane, so the file's order is the order the lane was granted in);
- each queue entry's exact arrival: an observer process watches STEM.queue/ with inotify and
  writes down every entry as it appears (ARRIVAL.RANK.PID.RANDOM, ARRIVAL in CLOCK_MONOTONIC ns --
  the clock of the journal's "monotonic" -- and the session its file names) and when it saw it
  (an upper bound on when the entry became visible to other turns). The journal's own estimate of
  the arrival (monotonic - waited) is shown for comparison: it is taken before the queue is joined.

The same run on the PostgreSQL store (LANELOCK_STORE for every process of the run), where the
records are the server's: the journal is the lanelock_events rows (read through the store, as
`history` reads them), the holder is the holder row whose session holds the lane's advisory lock,
the queue is what `status` shows (store.survey), and the exact arrivals come from an AFTER INSERT
trigger on lanelock_queue that copies each row of the run's lane (ticket, class, arrival -- the
server's clock_timestamp() -- and who) into a table of the test's own and notifies an observer
process, which writes down when the notification came: after the joining transaction committed,
so, as inotify's, an upper bound on when the entry became visible. And on PostgreSQL, besides:
no turn fails open or says "gate unavailable" or "deadlock detected", and the server logs no
"you don't own a lock" (an unlock of an advisory lock its session does not hold).

What must hold: no two generations at once (an overlap the engine counts only because it
had not yet noticed that a killed holder's generation was over is told apart and shown); FIFO
within a class; no later arrival, and no barging turn, granted past a waiter that counted (after
aging) as at least its class; every batch turn served within two aging steps plus the holds of the
turns that had arrived before it; a killed waiter out of the queue once it is dead; no stall, no
traceback, no lost journal line, the lane free and the queue empty at the end.
"""

from __future__ import annotations

import shutil
import sys
import threading
import time

import pytest

from support.cli import TIMEOUT
from support.chaos import (AGING, API_WORKER, ASYNC_WORKER, CLASSES, HANGUP_SEEN_WITHIN, LOAD_LIMIT,
                           PROXY_CLIENT, SLACK, STALL, TARGET, THINK, ChaosEngine, FlockRecords,
                           Load, PgRecords, ProxyHost, Worker, effective, watch_for_stalls)
from support.proxy import CHAT, chat_body


# -- reading the records --------------------------------------------------------------------------
class Turn:
    __slots__ = ("session", "pid", "rank", "granted", "index", "estimate", "arrival", "seen",
                 "after")

    def __init__(self, acquired: dict, waited: dict | None, after: float):
        self.session, self.pid = acquired["session"], acquired["pid"]
        self.rank = CLASSES.index(acquired["priority"])
        self.granted = acquired["monotonic"]
        self.index = 0
        # the journal's estimate of the arrival (taken before try_lock, not at the queue)
        self.estimate = waited["monotonic"] - waited["waited"] if waited else None
        self.arrival: float | None = None   # the queue entry's ARRIVAL, when the turn waited
        self.seen: float | None = None      # when the observer saw the entry: visible by then
        self.after = after   # the journal line before this grant: the grant was decided later


def turns_of(events: list[dict]) -> tuple[list[Turn], int]:
    """(the grants in order, how many turns waited). Every line read here is written by a holder
    while it holds the lane, so the file's order is the grant order, and each grant was decided
    after the line before it."""
    turns, waited, last = [], {}, float("-inf")
    for event in events:
        kind = event.get("event")
        if kind == "waited":
            waited[(event["pid"], event["session"])] = event
        elif kind == "acquired":
            turns.append(Turn(event, waited.pop((event["pid"], event["session"]), None), last))
            last = event["monotonic"]
        elif kind == "released":
            last = event["monotonic"]
    turns = [turn for turn in turns if turn.session != "setup"]
    for index, turn in enumerate(turns):
        turn.index = index
    return turns, sum(turn.estimate is not None for turn in turns)


def match_arrivals(turns: list[Turn], entries: list[dict]) -> dict:
    """Each waiting turn's queue entry (records.arrivals()): by the session it names, else (on
    flock, its waiter left before the observer read its file) the one entry of its pid and class
    nearest the journal's estimate, if no other is nearly as near."""
    parsed = [dict(entry, used=False) for entry in entries]
    by_session = {entry["session"]: entry for entry in parsed if entry["session"]}
    unread = []
    for turn in turns:
        if turn.estimate is None:
            continue
        entry = by_session.get(turn.session)
        if entry is not None and entry["pid"] == turn.pid and entry["rank"] == turn.rank:
            entry["used"] = True
            turn.arrival, turn.seen = entry["arrival"], entry["seen"]
        else:
            unread.append(turn)
    unmatched = 0
    for turn in unread:
        near = sorted((abs(entry["arrival"] - turn.estimate), index)
                      for index, entry in enumerate(parsed) if not entry["used"]
                      and entry["pid"] == turn.pid and entry["rank"] == turn.rank
                      and entry["arrival"] <= turn.granted)
        if near and near[0][0] < 1.0 and (len(near) == 1 or near[1][0] > near[0][0] + 1.0):
            entry = parsed[near[0][1]]
            entry["used"] = True
            turn.arrival, turn.seen = entry["arrival"], entry["seen"]
        else:
            unmatched += 1
    errors = [turn.estimate - turn.arrival for turn in turns if turn.arrival is not None]
    return {"entries": len(parsed), "read": len(by_session), "by_pid": len(unread) - unmatched,
            "unmatched": unmatched, "never_granted": sum(not entry["used"] for entry in parsed),
            "estimate_error": (min(errors), max(errors)) if errors else (0.0, 0.0)}


def out_of_order(turns: list[Turn]) -> tuple[list[str], list[str]]:
    """(within a class, across classes): grants that broke the order, among turns granted.

    X was granted before B. X's grant was decided at some moment between `earliest` -- the later
    of X's arrival in the queue and the journal line before X's grant (the previous holder's,
    written while it held the lane) -- and X's own `acquired` line. B was in the queue for all of
    that if the observer had seen its entry by `earliest` (B leaves the queue only holding the lane,
    after X let go).

    Within a class: X and B of one class, both waited, B arrived first and was in the queue when
    X's grant was decided. Aging cannot excuse it: of two waiters of one class the earlier always
    counts as at least the later's class.

    Across classes (and barging): B in the queue at X's decision and counting, at the earliest
    moment of it, as a higher class than X at its latest -- or the same class with the earlier
    arrival. A turn that took a free lane without waiting (no arrival: it counts as its class)
    must not have done so past a waiter of its class or higher (no barging)."""
    within, across = [], []
    queued = sorted((turn for turn in turns if turn.arrival is not None),
                    key=lambda turn: turn.seen)
    for x in turns:
        earliest = x.after if x.arrival is None else max(x.after, x.arrival)
        x_class = x.rank if x.arrival is None else effective(x.rank, x.arrival, x.granted)
        for b in queued:
            if b.seen > earliest:
                break
            if b.index <= x.index:
                continue
            if x.arrival is not None and b.rank == x.rank and b.arrival < x.arrival:
                within.append(f"{x.session} (arrived {x.arrival:.3f}, granted {x.granted:.3f}) "
                              f"before {b.session} (arrived {b.arrival:.3f}, in the queue by "
                              f"{b.seen:.3f}, granted {b.granted:.3f}), both {CLASSES[x.rank]}")
            b_class = effective(b.rank, b.arrival, earliest)
            if b_class > x_class or (b_class == x_class and (x.arrival is None
                                                             or b.arrival < x.arrival)):
                across.append(f"{x.session} ({CLASSES[x.rank]}, counting as at most "
                              f"{CLASSES[x_class]}, arrived {x.arrival}, granted "
                              f"{x.granted:.3f}, decided after {earliest:.3f}) before "
                              f"{b.session} ({CLASSES[b.rank]}, counting as at least "
                              f"{CLASSES[b_class]}, arrived {b.arrival:.3f}, in the queue by "
                              f"{b.seen:.3f}, granted {b.granted:.3f})")
    return within, across


def batch_waits(turns: list[Turn]) -> tuple[list[str], dict]:
    """Every batch turn is served within two aging steps plus the holds ahead of it: once it
    counts as interactive (two steps after its arrival) only turns that arrived before it go
    first, one hold each -- a hold here is grant to next grant: the hold and its hand-off, or a
    killed holder's time -- after the hold under way at that moment (at most the longest)."""
    cycles = {turn.index: nxt.granted - turn.granted for turn, nxt in zip(turns, turns[1:])}
    longest = max(cycles.values(), default=0.0)
    plain = 2 * AGING + longest + SLACK
    late, worst = [], {"wait": 0.0, "bound": 0.0, "ahead": 0, "over_plain": 0, "count": 0,
                       "longest": longest, "plain": plain}
    for b in turns:
        if b.rank != 0 or b.arrival is None:
            continue
        worst["count"] += 1
        top = b.arrival + 2 * AGING
        ahead = [x for x in turns[:b.index] if x.granted > top and x.arrival is not None
                 and x.arrival < b.arrival]
        bound = plain + sum(cycles[x.index] for x in ahead)
        wait = b.granted - b.arrival
        worst["over_plain"] += wait > plain
        if wait > bound:
            late.append(f"{b.session} waited {wait:.2f}s, bound {bound:.2f}s "
                        f"({len(ahead)} earlier arrivals ahead once it counted as interactive)")
        if wait > worst["wait"]:
            worst.update(wait=wait, bound=bound, ahead=len(ahead))
    return late, worst


def engine_overlaps(lines: list[list[str]], turns: list[Turn],
                    kill_log: list[tuple[float, int, str]]) -> tuple[list[str], list[float]]:
    """(overlaps, excused): each time a generation began at the engine while another was in flight.

    Excused -- and listed by how long the engine went on counting the earlier one -- only when the
    earlier generation's client had been killed before the later one began, and the engine let go
    of it within HANGUP_SEEN_WITHIN: the killed holder process itself (it hands the lane on as it
    dies, and the engine sees the dead connection a moment later, or, starved, counts it to its
    end), or the proxy client the generation answered. A killed `lanelock run` turn whose curl
    still generated when the next generation began is no excuse: the token, which curl keeps until
    it is dead, catches that one."""
    pid_of = {turn.session: turn.pid for turn in turns}
    flying: dict[str, dict] = {}                 # thread -> generation in flight
    pairs = []
    for words in lines:
        kind, when, thread, session = words[0], float(words[1]), words[2], words[4]
        if kind == "enter":
            generation = {"session": session, "enter": when, "leave": None}
            pairs += [(other, generation) for other in flying.values()]
            flying[thread] = generation
        elif kind == "leave" and thread in flying:
            flying.pop(thread)["leave"] = when
    overlaps, excused = [], []
    for first, then in pairs:
        killed = [sent for sent, pid, prefix in kill_log
                  if first["enter"] - 1.0 < sent < then["enter"]
                  and (pid == pid_of.get(first["session"])
                       or (prefix and first["session"].startswith(prefix + "-")))]
        counted_on = (first["leave"] or float("inf")) - then["enter"]
        if killed and counted_on < HANGUP_SEEN_WITHIN:
            excused.append(counted_on)
        else:
            overlaps.append(f"{then['session']} began at {then['enter']:.6f} while "
                            f"{first['session']} (began {first['enter']:.6f}) was in flight "
                            f"until {first['leave']} (its client killed at {killed})")
    return overlaps, excused


# -- the test -------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("store", ["flock", "postgresql"])
def test_priority_chaos_keeps_the_order_and_never_overlaps(store, procs, lock_dir, lock_roots,
                                                           tmp_path, monkeypatch, request):
    started = time.monotonic()
    assert shutil.which("curl") and shutil.which("flock"), "needs curl and flock(1)"
    monkeypatch.setenv("LANELOCK_PRIORITY_AGING", str(AGING))
    if store == "postgresql":   # for every lanelock process of the run (and this one's gates)
        server = request.getfixturevalue("postgres")
        monkeypatch.setenv("LANELOCK_STORE", lock_roots.watch_store(server.dsn))
    token = tmp_path / "generating.token"
    engine = ChaosEngine(procs, token)   # a port, and so a lane, of this test's own
    records = (PgRecords(procs, engine.backend, server, lock_roots.after, tmp_path)
               if store == "postgresql" else FlockRecords(procs, engine.backend))

    load = Load(procs, tmp_path, engine, records, token)
    python, body = sys.executable, chat_body().decode()
    hosts = [ProxyHost(load, index) for index in range(3)]
    for host in hosts:
        host.thread.start()
    for host in hosts:
        assert host.up.wait(TIMEOUT), "a proxy did not start"
    workers, runs, seed = [], [], 0
    for index in range(3):
        for klass in CLASSES:
            seed += 1
            workers.append(Worker(load, "api", f"api{index}-{klass}",
                                  lambda prefix, gen, klass=klass, seed=seed: [
                                      python, "-c", API_WORKER, engine.backend, engine.url, klass,
                                      prefix, THINK, seed * 1000 + gen, token]))
            workers.append(Worker(load, "proxy", f"proxy{index}-{klass}",
                                  lambda prefix, gen, klass=klass, seed=seed, host=hosts[index]: [
                                      python, "-c", PROXY_CLIENT, host.port, klass, prefix,
                                      THINK, seed * 1000 + gen + 500, CHAT, body]))
            runs.append(threading.Thread(target=load.run_loop, name=f"run{index}-{klass}",
                                         args=(klass, f"run{index}-{klass}", seed + 100)))
        workers.append(Worker(load, "async", f"async{index}", lambda prefix, gen, seed=index: [
            python, "-c", ASYNC_WORKER, engine.backend, engine.url, prefix, THINK,
            seed * 1000 + gen, token]))
    killer = threading.Thread(target=load.killer, args=(2604,), name="killer")
    stalls: list[str] = []
    watch = threading.Thread(target=watch_for_stalls, args=(load, records, stalls),
                             daemon=True)
    load_started = time.monotonic()
    for thread in [*(worker.thread for worker in workers), *runs, killer, watch]:
        thread.start()
    try:
        load.finished.wait(LOAD_LIMIT)
    finally:
        load.stop.set()
        load_time = time.monotonic() - load_started
        killer.join(TIMEOUT)
        for worker in workers:
            worker.finish()
        deadline = time.monotonic() + TIMEOUT
        for thread in [*(worker.thread for worker in workers), *runs]:
            thread.join(max(0.0, deadline - time.monotonic()))
        stuck = [thread.name for thread in [*(worker.thread for worker in workers), *runs]
                 if thread.is_alive()]   # (killed at teardown)
        for host in hosts:
            host.close()
        entries, missed = records.arrivals(tmp_path)

    # -- the records ------------------------------------------------------------------------------
    stats = engine.stats()
    events, torn = records.journal()
    turns, waited = turns_of(events)
    matching = match_arrivals(turns, entries)
    within, across = out_of_order(turns)
    late, batch = batch_waits(turns)
    overlaps, excused = engine_overlaps(engine.log(), turns, load.kill_log)
    gaps = [nxt.granted - turn.granted for turn, nxt in zip(turns, turns[1:])]
    granted = {turn.session for turn in turns}
    unrecorded = [session for session in load.done if session not in granted]
    stderr = [*load.proxy_logs, *load.run_stderr,
              *(path.read_text(errors="replace") for path in tmp_path.glob("*.stderr"))]
    tracebacks = [text for text in stderr if "Traceback" in text]
    queue_left = records.queue()
    print(f"\npriority chaos ({records.name}): {len(turns)} turns granted "
          f"({len(load.done)} completed, "
          f"{len(load.lost)} killed under way; {waited} waited) in {load_time:.1f}s of load; "
          f"engine: {stats['total']} generations, max in flight {stats['max_in_flight']}, "
          f"{stats['hangups']} hang-ups")
    print(f"  kills: {sum(load.kills.values())} {load.kills} (proxy restarts "
          f"{sum(host.starts - 1 for host in hosts)}); a killed process's queue entries "
          f"counted on for {max(load.gone_after, default=(0, 0))[0] * 1000:.1f} ms at most after "
          f"its death (bound {records.gone_within:g} s; "
          f"{sum(looks > 0 for _, looks in load.gone_after)} "
          f"of {len(load.gone_after)} kills: still there at the first look)")
    tokens = [*load.overlaps, *engine.overlaps]
    print(f"  overlaps: {len(overlaps) + len(tokens)} (two generating clients alive at once, by "
          f"the token: {len(tokens)}; at the engine: {len(overlaps)}, besides {len(excused)} "
          f"excused: a killed client's generation the engine counted on for "
          f"{max(excused, default=0) * 1000:.2f} ms at most after the next one began)")
    print(f"  out-of-order grants: {len(within)} within a class, {len(across)} across classes "
          f"(effective class, barging)")
    print(f"  batch: longest wait {batch['wait']:.2f}s vs its bound {batch['bound']:.2f}s "
          f"(2 x {AGING:g}s aging + longest hold {batch['longest']:.2f}s + {SLACK:g}s slack + "
          f"the holds of {batch['ahead']} earlier arrivals); {batch['over_plain']} of "
          f"{batch['count']} over the plain {batch['plain']:.2f}s; late: {len(late)}")
    for rank in reversed(range(len(CLASSES))):
        values = sorted(turn.granted - turn.arrival for turn in turns
                        if turn.arrival is not None and turn.rank == rank)
        if values:
            print(f"  {CLASSES[rank]}: {len(values)} waited, median "
                  f"{values[len(values) // 2]:.2f}s, max {values[-1]:.2f}s")
    print(f"  queue entries seen {matching['entries']}: {matching['read']} with their session, "
          f"{matching['by_pid']} by pid and class, {matching['unmatched']} unmatched, "
          f"{matching['never_granted']} never granted (killed or given up); the journal's "
          f"arrival estimate minus the entry's: {matching['estimate_error'][0] * 1000:+.1f} to "
          f"{matching['estimate_error'][1] * 1000:+.1f} ms")
    for line in records.report():
        print(line)
    print(f"  longest gap between grants {max(gaps, default=0):.2f}s; whole test "
          f"{time.monotonic() - started:.1f}s")

    # Every broken promise at once, so one run tells all it found.
    broken = {
        "a `lanelock run` turn's command still ran when the next generation began (the token "
        "was held)": tokens,
        "two generations in flight at the engine": overlaps,
        "out of order within a class": within,
        "out of order across classes (effective class, barging)": across,
        "batch turns served later than two aging steps plus the holds ahead of them": late,
        f"a stall: {max(gaps, default=0):.2f}s without a grant": (stalls or ["(not seen)"])
        if max(gaps, default=0) >= STALL else [],
        "killed processes still queued": [f"{seconds:.3f}s" for seconds, _ in load.gone_after
                                          if seconds > records.gone_within],
        "torn journal lines, or arrivals the observer missed (an inotify overflow, a "
        "notification never received)": ["torn"] * torn + missed,
        "turns that did not end as they should": load.problems,
        "proxies that did not stop cleanly": [status for host in hosts
                                              for status in host.statuses if status != 0],
        "tracebacks": [text[text.index("Traceback"):][-700:] for text in tracebacks],
        "completed turns the journal lacks": unrecorded,
        "journal lines lost to rotation (the setup turn's are gone)": [] if any(
            event.get("session") == "setup" for event in events) else ["setup"],
        "loops whose last turn never ended (a stall at the end)": stuck,
        "too few turns": [len(turns)] if len(turns) < TARGET * 0.6 else [],
        "too few kills": [load.kills] if sum(load.kills.values()) < 20 else [],
        "waiting turns whose queue entry was not seen": [matching] if matching["unmatched"]
        > len(turns) * 0.01 else [],
        "left in the queue": queue_left,
        **records.problems(stderr, events),
    }
    assert not any(broken.values()), "\n".join(
        f"{what}: {len(found)}: {found[:5]}" for what, found in broken.items() if found)
