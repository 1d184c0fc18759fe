"""A TCP relay on loopback in front of a server: one client's link that a test can cut, reset or
freeze while the server stays up for every other client (who connect to it directly).

- cut():    both sides of every relayed connection closed in order (FIN); new ones closed at once;
- reset():  both sides aborted (RST: SO_LINGER 0); new ones aborted at once;
- freeze(): nothing forwarded either way and nothing closed: each side's kernel still
            acknowledges what it is sent (the server's keepalives are answered, as a stuck
            middlebox's are); new connections are accepted and left silent;
            freeze(port): that one connection alone, the one the server sees from that port
            (pg_stat_activity.client_port), the others go on;
- restore(): forwarding again, for frozen connections and new ones.

One thread, one selector, a wake-up socketpair for the test's orders: no polling.
"""

from __future__ import annotations

import selectors
import socket
import struct
import threading

OPEN, CUT, RESET, FROZEN = "open", "cut", "reset", "frozen"


class Relay:
    def __init__(self, target_port: int, target_host: str = "127.0.0.1",
                 listen: str = "127.0.0.1"):
        self.target = (target_host, target_port)
        self.listen = listen   # another address of this host: a network namespace's way in
        self.listener = socket.create_server((listen, 0))
        self.port = self.listener.getsockname()[1]
        self.mode = OPEN
        self.pairs: dict[socket.socket, socket.socket] = {}   # each side -> the other
        self.accepted = 0
        self._lock = threading.Lock()
        self._orders: list = []
        self._wake_read, self._wake_write = socket.socketpair()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self.listener, selectors.EVENT_READ, "accept")
        self._selector.register(self._wake_read, selectors.EVENT_READ, "wake")
        self._done = threading.Event()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="relay", daemon=True)
        self._thread.start()

    def dsn(self, user: str = "postgres", db: str = "postgres") -> str:
        return f"postgresql://{user}@{self.listen}:{self.port}/{db}"

    # -- the test's orders (each applied by the relay's thread before it returns) ----------------
    def cut(self) -> None:
        self._order(CUT)

    def reset(self) -> None:
        self._order(RESET)

    def freeze(self, port: int | None = None) -> None:
        self._order(FROZEN if port is None else (FROZEN, port))

    def restore(self) -> None:
        self._order(OPEN)

    def close(self) -> None:
        if self._closing:
            return
        self._order(RESET)
        self._closing = True
        self._wake_write.send(b"x")
        self._thread.join(timeout=10)
        self.listener.close()
        self._wake_write.close()

    def _order(self, mode: str) -> None:
        done = threading.Event()
        with self._lock:
            self._orders.append((mode, done))
        self._wake_write.send(b"x")
        if not done.wait(timeout=10):
            raise RuntimeError("the relay did not take its order")

    # -- the relay's thread ----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._closing:
                for key, _ in self._selector.select():
                    if key.data == "wake":
                        self._wake_read.recv(4096)
                        self._take_orders()
                    elif key.data == "accept":
                        self._accept()
                    elif key.fileobj in self.pairs:
                        self._pump(key.fileobj)
        finally:
            for sock in list(self.pairs):
                _abort(sock)
            self._selector.close()
            self._wake_read.close()

    def _take_orders(self) -> None:
        with self._lock:
            orders, self._orders = self._orders, []
        for mode, done in orders:
            if isinstance(mode, tuple):   # one connection, by the server's view of its port
                self._freeze_one(mode[1])
                done.set()
                continue
            self.mode = mode
            if mode in (CUT, RESET):
                for sock in list(self.pairs):
                    self._drop(sock, abort=mode == RESET)
            watched = mode != FROZEN
            for sock in self.pairs:
                self._watch(sock, watched)
            done.set()

    def _freeze_one(self, port: int) -> None:
        for sock, other in list(self.pairs.items()):
            try:   # the upstream side: its own port is the one the server sees
                ours = sock.getsockname()[1] == port and sock.getpeername()[1] == self.target[1]
            except OSError:
                continue
            if ours:
                self._watch(sock, False)
                self._watch(other, False)

    def _accept(self) -> None:
        try:
            client, _ = self.listener.accept()
        except OSError:
            return
        self.accepted += 1
        if self.mode == RESET:
            _abort(client)
            return
        if self.mode == CUT:
            client.close()
            return
        try:
            upstream = socket.create_connection(self.target, timeout=5)
        except OSError:
            _abort(client)
            return
        for sock in (client, upstream):
            sock.setblocking(False)
        self.pairs[client], self.pairs[upstream] = upstream, client
        for sock in (client, upstream):
            self._watch(sock, self.mode != FROZEN)

    def _watch(self, sock: socket.socket, watched: bool) -> None:
        registered = sock in self._selector.get_map()
        if watched and not registered:
            self._selector.register(sock, selectors.EVENT_READ, "pump")
        elif not watched and registered:
            self._selector.unregister(sock)

    def _pump(self, sock: socket.socket) -> None:
        other = self.pairs[sock]
        try:
            data = sock.recv(65536)
        except OSError:
            data = b""
        if not data:
            self._drop(sock, abort=False)
            return
        try:
            other.setblocking(True)
            other.sendall(data)
            other.setblocking(False)
        except OSError:
            self._drop(sock, abort=True)

    def _drop(self, sock: socket.socket, abort: bool) -> None:
        other = self.pairs.pop(sock, None)
        for each in (sock, other):
            if each is None:
                continue
            self.pairs.pop(each, None)
            try:
                self._selector.unregister(each)
            except (KeyError, ValueError):
                pass
            if abort:
                _abort(each)
            else:
                try:
                    each.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                each.close()


def _abort(sock: socket.socket) -> None:
    """Close with an RST, not a FIN."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()
