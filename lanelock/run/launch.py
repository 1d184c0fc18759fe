"""What runs in the parked child (runner.Starter) until it becomes the command: wait for the go,
take the turn's environment, exec. Kept apart from runner.py, which is the wrapper's side.

The go message is b"G", the payload's length (4 bytes, big-endian), then the payload: NAME=VALUE
(set) or NAME (unset) entries, each ended by a NUL byte. The length lets the child exec as soon as
the message is in, without a second wake-up for the EOF. EOF without a message cancels the start.
"""

import os

GO = b"G"
NOT_FOUND = 127   # exitcodes.NOT_FOUND: the parked child's status when it could not exec
EINVAL = 22


# What Python's start-up writes into its own LC_CTYPE when it coerces a C locale (PEP 538).
_COERCED = frozenset({b"C.UTF-8", b"C.utf8", b"UTF-8"})


def command_environ() -> dict:
    """Our environment for the command, less what lanelock's interpreter did to itself: a Python
    started in the C locale (a cron job's) sets LC_CTYPE=C.UTF-8 in its own environment, and
    the command must not inherit that. The start-up value is read back from /proc/self/environ,
    and only then: everything else in os.environ (a caller's own changes too) goes through."""
    env = dict(os.environb)
    value = env.get(b"LC_CTYPE")
    if value in _COERCED:
        initial = _start_environ()
        if initial is not None and initial.get(b"LC_CTYPE") != value:
            if b"LC_CTYPE" in initial:
                env[b"LC_CTYPE"] = initial[b"LC_CTYPE"]
            else:
                del env[b"LC_CTYPE"]
    return env


def _start_environ() -> dict | None:
    try:
        with open("/proc/self/environ", "rb") as handle:
            raw = handle.read()
    except OSError:
        return None
    env: dict = {}
    for entry in raw.split(b"\0"):
        name, equals, value = entry.partition(b"=")
        if equals and name and name not in env:   # the first of duplicates, as os.environ does
            env[name] = value
    return env


def wait_and_exec(go_read: int, status_write: int, path: str, argv: list, env: dict) -> None:
    """Never returns: execs the command, exits 0 when cancelled, or writes the errno that stopped
    the exec to status_write and exits 127."""
    code = 0
    try:
        message = b""
        while len(message) < 5 or len(message) < 5 + int.from_bytes(message[1:5], "big"):
            chunk = os.read(go_read, 65536)
            if not chunk:
                os._exit(0)   # cancelled (the turn deflected), or the wrapper is gone
            message += chunk
        for item in message[5:].split(b"\0")[:-1]:
            name, equals, value = item.partition(b"=")
            if equals:
                env[name] = value
            else:
                env.pop(name, None)
        os.execve(path, argv, env)
    except OSError as error:
        code = error.errno or EINVAL
    except BaseException:   # noqa: BLE001 - whatever it was, the wrapper must hear of it
        code = EINVAL
    try:
        os.write(status_write, str(code).encode())
    finally:
        os._exit(NOT_FOUND)
