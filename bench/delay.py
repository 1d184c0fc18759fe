#!/usr/bin/env python3
"""A TCP relay that delays: each byte it forwards, either way, waits half the round trip first.

    python bench/delay.py TARGET_PORT RTT_MS      (prints the port it listens on, loopback)

For the benchmarks' far server (bench/handoff.py --rtt): where the kernel has tc's netem (the
sch_netem module) a network namespace would do it in the kernel; this VM's kernel has none, so
the delay is kept here, in one process of its own (not a thread of the bench: the bench's own
work must not hold it up). One selector, one heap of what is due: each direction keeps its order,
a close is forwarded after the data before it, TCP_NODELAY both sides (no Nagle on top of the
delay).
"""

from __future__ import annotations

import heapq
import itertools
import selectors
import socket
import sys
import time


def serve(target_port: int, rtt_ms: float) -> None:
    half = rtt_ms / 2000.0
    listener = socket.create_server(("127.0.0.1", 0))
    print(listener.getsockname()[1], flush=True)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    other: dict[socket.socket, socket.socket] = {}
    due: list = []   # (when, order, to, data: b"" for a close)
    order = itertools.count()
    closes: dict = {}   # a pair -> how many of its two ways are closed
    while True:
        timeout = None if not due else max(0.0, due[0][0] - time.monotonic())
        for key, _ in selector.select(timeout):
            sock = key.fileobj
            if sock is listener:
                near, _ = listener.accept()
                try:
                    far = socket.create_connection(("127.0.0.1", target_port))
                except OSError:
                    near.close()
                    continue
                for end in (near, far):
                    end.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    selector.register(end, selectors.EVENT_READ)
                other[near], other[far] = far, near
                continue
            try:
                data = sock.recv(65536)
            except OSError:
                data = b""
            if not data:   # this side is done: the other hears it after what came before
                selector.unregister(sock)
            heapq.heappush(due, (time.monotonic() + half, next(order), other[sock], data))
        now = time.monotonic()
        while due and due[0][0] <= now:
            _, _, to, data = heapq.heappop(due)
            _forward(to, data, other, closes)


def _forward(to: socket.socket, data: bytes, other: dict, closes: dict) -> None:
    """data to `to`, or (b"") its peer's close: a shutdown; once both ways are closed, the pair
    goes."""
    if to.fileno() < 0:
        return
    try:
        if data:
            to.sendall(data)
            return
        to.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    peer = other[to]
    pair = frozenset((to, peer))
    closes[pair] = closes.get(pair, 0) + 1
    if closes[pair] == 2:
        del closes[pair]
        for end in (to, peer):
            other.pop(end, None)
            end.close()


if __name__ == "__main__":
    serve(int(sys.argv[1]), float(sys.argv[2]))
