"""What `lanelock proxy` tells people: how a turn it relayed ended (a client that hung
up, an engine that cut the answer: never "released cleanly"), the Anthropic busy answer's status
line, and a URL fallback that cannot be reached -- in lanelock's words, once per incident.

Real processes as in test_proxy.py (its stand-in engine, proxy and raw clients).
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys

import pytest

from support.cli import TIMEOUT
from support.http import read_all
from support.processes import read_line, wait_for
from support.engine import Engine
from support.ports import free_port
from support.proxy import (CHAT, Proxy, chat_body, history, open_stream, read_until, request,
                           unstamped)

pytest.importorskip("aiohttp")


def released(lanelock, backend) -> dict:
    """The lane's one `released` event, once it is written."""
    found = wait_for(lambda: [event for event in history(lanelock, backend)
                              if event["event"] == "released"] or None, "the turn's release")
    (event,) = found
    return event


@pytest.mark.parametrize("cut_by", ["client", "engine"])
def test_a_proxy_turn_cut_short_is_never_a_clean_release(procs, lanelock, cut_by):
    engine = Engine(procs, tokens=200, interval=0.05)   # 10 s if nothing cut it
    proxy = Proxy(procs, engine.backend)
    sock = open_stream(proxy.port)
    read_until(sock, b"data: ")
    if cut_by == "client":
        sock.close()
    else:
        engine.proc.kill()
        read_all(sock)
        sock.close()
    event = released(lanelock, engine.backend)
    words = {"client": "the client hung up mid-answer", "engine": "the engine cut the answer"}
    assert (event["exit_status"], event["ended"]) == (200, words[cut_by])
    status = lanelock("status", "-b", engine.backend).stdout
    assert "cleanly" not in status and f"after {words[cut_by]} (HTTP 200, held " in status, status
    shown = lanelock("history", "-b", engine.backend).stdout
    assert f"HTTP 200; not a clean release: {words[cut_by]}" in shown, shown


def test_a_whole_answer_is_a_clean_release_in_http_words(procs, lanelock):
    engine = Engine(procs, delay=0.01)
    proxy = Proxy(procs, engine.backend)
    assert request(proxy.port, "POST", CHAT, chat_body())[0] == 200
    event = released(lanelock, engine.backend)
    assert event["exit_status"] == 200 and "ended" not in event
    status = lanelock("status", "-b", engine.backend).stdout
    assert "released cleanly at " in status and "(HTTP 200, held " in status, status


def test_the_anthropic_busy_answer_has_a_reason_phrase(procs, lanelock, holder):
    """aiohttp knows no phrase for 529: the status line ended in an empty one."""
    engine = Engine(procs, delay=0.01)
    holder("-b", engine.backend)
    proxy = Proxy(procs, engine.backend, "--no-witness")
    body = chat_body()
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=TIMEOUT) as sock:
        sock.sendall(f"POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                     f"application/json\r\nContent-Length: {len(body)}\r\nConnection: close"
                     "\r\n\r\n".encode() + body)
        head = read_all(sock).partition(b"\r\n")[0]
    assert head == b"HTTP/1.1 529 Overloaded", head


def test_an_unreachable_fallback_is_said_once_per_incident_in_lanelocks_words(procs, lanelock,
                                                                             holder):
    engine = Engine(procs, delay=0.01)
    gone = free_port()
    holder("-b", engine.backend)
    proxy = Proxy(procs, engine.backend, "--no-witness", "--fallback",
                  f"http://127.0.0.1:{gone}/v1")
    for attempt in range(3):
        status, _, body = request(proxy.port, "POST", CHAT, chat_body())
        assert status == 503
        assert f"fallback 1 http://127.0.0.1:{gone}/v1 failed: cannot connect to " \
               f"127.0.0.1:{gone}: connection refused" in body.decode()   # every client is told
    log = proxy.until(lambda text: text.count("still unreachable") == 2, "the third busy line")
    assert "ssl:default" not in log and "Cannot connect to host" not in log, log
    warnings = [unstamped(line) for line in log.splitlines() if "unreachable:" in line]
    assert warnings == [f"lanelock: warning: fallback 1 http://127.0.0.1:{gone}/v1 unreachable: "
                        f"cannot connect to 127.0.0.1:{gone}: connection refused; trying the "
                        "next (said once: every request still tries it, and a line says when "
                        "it answers again)"], log
    assert len(re.findall(r"every fallback failed", log)) == 3

    # the incident ends: something answers there (any answer, even an error, is one)
    server = procs.start([sys.executable, "-u", "-m", "http.server", "--bind", "127.0.0.1",
                          str(gone)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert "Serving HTTP" in read_line(server.stdout)
    assert request(proxy.port, "POST", CHAT, chat_body())[0] == 501   # its answer is relayed
    proxy.said(f"fallback 1 http://127.0.0.1:{gone}/v1 answers again (unreachable for ")
