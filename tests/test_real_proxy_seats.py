"""Real tier (pytest -m real): `lanelock proxy` on a lane of two seats in front of a real
llama-server --parallel 2 -- two requests generate at once, and with --pin-slots each seat's
requests are served on its own slot (llama-server's answer names the slot that served it)."""

from __future__ import annotations

import json

import pytest

from support.proxy import Proxy, open_stream, read_until, request
from support.real_backend import two_slots  # noqa: F401 - a fixture

pytestmark = pytest.mark.real
SEAT = "X-Lanelock-Seat"


def test_two_seats_generate_at_once_on_a_real_engine(two_slots, procs, lanelock):
    backend = two_slots.removeprefix("http://")
    assert lanelock("seats", "-b", backend, "2").returncode == 0
    proxy = Proxy(procs, backend)
    body = json.dumps({"stream": True, "max_tokens": 400, "messages": [
        {"role": "user", "content": "Count from one to two hundred, one number a line."}]}).encode()
    streams = [open_stream(proxy.port, body, {"X-Lanelock-Session": session})
               for session in ("one", "two")]
    heads = [read_until(sock, b"data:") for sock in streams]
    with_seats = sorted(line.split(b":")[1].strip() for head in heads
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"x-lanelock-seat"))
    assert with_seats == [b"1", b"2"]
    slots = json.loads(request(int(backend.rpartition(":")[2]), "GET", "/slots")[2])
    assert [slot["is_processing"] for slot in slots] == [True, True]
    for sock in streams:
        sock.close()


def test_pin_slots_serves_each_seat_on_its_slot_of_a_real_engine(two_slots, procs, lanelock):
    backend = two_slots.removeprefix("http://")
    assert lanelock("seats", "-b", backend, "2").returncode == 0
    proxy = Proxy(procs, backend, "--pin-slots", "-v")
    served = []
    for session in ("one", "two", "one", "two", "one"):
        before = proxy.log().count(f"[{session}] POST")
        status, headers, body = request(
            proxy.port, "POST", "/completion",
            json.dumps({"prompt": f"Session {session} says hello.", "n_predict": 4}).encode(),
            headers={"X-Lanelock-Session": session})
        assert status == 200, body
        served.append((session, int(headers[SEAT]), json.loads(body)["id_slot"]))
        proxy.until(lambda log: log.count(f"[{session}] POST") > before, "the -v line")
    assert all(slot == seat - 1 for _, seat, slot in served), served
    assert len({seat for session, seat, _ in served if session == "one"}) == 1, served
    assert {seat for _, seat, _ in served} == {1, 2}, served
