"""The flock store's witness claim: STEM.witness beside the lock, flocked by the one witness of
the lane and naming it (pid, host, which witness) for the others. Like the lock file it is never
removed; the kernel lets go of the flock when its witness ends, however it ends."""

from __future__ import annotations

import fcntl
import os

from ...say import sanitize
from ..shared_file import open_shared


class Claim:
    def __init__(self, fd: int):
        self.fd = fd

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)   # drops the flock
            self.fd = -1


def claim(dir_fd: int, name: str, who: str | None = None) -> tuple:
    """(Claim, None), or (None, the words the holder left) while another witness has it."""
    fd = open_shared(dir_fd, name)   # a regular file with one name, or OSError
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            held_by = os.pread(fd, 512, 0).decode("utf-8", "replace").strip()
        finally:
            os.close(fd)
        # Anyone may write the claim file: its words reach a terminal only as one printable line.
        return None, sanitize(held_by, 200) or "another process"
    except BaseException:
        os.close(fd)
        raise
    text = (who or default_words()).encode()[:500]
    try:
        os.pwrite(fd, text, 0)
        os.ftruncate(fd, len(text))
    except OSError:
        pass   # the words only label the claim
    return Claim(fd), None


def default_words() -> str:
    from ...facts import hostname

    return f"pid {os.getpid()} on {hostname()}"
