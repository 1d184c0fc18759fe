"""A lane of several seats, as status and a deflection say it: each seat judged alone (judge.py,
the same words as a one-seat lane's), then the lane in one verdict.

The lane is held while any seat is; a turn is sent away only when every seat is (or a seat is
free but the queue's first gets it: no barging). Seats past the count still held (a count made
smaller under its holders) are said as held seats: they keep the lane from new turns.
"""

from __future__ import annotations

from ..holder import seat_count_words as count_words

HELD = "held"   # judge.HELD: this module is judge's leaf, never the other way round


def combine(first: dict, others: list[dict], facts) -> dict:
    """The lane's status from seat 1's (first, judged with the lane's gate problem, its queue
    and waiters) and the other seats' (facts.other_seats, in order). Seat 1's result is the
    base: a lane whose lock path is unusable is said as a one-seat lane is."""
    results = [first, *others]
    numbers = [1, *(seat.seat for seat in facts.other_seats)]
    by_seat = [_seat_row(number, result) for number, result in zip(numbers, results)]
    held = [row for row in by_seat if row["state"] == HELD]
    lane = dict(first)
    lane.update(seats=facts.seats, held_seats=len(held), by_seat=by_seat)
    lane["holders"] = _each_with_seat(numbers, results, "holders")
    lane["waiters"] = _unique(_each_with_seat(numbers, results, "waiters"))
    if held:
        free = max(facts.seats - len(held), 0)
        said = count_words(len(held), facts.seats) + " held"
        if free:
            said += f" ({free} free)"
        elif len(held) > facts.seats:
            said += " (the count was made smaller: new turns wait until fewer hold)"
        lane.update(state=HELD, verdict=held[0]["verdict"],
                    holder={**held[0]["holder"], "seat": held[0]["seat"]}
                    if held[0]["holder"] else None,
                    message=said + ": " + "; ".join(f"seat {row['seat']} {row['message']}"
                                                    for row in held))
        return lane
    if first["state"] != "free":   # the lane's own lock cannot be used or read: that first
        return lane
    # Nobody holds a seat: the lane is free, and each seat says its last turn.
    told = next((row for row in by_seat if row["verdict"] != "never-used"), by_seat[0])
    lane.update(verdict=told["verdict"], last=told["last"],
                message=f"free, all {facts.seats} seats: " + "; ".join(
                    f"seat {row['seat']} {_unfree(row['message'])}" for row in by_seat))
    return lane


def seated_holder(facts, judge_seat, seat_holder, next_in_queue) -> dict:
    """Who keeps a turn off a lane of several seats: every seat's holder while all are held
    ({first's facts, "seat", "seats", "holders": [each with its "seat"]}); a free seat the
    queue's first gets: that waiter."""
    seated = [facts, *facts.other_seats]
    judged = [(seat, judge_seat(seat)) for seat in seated]
    held = [(seat, result) for seat, result in judged if result["state"] == HELD]
    if len(held) < facts.seats:
        waiting = next_in_queue(facts)
        if waiting is not None:
            return waiting
    if not held:
        return seat_holder(facts, judged[0][1])
    holders = [{**seat_holder(seat, result), "seat": seat.seat} for seat, result in held]
    return {**holders[0], "seats": facts.seats, "holders": holders}


def _seat_row(number: int, result: dict) -> dict:
    holder = result["holder"]
    return {"seat": number, "lock_path": result["lock_path"],
            "sidecar_path": result["sidecar_path"], "state": result["state"],
            "verdict": result["verdict"], "message": result["message"],
            "holder": None if holder is None else {**holder, "seat": number},
            "last": result["last"], "holders": result["holders"]}


def _each_with_seat(numbers: list, results: list, key: str) -> list:
    return [{**process, "seat": number} for number, result in zip(numbers, results)
            for process in result[key] or ()]


def _unique(processes: list) -> list:
    """The head of the queue waits on every seat at once: one row for it (its first seat)."""
    seen, kept = set(), []
    for process in processes:
        if process.get("pid") not in seen:
            seen.add(process.get("pid"))
            kept.append(process)
    return kept


def _unfree(message: str) -> str:
    """A free seat's message without its 'free; ' (the lane's line says free once)."""
    return message[len("free; "):] if message.startswith("free; ") else message
