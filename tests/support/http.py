"""Raw HTTP over a socket: an answer read to its end and parsed, and requests sent at once that
wait for their answers in threads."""

from __future__ import annotations

import socket

from support.cli import TIMEOUT


def read_all(sock, seen: bytes = b"") -> bytes:
    """Everything a socket sends until it closes (EOF or a reset), after what was seen."""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return seen
        if not chunk:
            return seen
        seen += chunk


def answer(data: bytes) -> tuple[int, dict, bytes]:
    """An HTTP/1.1 answer's bytes as (status, lower-case headers, body)."""
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(lines[0].split()[1]), headers, body


def send_waiting(port: int, count: int, request: bytes, timeout: float):
    """count copies of request, each on a connection of its own in a thread, returned once every
    one is sent: (results, threads). results fills with (status, headers) -- or (repr(error),
    {}) -- as the answers end; join the threads to have them all."""
    import threading

    results, sent = [], threading.Semaphore(0)

    def ask():
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
                sock.sendall(request)
                sent.release()
                data = read_all(sock)
            results.append(answer(data)[:2])
        except OSError as error:
            sent.release()
            results.append((repr(error), {}))

    threads = [threading.Thread(target=ask) for _ in range(count)]
    for thread in threads:
        thread.start()
    for _ in threads:
        assert sent.acquire(timeout=TIMEOUT)
    return results, threads
