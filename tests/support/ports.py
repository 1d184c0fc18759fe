"""A loopback port for a server a test starts, or for a lane name no server answers."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port nothing listens on (bound, then let go)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
