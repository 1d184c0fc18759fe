"""The fallback chain: where a deflected turn goes.

An entry is a command, optionally bound to a backend of its own:

    --fallback 'llm -m gpt-4o-mini'                      a cloud command: runs ungated
    --fallback '@127.0.0.1:8081 llm -m local-small'      bound to a backend: gated on that lane

An entry is split into words as bash quotes them (words.py: '…', "…", backslashes and $'…', so the
`printf %q` of any prompt can be part of it); no shell is run. The first word starting with '@'
names the entry's backend. Entries are tried in order: one whose backend is a busy local lane is
skipped (it would thrash that lane too), one that cannot be executed is skipped with a warning; the
first entry that runs decides the exit status. A failing fallback is not retried on the next entry:
its side effects may already have happened.
"""

from __future__ import annotations

from . import words


class ChainError(ValueError):
    """A malformed entry: a usage error."""


class Fallback:
    """One fallback (a plain class: `typing` costs a turn with fallbacks milliseconds)."""

    __slots__ = ("argv", "backend")

    def __init__(self, argv: tuple[str, ...], backend: str | None = None):
        self.argv = tuple(argv)
        self.backend = backend

    def __eq__(self, other) -> bool:
        return isinstance(other, Fallback) and \
            (self.argv, self.backend) == (other.argv, other.backend)

    def __repr__(self) -> str:
        return f"Fallback({self.argv!r}, {self.backend!r})"

    @property
    def text(self) -> str:
        line = words.join(self.argv)   # one printable line that reads back as the argv
        return f"@{self.backend} {line}" if self.backend else line


def parse(text: str) -> Fallback:
    """A --fallback string, split as bash splits words (no shell is run)."""
    argv = _split(text, f"--fallback {text!r}")
    backend = None
    if argv and argv[0].startswith("@"):
        backend = argv.pop(0)[1:]
        if not backend:
            raise ChainError(f"--fallback {text!r}: '@' must be followed by a backend")
        _check_backend(backend, text)
    if not argv:
        raise ChainError(f"--fallback {text!r}: no command")
    return Fallback(tuple(argv), backend)


def from_config(name: str, chains: dict | None) -> list[Fallback]:
    """The named chain of the config ([[chains.NAME]] with command and optional backend)."""
    if not chains or name not in chains:
        known = ", ".join(sorted(chains or {})) or "none defined"
        raise ChainError(f"no fallback chain named {name!r} (known: {known})")
    entries = []
    for item in chains[name]:
        command = item["command"]
        argv = tuple(_split(command, f"chain {name!r}") if isinstance(command, str) else command)
        if not argv:
            raise ChainError(f"chain {name!r}: an entry has no command")
        if item.get("backend"):
            _check_backend(item["backend"], f"chain {name!r}")
        entries.append(Fallback(argv, item.get("backend")))
    return entries


def _split(text: str, where: str) -> list[str]:
    try:
        return words.split(text)
    except ValueError as error:   # an unclosed quote: a usage error, not an internal one
        raise ChainError(f"{where}: {error}") from None


def _check_backend(backend: str, where: str) -> None:
    from ..lanes import BackendError, split_backend

    try:
        split_backend(backend)
    except BackendError as error:
        raise ChainError(f"{where}: {error}") from None
