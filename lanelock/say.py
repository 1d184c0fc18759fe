"""lanelock's own lines on stderr -- notes, warnings, errors -- and nothing else writes them.

Every line is `lanelock: ...`, one printable line (labels from a sidecar may carry newlines or
escape sequences), written with one write(2) on fd 2 -- except a group's help when its command
is missing, which keeps its lines (usage_help). A closed or broken stderr is ignored: whether
lanelock could say something must never change what runs or the exit status.
"""

from __future__ import annotations

import os


def argv_text(argv: list, limit: int = 500) -> str:
    """A command as a person can paste it back (quoted as a shell would need), cut at limit."""
    import shlex

    text = shlex.join(str(word) for word in argv)
    return text if len(text) <= limit else text[:limit] + "…"


def sanitize(text: object, limit: int = 300) -> str:
    """One printable line of at most limit characters."""
    clean = "".join(ch if ch.isprintable() else "?" for ch in str(text))
    return clean if len(clean) <= limit else clean[:limit] + "…"


def line(message: str, limit: int = 2000, stamped: bool = False) -> None:
    """stamped: the time first, ISO 8601 with its zone (a service's log: stamp())."""
    _write(f"{stamp() + ' ' if stamped else ''}lanelock: {sanitize(message, limit)}\n")


def stamp() -> str:
    """Now, as a log line starts: 2026-05-01T14:02:03.123+02:00."""
    from datetime import datetime

    return datetime.now().astimezone().isoformat(timespec="milliseconds")


def journald_stamps() -> bool:
    """Is stderr the journal's stream, which stamps every line itself? systemd names the stream
    it connected in JOURNAL_STREAM=DEVICE:INODE (systemd.exec(5)); a child whose stderr goes
    elsewhere inherits the variable, so the stream is compared, not only the name."""
    device, sep, inode = os.environ.get("JOURNAL_STREAM", "").partition(":")
    if not (sep and device.isdigit() and inode.isdigit()):
        return False
    try:
        found = os.fstat(2)
    except OSError:
        return False
    return (found.st_dev, found.st_ino) == (int(device), int(inode))


def usage_help(text: str) -> None:
    """A group's help when its command is missing (bare `lanelock`, `lanelock config`): the one
    message kept on several lines, as --help prints it -- flattened into one line it read as a `?`
    for every newline. Each line is still made printable."""
    _write("".join(sanitize(row, 2000) + "\n" for row in text.splitlines()))


def _write(text: str) -> None:
    data = text.encode("utf-8", "replace")
    try:
        while data:
            data = data[os.write(2, data):]
    except OSError:   # EBADF (2>&-), EPIPE (a reader that went away): say nothing, change nothing
        pass


def error(message: str) -> None:
    line(message)


def warn(message: str) -> None:
    line(f"warning: {message}")


class Say:
    """The lines of one command: notes and warnings obey -q; errors always print. stamped: each
    line starts with its time (a service's: the proxy's, unless journald stamps them)."""

    def __init__(self, quiet: bool = False, stamped: bool = False):
        self.quiet, self.stamped = quiet, stamped

    def note(self, message: str) -> None:
        if not self.quiet:
            line(message, stamped=self.stamped)

    def warn(self, message: str) -> None:
        if not self.quiet:
            line(f"warning: {message}", stamped=self.stamped)

    def error(self, message: str) -> None:
        line(message, stamped=self.stamped)
