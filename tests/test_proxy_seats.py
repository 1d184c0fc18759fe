"""`lanelock proxy` on a lane of seats (`lanelock seats -b B 2`): up to N requests generate at once,
each its own turn on its own seat; the (N+1)th is busy, or waits for the first seat freed. With
--pin-slots a llama.cpp engine is sent `id_slot` = the seat - 1 in each gated request that names
none, so a seat is the engine's slot and a returning session finds its own.

Real processes: the stand-in engine with two slots (its GET /slots and /stats are the engine's
account of what it computes and which id_slot each request named), the proxy, the CLI.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading

import pytest

from support.cli import TIMEOUT
from support.processes import wait_for
from support.proxy import CHAT, Proxy, chat_body, history, open_stream, read_until, request
from support.standin_kind import Served

pytest.importorskip("aiohttp")
SEAT = "X-Lanelock-Seat"


def two_seats(procs, tmp_path, lanelock, *engine_args):
    """A llama.cpp stand-in with two slots whose lane has two seats; streams of 40 tokens 0.1 s
    apart (4 s: long enough to be seen generating, short enough to be hung up on)."""
    engine = Served(procs, tmp_path, "--kind", "llama.cpp", "--parallel", "2", "--tokens", "40",
                    "--token-interval", "0.1", *engine_args)
    done = lanelock("seats", "-b", engine.backend, "2")
    assert done.returncode == 0, done.stderr
    return engine


def ask(port, session, stream=False, **fields):
    return request(port, "POST", CHAT, chat_body(stream=stream, **fields),
                   headers={"X-Lanelock-Session": session})


def ask_done(proxy, session, **fields):
    """ask(), returning once the proxy is through with the request (its -v line, written after
    the turn was released or kept): the client has its answer a moment before that."""
    before = proxy.log().count(f"[{session}] POST")
    answered = ask(proxy.port, session, **fields)
    proxy.until(lambda log: log.count(f"[{session}] POST") > before, f"{session}'s -v line")
    return answered


def streaming(port, session, **fields) -> tuple[socket.socket, bytes]:
    """A streaming request of session, read up to its first event: it holds a seat now."""
    sock = open_stream(port, chat_body(stream=True, **fields),
                       headers={"X-Lanelock-Session": session})
    head = read_until(sock, b"data:")
    assert b" 200 " in head.split(b"\r\n", 1)[0], head
    return sock, head


def header(head: bytes, name: str) -> str | None:
    for line in head.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        key, _, value = line.decode().partition(":")
        if key.strip().lower() == name.lower():
            return value.strip()
    return None


def asked_slots(engine) -> list:
    """The id_slot each generation's request named (None: none), oldest first."""
    return [generation["id_slot"] for generation in engine.stats()["generations"]]


def test_two_seats_forward_two_streams_at_once_and_the_third_is_busy(procs, tmp_path, lanelock):
    engine = two_seats(procs, tmp_path, lanelock)
    proxy = Proxy(procs, engine.backend, "-v")
    first, head1 = streaming(proxy.port, "one")
    second, head2 = streaming(proxy.port, "two")
    # The engine's own account: both generate at once, each on a slot of its own.
    assert [slot["is_processing"] for slot in engine.get("/slots")] == [True, True]
    assert sorted([header(head1, SEAT), header(head2, SEAT)]) == ["1", "2"]
    status, headers, body = ask(proxy.port, "three")
    assert status == 503
    assert headers["X-Lanelock-State"] == "busy"
    assert headers[SEAT] is None
    message = json.loads(body)["error"]["message"]
    assert "2 of 2 seats: " in message, message   # both holders named
    assert "session one" in message and "session two" in message, message
    # The proxy's own views of the lane: both seats held.
    lane = json.loads(request(proxy.port, "GET", "/lanelock/status")[2])["lanes"][0]
    assert (lane["seats"], lane["held_seats"]) == (2, 2), lane
    metrics = request(proxy.port, "GET", "/metrics")[2].decode()
    assert f'lanelock_lane_held_seats{{lane="localhost:{engine.port}"}} 2.0' in metrics
    first.close()
    second.close()
    assert engine.stats()["max_in_flight"] == 2
    # The journal: each turn on its seat, both of the lane's two.
    proxy.until(lambda log: "[one] POST" in log and "[two] POST" in log, "both streams' ends")
    seated = {(event["session"], event.get("seat"), event.get("seats"))
              for event in history(lanelock, engine.backend) if event["event"] == "acquired"}
    assert seated == {("one", int(header(head1, SEAT)), 2), ("two", int(header(head2, SEAT)), 2)}


def queued(lock_dir, engine) -> int:
    """Turns waiting in the lane's queue (a file each in STEM.queue/ while it waits)."""
    try:
        return len(os.listdir(lock_dir / f"localhost-{engine.port}.queue"))
    except FileNotFoundError:
        return 0


def test_with_wait_the_freed_seats_go_in_class_order(procs, tmp_path, lanelock, lock_dir):
    engine = two_seats(procs, tmp_path, lanelock)
    proxy = Proxy(procs, engine.backend, "--wait", "30")
    first, _ = streaming(proxy.port, "one")
    second, _ = streaming(proxy.port, "two")
    answered = []

    def waiter(session, priority):
        status, headers, _ = request(proxy.port, "POST", CHAT, chat_body(), headers={
            "X-Lanelock-Session": session, "X-Lanelock-Priority": priority})
        answered.append((session, status, headers["X-Lanelock-State"], headers[SEAT]))

    threads = []
    for count, (session, priority) in enumerate((("batch", "batch"),
                                                 ("chat", "interactive")), 1):
        threads.append(threading.Thread(target=waiter, args=(session, priority)))
        threads[-1].start()
        wait_for(lambda: queued(lock_dir, engine) == count, "the request queued")
    # Two generating while two wait: never a third. Not counted across the hang-up below: its
    # seat frees as the proxy closes the engine connection, and the engine stops at its next
    # token (docs/proxy.md), when the chat request may have reached it already.
    assert engine.stats()["max_in_flight"] == 2
    second.close()   # one seat freed: the interactive request's, though it came second; the
    # batch one takes it after (the chat's answer is back before its seat is free again)
    for thread in threads:
        thread.join(TIMEOUT)
    assert answered == [("chat", 200, "held", answered[0][3]), ("batch", 200, "held",
                                                                answered[1][3])]
    assert {answered[0][3], answered[1][3]} <= {"1", "2"}
    first.close()


def test_lingering_turns_of_two_sessions_keep_a_seat_each(procs, tmp_path, lanelock):
    engine = two_seats(procs, tmp_path, lanelock)
    proxy = Proxy(procs, engine.backend, "--linger", "30", "-v")
    seats = {}
    for session in ("one", "two"):
        status, headers, _ = ask_done(proxy, session)
        assert (status, headers["X-Lanelock-State"]) == (200, "held")
        seats[session] = headers[SEAT]
    assert sorted(seats.values()) == ["1", "2"]
    # Both linger, each on its seat: each session comes back to its own turn.
    for session in ("one", "two", "one"):
        status, headers, _ = ask_done(proxy, session)
        assert (status, headers["X-Lanelock-State"], headers[SEAT]) == \
            (200, "held", seats[session])
    # A third session finds both seats kept for theirs.
    status, headers, _ = ask(proxy.port, "three")
    assert status == 503


def test_pin_slots_sends_each_seat_as_its_slot_and_a_session_gets_its_own_back(
        procs, tmp_path, lanelock):
    engine = two_seats(procs, tmp_path, lanelock)
    proxy = Proxy(procs, engine.backend, "--pin-slots", "-v")
    first, head1 = streaming(proxy.port, "one")
    second, head2 = streaming(proxy.port, "two")
    seat = {"one": int(header(head1, SEAT)), "two": int(header(head2, SEAT))}
    assert asked_slots(engine) == [seat["one"] - 1, seat["two"] - 1]
    assert sorted(seat.values()) == [1, 2]
    first.close()
    second.close()
    proxy.until(lambda log: "[one] POST" in log and "[two] POST" in log, "both streams' ends")
    # Each session back, one at a time: its own seat again, so its own slot (and its cache).
    for session in ("two", "one", "two"):
        status, headers, _ = ask_done(proxy, session)
        assert (status, headers[SEAT]) == (200, str(seat[session]))
        assert asked_slots(engine)[-1] == seat[session] - 1


def test_pin_slots_a_request_arriving_while_the_engine_is_asked_waits_for_the_answer(
        procs, tmp_path, lanelock):
    """The engine answers its account slowly; the second of two first requests comes while the
    proxy still asks which engine it is: it waits for that answer and is pinned to its seat's
    slot too (before: it went unpinned, taking any slot)."""
    engine = two_seats(procs, tmp_path, lanelock, "--slow", "0.3")
    proxy = Proxy(procs, engine.backend, "--pin-slots", "-v")
    before = engine.stats()["account_gets"]
    answers = []
    first = threading.Thread(target=lambda: answers.append(ask(proxy.port, "one")))
    first.start()
    wait_for(lambda: engine.stats()["account_gets"] > before, "the proxy asking the engine")
    second = ask(proxy.port, "two")
    first.join(TIMEOUT)
    assert [answer[0] for answer in (*answers, second)] == [200, 200]
    assert asked_slots(engine) in ([0, 1], [1, 0]), asked_slots(engine)


def test_pin_slots_leaves_a_request_naming_its_own_slot_alone(procs, tmp_path, lanelock):
    engine = two_seats(procs, tmp_path, lanelock)
    proxy = Proxy(procs, engine.backend, "--pin-slots", "-v")
    status, headers, _ = ask_done(proxy, "one", id_slot=1)
    assert (status, headers[SEAT]) == (200, "1")   # seat 1 would have been slot 0
    status, headers, _ = ask_done(proxy, "one")
    assert (status, headers[SEAT]) == (200, "1")
    assert asked_slots(engine) == [1, 0]


def test_pin_slots_is_off_by_default_and_touches_no_other_engine(procs, tmp_path, lanelock):
    engine = two_seats(procs, tmp_path, lanelock)
    proxy = Proxy(procs, engine.backend)
    assert ask(proxy.port, "one")[0] == 200
    vllm = Served(procs, tmp_path, "--kind", "vllm", "--parallel", "2")
    assert lanelock("seats", "-b", vllm.backend, "2").returncode == 0
    pinned = Proxy(procs, vllm.backend, "--pin-slots")
    assert ask(pinned.port, "one")[0] == 200
    assert asked_slots(engine) == [None]
    assert asked_slots(vllm) == [None]


def test_one_seat_says_seat_1_and_pins_slot_0(procs, tmp_path, lanelock):
    engine = Served(procs, tmp_path, "--kind", "llama.cpp", "--parallel", "2")
    proxy = Proxy(procs, engine.backend, "--pin-slots")
    status, headers, _ = ask(proxy.port, "one")
    assert (status, headers[SEAT]) == (200, "1")
    assert asked_slots(engine) == [0]


def test_pin_slots_leaves_a_seat_past_the_engines_slots_unpinned(procs, tmp_path, lanelock):
    """Three seats on an engine of two slots: llama-server would defer a request pinned to a
    slot it does not have for ever, so the third seat's goes unpinned, said once."""
    engine = two_seats(procs, tmp_path, lanelock)
    assert lanelock("seats", "-b", engine.backend, "3").returncode == 0
    proxy = Proxy(procs, engine.backend, "--pin-slots")
    streams = [streaming(proxy.port, session) for session in ("one", "two", "three")]
    seats = [int(header(head, SEAT)) for _, head in streams]
    assert sorted(seats) == [1, 2, 3]
    assert asked_slots(engine) == [seat - 1 if seat <= 2 else None for seat in seats]
    proxy.said("--pin-slots: seat 3 has no slot of its own")
    for sock, _ in streams:
        sock.close()


def test_the_readme_proxy_seats_block(procs, tmp_path, lanelock):
    """README's block, each line as written but for the backend (a stand-in llama.cpp of two
    slots in 8080's place: this machine's 8080 is nobody's to take) and where the proxy listens:
    two sessions at once on two seats, seat 1 sent as slot 0 and seat 2 as slot 1, as its comment
    says."""
    from support.doc_blocks import block

    engine = Served(procs, tmp_path, "--kind", "llama.cpp", "--parallel", "2", "--tokens", "40",
                    "--token-interval", "0.1")
    lines = [line.partition("#")[0].split() for line in block("proxy-seats").text.splitlines()]
    seats, proxy_line = [[word.replace("127.0.0.1:8080", engine.backend) for word in line]
                         for line in lines]
    assert seats[:2] == ["lanelock", "seats"] and proxy_line[:2] == ["lanelock", "proxy"]
    assert lanelock(*seats[1:]).returncode == 0
    proxy = Proxy(procs, *proxy_line[proxy_line.index("-b") + 1:],
                  *[word for word in proxy_line[2:proxy_line.index("-b")]])
    streams = [streaming(proxy.port, session) for session in ("one", "two")]
    seat = [int(header(head, SEAT)) for _, head in streams]
    assert [slot - 1 for slot in seat] == asked_slots(engine)
    assert sorted(seat) == [1, 2]
    for sock, _ in streams:
        sock.close()


INSIDE = """
import json, sys, urllib.request
request = urllib.request.Request(sys.argv[1] + "/v1/chat/completions", data=json.dumps(
    {"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode(),
    headers={"Content-Type": "application/json"})
with urllib.request.urlopen(request, timeout=30) as answer:
    print(answer.headers["X-Lanelock-State"], answer.headers.get("X-Lanelock-Seat"))
"""


def test_a_request_from_inside_a_turn_is_part_of_it_while_a_seat_is_free(
        procs, tmp_path, lanelock):
    """A turn's command asking through the proxy while the lane's other seat is free: part of
    the turn (one turn in the journal), not a second turn on the free seat."""
    engine = two_seats(procs, tmp_path, lanelock)
    proxy = Proxy(procs, engine.backend)
    done = lanelock("run", "-b", engine.backend, "-s", "outer", "--",
                    sys.executable, "-c", INSIDE, proxy.url)
    assert (done.returncode, done.stdout) == (0, "held 1\n"), done.stderr   # its turn's seat
    assert [(event["event"], event["session"]) for event in history(lanelock, engine.backend)] \
        == [("acquired", "outer"), ("released", "outer")]


def test_pin_slots_sends_a_request_inside_a_turn_its_turns_slot(procs, tmp_path, lanelock, holder):
    """A run turn on seat 2 (seat 1 is another's) whose command asks through the proxy: the
    request is part of that turn, says its seat, and is pinned to that seat's slot."""
    engine = two_seats(procs, tmp_path, lanelock)
    proxy = Proxy(procs, engine.backend, "--pin-slots")
    other = holder("-b", engine.backend, "-s", "other")
    done = lanelock("run", "-b", engine.backend, "-s", "outer", "--",
                    sys.executable, "-c", INSIDE, proxy.url)
    assert (done.returncode, done.stdout) == (0, "held 2\n"), done.stderr
    assert asked_slots(engine) == [1]
    assert other.release() == 0


def test_pin_slots_through_llama_swap_reaches_its_llama_server(procs, tmp_path, lanelock):
    """llama-swap hands the body to the model's llama-server: pinned as llama.cpp is, on its
    own paths and under /upstream/MODEL/."""
    engine = Served(procs, tmp_path, "--kind", "llama-swap", "--parallel", "2")
    assert lanelock("seats", "-b", engine.backend, "2").returncode == 0
    proxy = Proxy(procs, engine.backend, "--pin-slots", "-v")
    for path in (CHAT, "/upstream/stand-in/v1/chat/completions"):
        before = proxy.log().count("[one] POST")
        status, headers, _ = request(proxy.port, "POST", path, chat_body(),
                                     headers={"X-Lanelock-Session": "one"})
        assert (status, headers[SEAT]) == (200, "1")
        proxy.until(lambda log: log.count("[one] POST") > before, "the -v line")
    assert asked_slots(engine) == [0, 0]
    assert engine.stats()["loads"] == []


def test_pin_slots_from_a_config_file_and_no_pin_slots_over_it(procs, tmp_path, lanelock,
                                                              config_files):
    engine = two_seats(procs, tmp_path, lanelock)
    _, user = config_files
    user.write_text("proxy_pin_slots = true\n")
    for flags, slot in (((), 0), (("--no-pin-slots",), None)):
        proxy = Proxy(procs, engine.backend, "-v", *flags)
        status, headers, _ = ask_done(proxy, "one")
        assert (status, headers[SEAT]) == (200, "1")
        assert asked_slots(engine)[-1] == slot
        assert proxy.stop() == 0


def test_a_session_asking_again_on_its_answers_last_event_gets_its_seat_back(
        procs, tmp_path, lanelock):
    """The next request sent the moment the answer's terminal event arrives (as an agent's
    loop does) finds the session's seat free again: the answer's end is not the client's before
    its turn has let the seat go."""
    engine = Served(procs, tmp_path, "--kind", "llama.cpp", "--parallel", "2", "--tokens", "3",
                    "--token-interval", "0.01", "--delay", "0.01")
    assert lanelock("seats", "-b", engine.backend, "2").returncode == 0
    proxy = Proxy(procs, engine.backend)
    seats = []
    for _ in range(50):
        sock, head = streaming(proxy.port, "one")
        seats.append(header(head, SEAT))
        read_until(sock, b"[DONE]", head)
        sock.close()
    for _ in range(50):   # answers of a Content-Length: the next request once the body is read
        status, headers, _ = ask(proxy.port, "one")
        seats.append(headers[SEAT])
    assert seats == ["1"] * 100
