"""One connection for a long-lived process's short questions to the server.

A question that is not a turn's own -- who holds the lane (status, a busy request's hand-over
check), the lane's kept values (its seat count, its models), the witness's look, the lanes a
store knows -- used to open a short connection of its own each time. In a proxy every waiting
request asks at least once as it arrives: sixty requests at once were sixty connections, past a
server's max_connections (FATAL "sorry, too many clients already" for the others), however well
the waiting itself shares its host's connection (hostqueue.py).

So a process that serves many (the proxy: keep_open()) keeps one connection per server for
them, taken in turn under a lock (each question is a statement or two: a queue of them is
short); a broken one is dropped and the next question opens another. Any other process (run,
status) asks on a connection of its own, closed at once, as before: a waiting `run` keeps no
second connection for its whole command.
"""

from __future__ import annotations

import contextlib
import threading

_KEEP = False
_LOCK = threading.Lock()
_BY_DSN: dict[str, "_Shared"] = {}


class _Shared:
    def __init__(self):
        self.lock = threading.RLock()   # a question asked inside another's: the same connection
        self.conn = None
        self.problem = None   # ensure_schema's answer when it was opened


def keep_open() -> None:
    """From now on this process's short questions share one connection per server."""
    global _KEEP
    _KEEP = True


@contextlib.contextmanager
def asking(store, application_name: str, schema: bool = True):
    """(a connection for a short question, ensure_schema's problem or None): the process's
    shared one (under its lock) when keep_open() was called, else one of its own, closed
    afterwards (schema False: not ensured on it, a round trip saved where a missing table
    only fails the statement). connect()'s errors (ServerCrowded, GateUnavailable) pass
    through."""
    from .session import ensure_schema

    if not _KEEP:
        conn = store.connect(application_name)
        try:
            yield conn, ensure_schema(conn) if schema else None
        finally:
            conn.close()
        return
    with _LOCK:
        shared = _BY_DSN.setdefault(store.dsn, _Shared())
    with shared.lock:
        if shared.conn is None or shared.conn.closed:
            shared.conn = store.connect("lanelock host")
            shared.problem = ensure_schema(shared.conn)
        try:
            yield shared.conn, shared.problem
        finally:
            if shared.conn.broken:   # the next question connects again
                shared.conn.close()
                shared.conn = None
