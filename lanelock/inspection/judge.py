"""The one status engine: a store's LaneFacts in, a verdict and a plain-words sentence out.

The lock's own truth (the kernel's /proc/locks, or the server's pg_locks) says whether the lane is
held and by whom; the holder record only labels that holder, and only when it agrees with it. Every
store's facts go through here, so `status` says the same thing in the same words whatever the store.

Verdicts (documented under `status --json` in docs/json.md):
  held, held-foreign, held-unlabelled, lock-file-replaced, ending   -- state "held"
  released, died, releasing, sidecar-stale, sidecar-bad, never-used, collision   -- state "free"
  bad-lock-file, gate-unavailable, error   -- state "unknown"

Beside the verdict, whether a turn could take the lane's gate at all (store/availability.py):
"gate" is "available" or "unavailable" (then "gate_problem" says why). A lane nobody holds whose
gate cannot be taken is not "free": turns there run ungated, and the verdict says so.
"""

from __future__ import annotations

import time

from .. import holder as holder_facts
from ..facts import boot_id, hostname, parse_utc, shown_time
from ..holder import field

FUTURE_SLACK = 300.0   # seconds a record's clock may run ahead before it counts as "from the future"

HELD, FREE, UNKNOWN = "held", "free", "unknown"


def judge(facts, gate_problem: str | None = None) -> dict:
    """The status of one lane (the `status --json` lane object). gate_problem: why a turn could
    not take the lane's gate (store/availability.py), None when it could. A lane of several
    seats (facts.other_seats) is held while any seat is: each seat is judged alone, as a
    one-seat lane is, and the lane says them all (seats.py: "seats", "held_seats", "by_seat")."""
    result = _judge_seat(facts, gate_problem)
    if not facts.other_seats:
        result.update(seats=facts.seats, held_seats=1 if result["state"] == HELD else 0,
                      by_seat=[])
        return result
    from .seats import combine

    return combine(result, [_judge_seat(seat) for seat in facts.other_seats], facts)


def _judge_seat(facts, gate_problem: str | None = None) -> dict:
    """The status of one lock and its record: a one-seat lane's, or one seat of a lane."""
    result = {"lane": facts.lane, "lock_path": facts.lock_path, "sidecar_path": facts.sidecar_path,
              "exists": facts.exists, "state": FREE, "verdict": "never-used", "message": "",
              "holders": facts.holders, "waiters": facts.waiters, "queue": facts.queue,
              "kernel_source": facts.kernel_source, "holder": None, "last": None,
              "sidecar_problem": facts.record_problem,
              "gate": "unavailable" if gate_problem else "available", "gate_problem": gate_problem}
    if facts.problem_lock and facts.seat > 1:
        # A seat's file or folder planted or changed by another user: no turn takes the seat
        # (it counts as held), none runs beside one too many; the others are taken as ever.
        return _verdict(result, HELD, "bad-lock-file",
                        f"not usable: {facts.problem_lock}; turns wait for the other seats")
    if facts.problem_lock:
        return _verdict(result, UNKNOWN, "bad-lock-file",
                        f"{facts.problem_lock}: {planted_outcome(facts.problem_lock)}")
    if gate_problem and not facts.held:
        return _verdict(result, UNKNOWN, "gate-unavailable", f"gate unavailable: {gate_problem}")
    if facts.error:
        return _verdict(result, UNKNOWN, "error", facts.error)
    if not facts.exists:
        return _verdict(result, FREE, "never-used", "free; no turn has used this lane yet")
    record = facts.record
    released = record is not None and "released_at" in record
    if facts.replaced and record is not None:
        result["holder"] = holder_facts.from_record(record)
        return _verdict(result, HELD, "lock-file-replaced",
                        f"held by lanelock turn {_pid(record)} ({_who(record)}) {facts.replaced}; "
                        "new turns deflect until it ends")
    stale = _stale(facts) if record is not None else None
    if facts.held is None:
        return _verdict(result, UNKNOWN, "error",
                        "cannot tell: /proc/locks unreadable and the probe failed")
    if facts.ending is not None and not stale:
        return _ending(result, facts, record)
    if facts.held:
        return _held(result, facts, record, released, stale)
    if record is None:
        if facts.collision:
            return _verdict(result, FREE, "collision", f"free; {facts.record_problem}")
        problem = facts.record_problem or "no holder record"
        verdict = "never-used" if facts.record_absent else "sidecar-bad"
        return _verdict(result, FREE, verdict, f"free; {problem}")
    if stale:
        return _verdict(result, FREE, "sidecar-stale", f"free; sidecar is stale: {stale}")
    if field(record, "pid", int) is None:
        return _verdict(result, FREE, "sidecar-bad", "free; the sidecar names no usable pid")
    result["last"] = holder_facts.from_record(record)
    if released:
        ended = field(record, "ended", str)   # a turn cut short (the proxy's client hung up)
        how = f"released at {shown_time(record.get('released_at'))} after {ended[:200]}" \
            if ended else f"released cleanly at {shown_time(record.get('released_at'))}"
        return _verdict(result, FREE, "released",
                        f"free; last holder {_pid(record)} ({_who(record)}) {how} "
                        f"({holder_facts.exit_words(record)}, "
                        f"held {holder_facts.seconds(record.get('held_seconds'))})")
    if facts.alive:
        return _verdict(result, FREE, "releasing",
                        f"free; holder {_pid(record)} is alive and letting go (or lost the lock)")
    return _verdict(result, FREE, "died",
                    f"free; last holder {_pid(record)} ({_who(record)}) died without releasing; "
                    "the lock died with it")


def planted_outcome(problem: str) -> str:
    """What turns do on a lane whose lock path is unusable: a symlink is refused, never followed,
    and its turns fail open; anything else planted there (a FIFO, a directory, a 0600 file of
    another user) makes them deflect, so that no one can switch the gate off for everyone."""
    if "symlink" in problem:
        return "turns run without the gate (fail open) until it is removed"
    return "turns deflect until it is removed"


def holder(facts) -> dict:
    """Who holds the lane, for a deflection line and `probe`: the holder of the judge's verdict
    on the store's facts (the lock's own holder, labelled by the record only when the record
    agrees with it), so a deflection and `status` never disagree. On a lane of several seats,
    every seat's holder ("holders", each with its "seat"; "seats": the count) beside the
    first's own facts (holder.words says them all)."""
    if facts.other_seats and not facts.problem_lock:
        from .seats import seated_holder

        return seated_holder(facts, _judge_seat, seat_holder, next_in_queue)
    return seat_holder(facts, _judge_seat(facts))


def seat_holder(facts, result: dict) -> dict:
    """The holder of one lock (a one-seat lane, or one seat), from its judged result."""
    if facts.problem_lock:   # something planted at the lock's name: the reason is the holder
        return {**holder_facts.unlabelled(None, None, facts.problem_lock), "lanelock": True}
    found = result["holder"]
    if found is not None:
        if result["verdict"] == "lock-file-replaced":   # its lock is on an old inode
            return {**found, "held_for": None, "note": f"holds the lane {facts.replaced}"}
        return found
    if not facts.held:   # a free lane is busy only for its queue (no barging): name who is next
        waiting = next_in_queue(facts)
        if waiting is not None:
            return waiting
    first = facts.holders[0] if facts.holders else {}
    note = facts.record_problem or "the holder record does not match the holder"
    return holder_facts.unlabelled(first.get("pid"), first.get("command"), note,
                                   lanelock=facts.collision or bool(first.get("lanelock")))


def next_in_queue(facts) -> dict | None:
    """The first waiter of the lane's queue not stopped, as a holder: a free lane (or seat) is
    busy only for it (no barging) -- None when nobody waits."""
    waiting = next((row for row in facts.queue or () if not row.get("stopped")), None)
    if waiting is None:
        return None
    return {"pid": waiting.get("pid"), "host": waiting.get("host"),
            "session": waiting.get("session"), "model": None, "held_for": None,
            "lanelock": True, "command": None,
            "note": f"first in the queue ({waiting.get('class')}), waiting "
                    f"{holder_facts.seconds(waiting.get('waited') or 0)}: the lane is "
                    "free and goes to it next"}


def _ending(result: dict, facts, record: dict) -> dict:
    """A killed turn's command still runs: the gate waits for it as for a holder
    (store/outlived.py), whether the lock is free or held by the next turn waiting for it."""
    result["last"] = holder_facts.from_record(record)
    group, more = facts.ending_pgid, ""
    if group is None:
        note, when = "still ending", "it ends"
    else:   # the lane waits for the command's whole process group (the turn's tree)
        others = [pid for pid in facts.ending_pids if pid != facts.ending]
        when = f"its process group {group} is empty"
        note = f"still ending with its process group {group}"
        if others:
            more = (f", and {len(others)} more process{'es' if len(others) > 1 else ''} of its "
                    f"process group {group} still run{'' if len(others) > 1 else 's'} "
                    f"({holder_facts.group_words(others)})")
    result["holder"] = {**result["last"], "pid": facts.ending,
                        "note": f"the command of turn {_pid(record)}, killed; {note}"}
    then = f"the lane frees when {when}"
    if facts.held and facts.holders:
        then = f"pid {facts.holders[0]['pid']} takes the lane when {when}"
    return _verdict(result, HELD, "ending",
                    f"held by pid {facts.ending}, the command of lanelock turn {_pid(record)} "
                    f"({_who(record)}), which was killed{more}: {then}")


def _held(result: dict, facts, record, released: bool, stale: str | None) -> dict:
    if record is not None and not released and not stale and facts.matches:
        holder = result["holder"] = holder_facts.from_record(record)
        if holder["held_for"] is not None:
            how_long = f"for {holder_facts.seconds(holder['held_for'])}"
        else:
            how_long = f"since {shown_time(record.get('acquired_at'))}"
        message = f"held by lanelock turn {_pid(record)} ({_who(record)}), {how_long}"
        message += _lingering(record)
        if facts.stopped:
            holder["stopped"] = facts.stopped
            message += f"; {facts.stopped['words']}"
        ungated = field(record, "ungated_seconds", float)
        if ungated is not None:   # its session was lost to a store restart, the lane taken back
            holder["ungated_seconds"] = ungated
            message += f"; ungated {ungated:.1f}s while the lane store restarted"
        fence = field(record, "fence", int)
        if fence is not None:   # the store's generation of this turn (docs/hosts.md)
            holder["fence"] = fence
            message += f"; fence {fence}"
        message += _took_over(record, holder)
        if facts.bound and holder["host"]:
            message += f"; {facts.bound}"
        return _verdict(result, HELD, "held", message)
    why = facts.record_problem or stale or (
        "the sidecar describes an earlier turn" if record is not None else "no sidecar")
    if facts.holders:
        first = facts.holders[0]
        kind = "a lanelock turn" if first["lanelock"] else "a process that is not lanelock"
        return _verdict(result, HELD, "held-unlabelled" if first["lanelock"] else "held-foreign",
                        f"held by {kind}: pid {first['pid']} ({first['command']}); {why}")
    return _verdict(result, HELD, "held-unlabelled",
                    f"held (seen by a probe; /proc/locks unreadable); {why}")


def _took_over(record: dict, holder: dict) -> str:
    """'; took the lane from turn pid 42 on b (fence 6), which never released: it may still run'
    -- the turn before, whose session ended under it (lost, or killed)."""
    before = record.get("took_over")
    if not isinstance(before, dict):
        return ""
    holder["took_over"] = before
    pid, host = field(before, "pid", int), field(before, "hostname", str)
    fence = field(before, "fence", int)
    who = f"pid {pid if pid is not None else '?'}" + (f" on {host}" if host else "")
    return (f"; took the lane from turn {who}{f' (fence {fence})' if fence is not None else ''}, "
            "which never released: it may still run (history says the overlap)")


def _lingering(record: dict) -> str:
    """'; its command has ended, and the lane waits for the rest of its process group ...'"""
    from ..store.outlived import lingering

    command = lingering(record)
    if command is None:
        return ""
    return (f"; its command has ended, and the lane waits for the rest of its process group "
            f"{command.pgid} ({holder_facts.group_words(command.members)})")


def _stale(facts) -> str | None:
    """Why the record cannot describe the lane's current or last turn, or None."""
    record = facts.record
    lane = field(record, "lane", str)
    if lane and lane != facts.lane and not facts.lane.startswith("?"):
        return f"it is for another lane ({lane})"
    acquired = field(record, "acquired_at", str)
    when = parse_utc(acquired) if acquired else None
    if acquired and when is None:
        return f"its acquired_at {acquired[:40]!r} is not a time"
    if when is not None and when > time.time() + FUTURE_SLACK:
        return f"it claims a time in the future ({acquired[:40]})"
    here = record.get("hostname") in (None, hostname())
    record_boot = field(record, "boot_id", str)
    if here and record_boot and boot_id() and record_boot != boot_id():
        return "it is from a previous boot"
    if facts.store_stale:
        return facts.store_stale
    if facts.reused and "released_at" not in record:
        return f"pid {field(record, 'pid', int)} was reused by another process (start time differs)"
    return None


def _pid(record: dict) -> str:
    facts = holder_facts.from_record(record)
    return f"pid {facts['pid']}" + (f" on {facts['host']}" if facts["host"] else "")


def _who(record: dict) -> str:
    facts = holder_facts.from_record(record)
    parts = [f"session {facts['session']}"]
    if facts["model"]:
        parts.append(f"model {facts['model']}")
    if facts["command"]:
        parts.append(f"command {facts['command'][:120]}")
    return ", ".join(parts)


def _verdict(result: dict, state: str, verdict: str, message: str) -> dict:
    result.update(state=state, verdict=verdict, message=message)
    return result
