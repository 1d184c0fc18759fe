"""TOML configuration: a system file and a per-user file, read with tomllib, edited with tomlkit.

The per-user file may set anything except the lock root: a user file that moved the root would split
the gate silently, so its lock_dir is ignored and reported (``lanelock where`` says so loudly).
tomllib is imported only when a file exists, so the common case costs two stat() calls.
"""

from __future__ import annotations

import os

SYSTEM_FILE = "/etc/lanelock/config.toml"
MAX_BYTES = 1 << 20


class ConfigError(Exception):
    """An invalid config file: 'FILE: line N: reason'."""


class Config:
    """What the files say (a plain class, not a dataclass: `lanelock run` imports this, and
    dataclasses costs milliseconds). settings.Settings applies the precedence."""

    def __init__(self):
        self.values: dict = {}
        self.origins: dict = {}     # key -> (file it came from, "system" or "user")
        self.ignored: list = []     # human sentences: what was not applied
        self.refused: list = []     # (key, "FILE: line N", why): bad values left out
        self.files: list = []       # files that were read

    def get(self, key: str, default=None):
        return self.values.get(key, default)

    def source(self, key: str) -> str:
        path, which = self.origins[key]
        return f"{which} file {path}"


def system_file() -> str:
    return os.environ.get("LANELOCK_SYSTEM_CONFIG") or SYSTEM_FILE


def user_file() -> str | None:
    explicit = os.environ.get("LANELOCK_CONFIG")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CONFIG_HOME") or (
        os.path.join(os.environ["HOME"], ".config") if os.environ.get("HOME") else None)
    return os.path.join(base, "lanelock", "config.toml") if base else None


def load(check, retired: dict, lenient=None) -> Config:
    """The effective configuration. Raises ConfigError for an invalid file. check(key, value):
    None or why the value is refused; retired: {key: what replaced it}; lenient(key): whether a
    bad value of key is left out (Config.refused says so) rather than refusing the whole file
    (all three from settings.py, which holds the table: this module only reads and writes files)."""
    config = Config()
    for path, is_system in ((system_file(), True), (user_file(), False)):
        if not path:
            continue
        # A user file's lock_dir is never applied (below), so its value cannot spoil the file.
        data = read_file(path, check, unchecked=() if is_system else ("lock_dir",),
                         lenient=lenient, refused=config.refused)
        if data is None:
            continue
        config.files.append(path)
        for key, value in data.items():
            if key in retired:
                config.ignored.append(f"{path} sets {key}: IGNORED, it is retired: {retired[key]}")
                continue
            if key == "lock_dir" and not is_system:
                config.ignored.append(
                    f"user config {path} sets lock_dir = {value!r}: IGNORED, only the system "
                    f"config ({system_file()}) may move the gate")
                continue
            config.values[key] = value
            config.origins[key] = (path, "system" if is_system else "user")
    return config


def read_file(path: str, check, unchecked=(), lenient=None, refused=None) -> dict | None:
    """Parsed and validated settings of one file (but the keys `unchecked`), None when it does
    not exist. A bad value of a key that lenient(key) allows is left out and added to refused."""
    raw = _read_bytes(path)
    return None if raw is None else _parse(path, raw, check, unchecked, lenient, refused)


def _read_bytes(path: str) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as error:
        raise ConfigError(f"{path}: cannot read: {error.strerror}") from None
    with os.fdopen(fd, "rb") as handle:
        raw = handle.read(MAX_BYTES + 1)
    if len(raw) > MAX_BYTES:
        raise ConfigError(f"{path}: larger than {MAX_BYTES} bytes")
    return raw


def _parse(path: str, raw: bytes, check, unchecked=(), lenient=None, refused=None) -> dict:
    import tomllib

    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as error:
        raise ConfigError(f"{path}: not UTF-8 (byte {error.start})") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path}: {error}") from None
    except RecursionError:
        raise ConfigError(f"{path}: nested too deeply") from None
    for key, value in list(data.items()):
        problem = None if key in unchecked else check(key, value)
        if not problem:
            continue
        where = f"{path}: line {_line_of(raw, key)}"
        if lenient is None or refused is None or not lenient(key):
            raise ConfigError(f"{where}: {problem}")
        del data[key]
        refused.append((key, where, problem))
    return data


def _line_of(raw: bytes, key: str) -> int:
    for number, line in enumerate(raw.decode("utf-8", "replace").splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith((key, f'"{key}"', f"[{key}", f"[[{key}")):
            return number
    return 1


def parse_value(text: str):
    """A command-line value as TOML would read it (0.1, 75, true, [..], {..}); else a string."""
    import tomllib

    try:
        return tomllib.loads(f"value = {text}")["value"]
    except tomllib.TOMLDecodeError:
        return text


def set_value(key: str, text: str, *, system: bool, check, lenient=None) -> str:
    """Validate and write one setting; the file is left untouched on any error. Returns the path.

    The file is edited, not rewritten: its comments, spacing, quoting and order stay, and only the
    line of KEY changes or is added (people write these files by hand: a rewrite would lose
    every comment)."""
    if key == "lock_dir" and not system:
        raise ConfigError("lock_dir can only be set in the system file (--system): a per-user "
                          "lock root would split the gate")
    value = parse_value(text)
    problem = check(key, value)
    if problem:
        raise ConfigError(problem)
    path = system_file() if system else user_file()
    if not path:
        raise ConfigError("no user config path: HOME and XDG_CONFIG_HOME are unset")
    raw = _read_bytes(path)
    # One that does not parse stays as it is, and so does one refused whole; a bad value that is
    # read as its default (lenient) does not stop the file being mended one `config set` at a time.
    data = {} if raw is None else _parse(path, raw, lambda name, old: None if name == key or (
        lenient and lenient(name)) else check(name, old))
    data[key] = value
    text_out = _edited(raw.decode("utf-8") if raw else "", key, value)
    import tomllib

    try:   # the edit must read back as exactly what was meant, or the file is not touched
        same = tomllib.loads(text_out) == data
    except tomllib.TOMLDecodeError:
        same = False
    if not same:
        raise ConfigError(f"{path}: cannot set {key} here without rewriting the file; edit it "
                          f"by hand")
    _write(path, text_out, raw is not None)
    return path


def _edited(source: str, key: str, value) -> str:
    """source with key set to value, everything else as it was (tomlkit edits TOML round-trip;
    it is imported here only: never on `run`'s path). An existing key keeps its place, spacing
    and inline comment. A new key goes on its own line after the last top-level key: tomlkit on
    its own would put it after the comment that introduces the first table, and a blank line
    after it. Its insertion is private API, hence the fallback to tomlkit's own placement."""
    import tomlkit

    document = tomlkit.parse(source)
    after = _after_last_top_level_key(document.body)
    if key in document or after is None or after >= len(document.body):
        document[key] = value
    else:
        try:
            document._insert_at(after, key, tomlkit.item(value))
        except (AttributeError, TypeError, ValueError):
            document = tomlkit.parse(source)
            document[key] = value
    return tomlkit.dumps(document)


def _after_last_top_level_key(body: list) -> int | None:
    """The index after the last `key = value` before the first [table] header, None if none."""
    from tomlkit.items import AoT, Table

    after = None
    for index, (name, item) in enumerate(body):
        if isinstance(item, (Table, AoT)) and name is not None and not name.is_dotted():
            break
        if name is not None:
            after = index + 1
    return after


def _write(path: str, text: str, existed: bool) -> None:
    """Atomically: a temp file renamed over the old one, keeping the old one's permissions."""
    directory = os.path.dirname(path) or "."
    try:
        mode = os.stat(path).st_mode & 0o7777 if existed else 0o644
        os.makedirs(directory, exist_ok=True)
        temp = f"{path}.{os.getpid()}.tmp"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(text)
                if existed:   # what the umask would take off the old file's mode
                    os.fchmod(handle.fileno(), mode)
            os.replace(temp, path)
        except OSError:
            os.unlink(temp)
            raise
    except OSError as error:
        raise ConfigError(f"{path}: cannot write: {error.strerror}") from None
