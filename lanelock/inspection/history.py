"""`lanelock history`: the lane's night at a glance, from its journal.

Turns are the journal's `acquired` (local) and `deflected` events; a local turn whose own session
was deflected since its last local turn is marked as the way back. A deflected event is a turn sent away: "deflected" when a
fallback ran, "busy" when nothing did (its `outcome`, or a later `settled` event naming it: the
metrics' outcomes, told apart the same way); one with `waited` timed out waiting (--wait). An old
journal's deflection, which says neither, reads as deflected. The timeline divides each hour into
60 one-minute cells, each what most of that minute's turns were: local (held), deflected, busy
(a tie goes to the one sent away), or idle; unseen outranks them all.

A local turn ends with its `released` event. One without (its holder was kill -9'd, or still runs)
is judged by its holder: still running is "holding", gone is "died". One whose store session
ended under it (a PostgreSQL partition, pg_terminate_backend) ends with its `lost` event instead:
it ran ungated from the loss to its end, beside the turn that then took the lane -- whose
`took-over` event names it (turn, fence). The overlap of the two is the lost turn's end less the
taker's start; until the lost turn's `lost` event is journaled it is "still running". A died turn never said when
it ended, so it counts in neither the longest hold nor busy: stretched to the next line of the
journal, one killed 1 s turn once read as "longest hold 10.4 s; busy 100%". What is known of its
end is an upper bound: the next turn that took the lane (one holder at a time: the kernel had
dropped the dead one's lock by then).
"""

from __future__ import annotations

import time

from .. import duration


LOCAL, DEFLECTED, BUSY, IDLE, UNSEEN = "local", "deflected", "busy", "idle", "unseen"
# How a local turn ended (its `acquired` event's "ended"); see the module docstring.
RELEASED, DIED, HOLDING, UNKNOWN, LOST = "released", "died", "holding", "unknown", "lost"


class SinceError(ValueError):
    pass


def parse_since(text: str | None, now: float | None = None) -> float | None:
    """A duration ago ('90', '90s', '30m', '2h', '1d', '1w': duration.py), or an ISO date/time
    (local time unless it says otherwise, as every time lanelock shows: facts.shown_time)."""
    if not text:
        return None
    now = time.time() if now is None else now
    ago = duration.seconds(text)   # the one duration syntax of every option (duration.py)
    if ago is not None:
        return now - ago
    from datetime import datetime

    try:
        moment = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise SinceError(f"--since {text!r}: expected a duration ({duration.EXAMPLES}) or an "
                         "ISO date") from None
    if moment.tzinfo is None:   # local time, as the table and timeline show it
        moment = moment.astimezone()
    return moment.timestamp()


def from_events(events: list[dict], bad: int, now: float | None = None) -> dict:
    """The history view of events from any store (journal lines or the events table)."""
    events = [e for e in events if isinstance(e.get("event"), str) and _number(e.get("ts")) is not None]
    events.sort(key=lambda e: e["ts"])
    events = _settle(events)
    _mark_way_back(events)
    _mark_endings(events, time.time() if now is None else now)
    _mark_lost(events)
    from .usage import sessions

    return {"events": events, "unreadable_lines": bad, "summary": summarise(events),
            "sessions": sessions(events)}


def _settle(events: list[dict]) -> list[dict]:
    """Each deflection's outcome ("outcome": deflected or busy), folding in the `settled` events
    that name one (by its pid and ts); the settled events themselves are no turns."""
    deflections = {(e.get("pid"), e["ts"]): e for e in events if e["event"] == "deflected"}
    kept = []
    for event in events:
        if event["event"] == "settled":
            named = deflections.get((event.get("pid"), _number(event.get("of"))))
            if named is not None and event.get("outcome") in (DEFLECTED, BUSY):
                named["outcome"] = event["outcome"]
            continue
        if event["event"] == "deflected" and event.get("outcome") not in (DEFLECTED, BUSY):
            event["outcome"] = DEFLECTED
        kept.append(event)
    return kept


def outcome(event: dict) -> str:
    """What the table calls an event: a deflection's outcome (busy or deflected), else its kind."""
    return event.get("outcome", DEFLECTED) if event["event"] == "deflected" else event["event"]


def _mark_way_back(events: list[dict]) -> None:
    """A local turn is the way back when its own session was sent away since that session's last
    local turn: another session's deflection says nothing of this one (a chat turn that never
    left the engine is not "back")."""
    deflected_since_local: set = set()
    for event in events:
        session = _session(event)
        if event["event"] == "deflected":
            deflected_since_local.add(session)
        elif event["event"] == "acquired":
            event["way_back"] = session in deflected_since_local
            deflected_since_local.discard(session)


def _session(event: dict):
    """The session a turn belongs to, hashable whatever the journal line holds."""
    session = event.get("session")
    return session if isinstance(session, (str, int, float)) else None


def _mark_endings(events: list[dict], now: float) -> None:
    """On each acquired event: how its turn ended ("ended"), how long it held ("held": to its
    release, or until now while holding; None when the end is unknown) and, for a turn that did
    not say when it ended, the latest it can have ended ("ended_before": the next turn that took
    the lane, else None)."""
    from ..holder import still_running

    # Open turns by seat, then pid: one holder at a time on each seat (an event without a
    # seat is on seat 1: a one-seat lane's journal).
    open_turns: dict[int, dict[int, dict]] = {}

    def close(start: dict, ended: str, held: float | None = None, before: float | None = None):
        start.update(ended=ended, held=None if held is None else round(max(held, 0.0), 6),
                     ended_before=before)

    for event in events:
        pid = event.get("pid") if isinstance(event.get("pid"), int) else None
        on_seat = open_turns.setdefault(seat_of(event), {})
        if event["event"] == "acquired":
            # One holder at a time on a seat: a turn still open on it has lost its lock,
            # whatever it says.
            for start in on_seat.values():
                close(start, UNKNOWN if still_running(start) else DIED, before=event["ts"])
            on_seat.clear()
            if pid is not None:
                on_seat[pid] = event
            else:
                close(event, UNKNOWN)
        elif event["event"] == "released" and pid in on_seat:
            start = on_seat.pop(pid)
            event.setdefault("priority", start.get("priority"))
            duration = _number(event.get("duration"))
            close(start, RELEASED, duration if duration is not None else event["ts"] - start["ts"])
    for start in (start for seat in open_turns.values() for start in seat.values()):
        running = still_running(start)
        if running:
            close(start, HOLDING, now - start["ts"])
        else:
            close(start, UNKNOWN if running is None else DIED)
            if running is False:
                _mark_still_running(start)


def seat_of(event: dict) -> int:
    """The seat a turn's event is on (1 on a one-seat lane, whose events name none)."""
    seat = event.get("seat")
    return seat if isinstance(seat, int) and not isinstance(seat, bool) and seat >= 1 else 1


def _mark_lost(events: list[dict]) -> None:
    """A lost turn's acquired event ends with its `lost` event (ended "lost", held to its end);
    each `took-over` event gets the overlap with the turn it took the lane from: "overlap" in
    seconds (that turn's end less this one's start), or None while that turn has not said its
    end ("overlap_open": "still running", or "died" when it was judged dead)."""
    turns = {e.get("turn"): e for e in events if e["event"] == "acquired" and e.get("turn")}
    ends = {e.get("turn"): e for e in events if e["event"] == "lost" and e.get("turn")}
    for turn, lost in ends.items():
        start = turns.get(turn)
        if start is not None:
            duration = _number(lost.get("duration"))
            start.update(ended=LOST, ended_before=None, ungated=_number(lost.get("ungated")),
                         held=round(duration if duration is not None else lost["ts"] - start["ts"],
                                    6))
    for taker in (e for e in events if e["event"] == "took-over"):
        before = taker.get("from") if isinstance(taker.get("from"), dict) else {}
        lost = ends.get(before.get("turn"))
        if lost is not None:
            taker["overlap"], taker["overlap_open"] = round(max(0.0, lost["ts"] - taker["ts"]), 3), None
            continue
        start = turns.get(before.get("turn"))
        taker["overlap"] = None
        taker["overlap_open"] = DIED if start is not None and start.get("ended") == DIED \
            else "still running"


def _mark_still_running(start: dict) -> None:
    """The last turn died without releasing: does its command's process group still run? Then
    the lane is not free until it is empty (store/outlived.py): "still_running" {pgid, pids}."""
    from ..store.outlived import running_command

    command = running_command(start)
    if command is not None:
        start["still_running"] = {"pgid": command.pgid, "pid": command.pid,
                                  "pids": command.members}


def holds(events: list[dict]) -> list[tuple[float, float, dict]]:
    """(start, end, acquired event) for each local turn whose length is known (released, or
    holding until now)."""
    return [(event["ts"], event["ts"] + event["held"], event) for event in events
            if event["event"] == "acquired" and event.get("held") is not None]


def summarise(events: list[dict]) -> dict:
    local = sum(1 for e in events if e["event"] == "acquired")
    sent_away = [e for e in events if e["event"] == "deflected"]
    busy = sum(1 for e in sent_away if e.get("outcome") == BUSY)
    deflected = len(sent_away) - busy
    fail_open = sum(1 for e in events if e["event"] == "fail-open")
    ended = [e.get("ended") for e in events if e["event"] == "acquired"]
    spans = holds(events)
    held = _covered(spans)
    last = max([events[-1]["ts"]] + [end for _, end, _ in spans]) if events else 0.0
    window = (last - events[0]["ts"]) if events else 0.0
    turns = local + deflected + busy + fail_open
    unseen = [e for e in events if e["event"] == "unseen"]
    takers = [e for e in events if e["event"] == "took-over"]
    return {
        # Seconds lanes ran ungated under a holder whose store session ended: taken back after
        # a restart ('regained'), or lost to its end ('lost'); and the overlaps that made.
        "ungated_seconds": round(sum(_number(e.get("ungated")) or 0.0 for e in events
                                     if e["event"] in ("regained", "lost")), 3),
        "overlaps": len(takers),
        "overlap_seconds": round(sum(_number(e.get("overlap")) or 0.0 for e in takers), 3),
        "overlaps_open": sum(1 for e in takers if e.get("overlap") is None),
        # Generations the engine ran that no turn held the lane for (a witness saw them).
        "unseen": len(unseen),
        "unseen_seconds": round(sum(_number(e.get("duration")) or 0.0 for e in unseen), 3),
        # deflected: a fallback ran; busy: nothing ran (as the metrics' outcomes)
        "turns": turns, "local": local, "deflected": deflected, "busy": busy,
        "fail_open": fail_open,
        "deflection_rate": round(deflected / turns, 4) if turns else 0.0,
        "busy_rate": round(busy / turns, 4) if turns else 0.0,
        # turns sent away after waiting all of their --wait
        "timed_out": sum(1 for e in sent_away if _number(e.get("waited")) is not None),
        # the share of the span some turn held the lane
        "busy_fraction": round(min(1.0, held / window), 4) if window > 0 else (1.0 if spans else 0.0),
        "longest_hold": round(max((end - start for start, end, _ in spans), default=0.0), 3),
        "died": ended.count(DIED), "holding": ended.count(HOLDING),
        "end_unknown": ended.count(UNKNOWN),
        "way_back": sum(1 for e in events if e.get("way_back")),
        "first": events[0].get("time") if events else None,
        "last": events[-1].get("time") if events else None,
    }


def _covered(spans: list) -> float:
    """Seconds some turn held the lane: the union of the holds (turns on several seats at once
    count once; on a one-seat lane the holds follow one another, and this is their sum)."""
    total, reached = 0.0, None
    for start, end, _ in sorted(spans, key=lambda span: span[0]):
        if reached is None or start >= reached:
            total += end - start
            reached = end
        elif end > reached:
            total += end - reached
            reached = end
    return total


def timeline(events: list[dict]) -> list[tuple[str, list[str]]]:
    """[(hour label, 60 cells)] from the first event's hour to the last's, local time as every
    time shown (a turn whose end is unknown shows in the minute it began)."""
    if not events:
        return []
    spans, unseen = _spans(events)
    first_hour = int(events[0]["ts"] // 3600) * 3600
    last_hour = int(events[-1]["ts"] // 3600) * 3600
    rows = []
    for hour in range(first_hour, last_hour + 3600, 3600):
        label = time.strftime("%Y-%m-%d %H:00 %Z", time.localtime(hour))
        rows.append((label, minute_cells(events, spans, unseen, hour)))
        if len(rows) >= 48:   # two days of bars is a glance; --since narrows it
            break
    return rows


def last_hour(events: list[dict], now: float) -> tuple[float, list[str]]:
    """(its first minute's start, 60 cells): the hour up to the current minute, as timeline()
    draws each hour (the proxy's page)."""
    start = (now // 60 + 1) * 60 - 3600
    spans, unseen = _spans(events)
    return start, minute_cells(events, spans, unseen, start)


def _spans(events: list[dict]) -> tuple[list, list]:
    """(the local turns' (start, end, event), the unseen generations' (start, end))."""
    spans = holds(events) + [(e["ts"], e["ts"], e) for e in events
                             if e["event"] == "acquired" and e.get("held") is None]
    unseen = [(e["ts"], e["ts"] + (_number(e.get("duration")) or 0.0)) for e in events
              if e["event"] == "unseen"]
    return spans, unseen


def minute_cells(events: list[dict], spans: list, unseen: list, start: float) -> list[str]:
    """The 60 one-minute cells from start: turns per minute and kind -- a local turn counts in
    every minute it held the lane, a deflection in the minute it was sent away -- each cell
    what most of them were, and unseen over all (what nobody gated outranks all the gate did)."""
    counts = [{LOCAL: 0, DEFLECTED: 0, BUSY: 0} for _ in range(60)]
    for begin, end, _ in spans:
        for minute in _minutes(start, begin, end):
            counts[minute][LOCAL] += 1
    for event in events:
        if event["event"] == "deflected" and start <= event["ts"] < start + 3600:
            counts[int((event["ts"] - start) // 60)][outcome(event)] += 1
    cells = [_most(count) for count in counts]
    _mark(cells, start, unseen, UNSEEN)
    return cells


def _most(count: dict) -> str:
    """What most of a minute's turns were; a tie goes to the turn sent away (a deflection
    happens while someone holds the lane, and is what a reader looks for), busy before
    deflected (nothing ran). No turn: idle."""
    best = max(count.values())
    if not best:
        return IDLE
    return next(kind for kind in (BUSY, DEFLECTED, LOCAL) if count[kind] == best)


def _minutes(hour: float, start: float, end: float) -> range:
    """The minute cells of the hour a (start, end) span touches."""
    first = max(0, int((start - hour) // 60))
    last = min(59, int((end - hour) // 60))
    return range(first, last + 1) if start < hour + 3600 and end >= hour else range(0)


def _mark(cells: list[str], hour: float, spans, kind: str) -> None:
    """Every minute cell of the hour that a (start, end) span touches becomes kind."""
    for start, end in spans:
        for minute in _minutes(hour, start, end):
            cells[minute] = kind


def describe(event: dict) -> str:
    kind = event["event"]
    if kind == "released":
        from ..holder import exit_words

        ended = event.get("ended")
        return ((f"{_seat(event)}, " if event.get("seat") is not None else "") + f"held {_number(event.get('duration')) or 0:.1f}s, {exit_words(event)}"
                + (f"; not a clean release: {str(ended)[:120]}" if ended else ""))
    if kind == "deflected":
        return _deflection(event)
    if kind == "waited":
        return f"waited {_number(event.get('waited')) or 0:.2f}s"
    if kind == "fail-open":
        return str(event.get("reason"))[:120]
    if kind == "abandoned":   # a wait given up before the lane came: no turn, nothing ran
        wait = _number(event.get("wait"))
        who = ("the client hung up" if event.get("reason") == "client_gone"
               else str(event.get("reason"))[:60])
        return (f"{who} after waiting {_number(event.get('waited')) or 0:.1f}s "
                f"({f'its wait {wait:g}s' if wait is not None else 'it would wait for ever'}); "
                "nothing ran")
    if kind == "unseen":
        turns = event.get("turns")
        beside = (f"beside {turns} turn{'' if turns == 1 else 's'} holding"
                  if isinstance(turns, int) and turns else "while no turn held the lane")
        tokens = event.get("tokens")
        # tokens_final false: at least that many (the engine no longer kept the final count)
        least = "at least " if event.get("tokens_final") is False else ""
        slots = event.get("slots")
        return (f"the engine generated {_number(event.get('duration')) or 0:.1f}s {beside} "
                f"({slots} slot{'' if slots == 1 else 's'} generating"
                f"{f', {least}{tokens} tokens' if isinstance(tokens, int) else ''}; seen by "
                f"{event.get('witness')} at {event.get('engine')})")
    if kind == "regained":   # a store restart ended the holder's session; it took the lane back
        return (f"the lane store restarted under this turn: the lane was ungated "
                f"{_number(event.get('ungated')) or 0:.1f}s, then taken back")
    if kind == "lost":
        cause = ("the lane store ended this turn's session" if event.get("how") == "ended" else
                 "its lane store session ended and the lane was not taken back (the store did "
                 "not answer, or another turn held it)")
        return (f"{cause}: the lane lost, it ran on {_number(event.get('ungated')) or 0:.1f}s "
                f"ungated to its end{_fence(event)}")
    if kind == "took-over":
        return _took_over(event)
    if kind == "acquired":
        parts = [_seat(event)] if event.get("seat") is not None else []
        parts += ["back on local after deflections"] if event.get("way_back") else []
        return "; ".join(parts + [_ending(event)]).strip("; ")
    return ""


def _deflection(event: dict) -> str:
    """'timed out after waiting 5.0s (--wait 5s); nothing ran: local_backend_busy: held by ...'"""
    from ..holder import words

    holder = event.get("holder") if isinstance(event.get("holder"), dict) else None
    seated = event.get("holders")
    if isinstance(seated, list) and seated and holder is not None:   # every seat's holder
        seats = event.get("seats")
        holder = {**holder, "holders": seated,
                  "seats": seats if isinstance(seats, int) and not isinstance(seats, bool)
                  else len(seated)}
    parts = []
    waited, wait = _number(event.get("waited")), event.get("wait")
    if waited is not None:
        asked = f"its wait {_number(wait):g}s" if _number(wait) is not None else "its wait"
        parts.append(f"timed out after waiting {waited:.1f}s ({asked})")
    parts.append("nothing ran" if event.get("outcome") == BUSY else "sent to a fallback")
    return "; ".join(parts) + f": {event.get('reason')}: held by {words(holder)}"


def _seat(event: dict) -> str:
    """'seat 2 of 2' for a turn's event on a lane of several seats."""
    seats = event.get("seats")
    of = f" of {seats}" if isinstance(seats, int) and not isinstance(seats, bool) else ""
    return f"seat {seat_of(event)}{of}"


def _fence(event: dict) -> str:
    fence = event.get("fence")
    return f" (fence {fence})" if isinstance(fence, int) and not isinstance(fence, bool) else ""


def _took_over(event: dict) -> str:
    """'took the lane from pid 42 on b (fence 6), which never released; overlap 3.2s'."""
    before = event.get("from") if isinstance(event.get("from"), dict) else {}
    host = f" on {str(before['hostname'])[:64]}" if before.get("hostname") else ""
    said = (f"took the lane from pid {before.get('pid', '?')}{host}{_fence(before)}, which never "
            "released; overlap ")
    overlap = _number(event.get("overlap"))
    if overlap is not None:
        return said + f"{overlap:.1f}s"
    if event.get("overlap_open") == DIED:
        return said + "unknown: it died without a word"
    return said + "still running (its end not journaled yet)"


def _ending(acquired: dict) -> str:
    ended, before = acquired.get("ended"), _number(acquired.get("ended_before"))
    if ended == LOST:
        return f"lost its lane; ran on {_number(acquired.get('ungated')) or 0:.1f}s ungated"
    if ended == DIED:
        return "died without releasing" + (
            f"; the next turn took the lane {before - acquired['ts']:.1f}s after it began"
            if before is not None else "") + _still_running(acquired.get("still_running"))
    if ended == HOLDING:
        return "still holding"
    if ended == UNKNOWN:
        return "no release seen; its end cannot be told from here"
    return ""


def _still_running(found) -> str:
    """'; its command's process group 41 still runs (pid 42 (curl ...)): the lane is not free
    until it is empty'."""
    if not isinstance(found, dict):
        return ""
    from ..holder import group_words

    pids = [pid for pid in found.get("pids") or () if isinstance(pid, int)]
    if found.get("pgid") is None:
        return (f"; its command (pid {found.get('pid')}) still runs: the lane is not free until "
                "it ends")
    return (f"; its command's process group {found['pgid']} still runs ({group_words(pids)}): "
            "the lane is not free until it is empty")


def _number(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if value != value or abs(value) > 1e12:
        return None
    return float(value)
