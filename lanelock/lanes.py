"""Backend string -> lane: the Lane (what one lock stands for) and how every spelling keys to it.

One lane per backend: every spelling of this machine (localhost, 127.0.0.0/8, ::1, 0.0.0.0, our
hostname, our interface addresses) collapses to ``localhost:PORT`` so that all of them share one lock
file. A LAN box keeps its own key. A public host is not a lane at all (the gate is skipped).

Classification never touches DNS: a turn must not block on a slow resolver. Names are judged by their
shape and by /etc/hosts, which is a local file.
"""

from __future__ import annotations

import os
import re

# ipaddress and urllib.parse are imported only when a backend needs them: `lanelock run` on the
# default 127.0.0.1:8080 pays for neither (every import sits in front of every turn).

DEFAULT_BACKEND = "127.0.0.1:8080"
LOCAL_HOST = "localhost"
SCHEME_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}
LAN_SUFFIXES = (".local", ".lan", ".home.arpa", ".internal")
# RFC 6598 shared space; Tailscale hands out addresses from it.
CGNAT = "100.64.0.0/10"
_LOOPBACK_QUAD = re.compile(r"^127\.(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)(\.(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)){2}$")
_LABEL = re.compile(r"^[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?$")
_MAX_STEM = 180


class BackendError(ValueError):
    """A backend string that names no host:port. The CLI turns it into a usage error (exit 2)."""


class Lane:
    """A lane: what one lock file stands for. Immutable; equal when the key is (not the spelling).
    A plain class rather than a dataclass: the run path avoids importing dataclasses."""

    __slots__ = ("host", "port", "scope", "model", "given", "machine")

    def __init__(self, host: str, port: int, scope: str, model: str | None = None,
                 given: str = "", machine: str | None = None):
        set_ = object.__setattr__
        set_(self, "host", host)          # "localhost" for this machine, else the normalised host
        set_(self, "port", port)
        set_(self, "scope", scope)        # "local", "lan" or "public"
        set_(self, "model", model)        # only with --key-by model
        set_(self, "given", given)        # the backend as the user wrote it (no credentials)
        set_(self, "machine", machine)    # a network store qualifies "localhost" with its host

    def __setattr__(self, name, value):
        raise AttributeError("a Lane is immutable")

    def _key(self) -> tuple:
        return (self.host, self.port, self.scope, self.model, self.machine)

    def __eq__(self, other) -> bool:
        return isinstance(other, Lane) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return f"Lane({self.name!r}, scope={self.scope!r}, given={self.given!r})"

    @property
    def gated(self) -> bool:
        return self.scope != "public"

    @property
    def name(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        base = f"{host}:{self.port}"
        if self.machine:
            base += f"@{self.machine}"
        return f"{base}#{self.model}" if self.model else base

    @property
    def stem(self) -> str:
        """File name stem under the lock root: stable, reversible enough to read, no slashes.
        An IPv6 address keeps its brackets, which no host name can contain, so the address
        fd00::1 and a host named fd00__1 can never share a lock file."""
        host = f"[{self.host.replace(':', '_')}]" if ":" in self.host else self.host
        stem = f"{host}-{self.port}"
        if self.model:
            from urllib.parse import quote

            stem += "~" + quote(self.model, safe="-._")
        if len(stem) > _MAX_STEM:
            import hashlib

            digest = hashlib.sha256(stem.encode()).hexdigest()[:16]
            stem = f"{stem[:_MAX_STEM - 17]}~{digest}"
        return stem


def split_backend(text: str) -> tuple[str, int, str]:
    """Parse HOST:PORT, [V6]:PORT or a URL into (host, port, spelling without credentials)."""
    text = (text or "").strip()
    if not text:
        raise BackendError("empty backend (expected HOST:PORT or a URL)")
    if "://" in text:
        return _split_url(text)
    if text.startswith("["):
        close = text.find("]")
        if close < 0:
            raise BackendError(f"backend {text!r}: unclosed '['")
        host, rest = text[1:close], text[close + 1:]
        if not rest.startswith(":"):
            raise BackendError(f"backend {text!r} has no port (expected [ADDRESS]:PORT)")
        return _check_host(host, text), _check_port(rest[1:], text), text
    if "/" in text:   # localhost:8080/v1: a URL without its scheme
        raise BackendError(f"backend {text!r}: a path needs a scheme "
                           f"(http://{text}), or leave the path out (HOST:PORT)")
    host, sep, port = text.rpartition(":")
    if not sep:
        raise BackendError(f"backend {text!r} has no port: write HOST:PORT, e.g. "
                           f"{_with_port(text)}, or a URL")
    if ":" in host:
        raise BackendError(f"backend {text!r}: an IPv6 address needs brackets, e.g. [::1]:8080")
    return _check_host(host, text), _check_port(port, text), text


def origin(backend: str) -> str:
    """scheme://HOST:PORT to connect to for a backend, HOST as the lane reads it: every spelling
    the lane accepts (127.1, 0177.0.0.1, 2130706433, http://127.1:PORT/v1) reaches the address it
    means, not a string a client library refuses. BackendError when malformed."""
    host, port, spelled = split_backend(backend)
    scheme = spelled.split("://", 1)[0].lower() if "://" in spelled else "http"
    return f"{scheme}://{f'[{host}]' if ':' in host else host}:{port}"


def _split_url(text: str) -> tuple[str, int, str]:
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(text)
        parts.hostname  # noqa: B018 - raises on a malformed bracket
    except ValueError as error:
        raise BackendError(f"backend {text!r}: {error}") from None
    scheme = parts.scheme.lower()
    if not re.fullmatch(r"[a-z][a-z0-9+.-]*", scheme):
        raise BackendError(f"backend {text!r}: bad URL scheme")
    host = parts.hostname or ""
    try:
        port = parts.port
    except ValueError:
        raise BackendError(f"backend {text!r}: port must be a number from 1 to 65535") from None
    if port is None:
        if scheme not in SCHEME_PORTS:
            raise BackendError(f"backend {text!r}: no port and no default port for {scheme!r}")
        port = SCHEME_PORTS[scheme]
    if port == 0:
        raise BackendError(f"backend {text!r}: port must be a number from 1 to 65535")
    # Credentials in a URL must never reach the world-readable sidecar or journal.
    netloc = parts.netloc.rpartition("@")[2]
    spelled = f"{scheme}://{netloc}{parts.path}"
    return _check_host(host, text), port, spelled


def _with_port(text: str) -> str:
    """What would work in place of a backend without its port: a bare port is one on this
    machine (8080 -> 127.0.0.1:8080), a bare host wants its port (localhost -> localhost:8080)."""
    if text.isascii() and text.isdigit() and len(text) <= 5 and 1 <= int(text) <= 65535:
        return f"127.0.0.1:{int(text)}"
    return f"{text[:60]}:8080"


def _check_port(port: str, text: str) -> int:
    if not port:
        raise BackendError(f"backend {text!r} has no port (expected HOST:PORT)")
    if not (port.isascii() and port.isdigit()) or not 1 <= int(port) <= 65535:
        raise BackendError(f"backend {text!r}: port must be a number from 1 to 65535")
    return int(port)


def _check_host(host: str, text: str) -> str:
    if not host:
        raise BackendError(f"backend {text!r} has no host")
    if _LOOPBACK_QUAD.match(host):
        return host   # already canonical: the pattern admits no leading zeros
    looks_numeric = ":" in host or any(ch.isdigit() for ch in host)
    address = _address(host) if looks_numeric else None
    if address is not None:
        return str(address)
    name = host.lower().rstrip(".")
    address = _address(name) if looks_numeric and name != host.lower() else None
    if address is not None:   # "1.", "127.0.0.1.": the address without its dot, as its lane's
        return str(address)   # name re-reads (a name "1" would re-read as the address 0.0.0.1)
    labels = name.split(".")
    if len(name) > 253 or not all(_LABEL.match(label) for label in labels):
        raise BackendError(f"backend {text!r}: {host!r} is not a host name or address")
    return name


def _address(host: str):
    """The IPv4/IPv6 address a host string spells (IPv4-mapped unwrapped), else None. IPv4 is
    read as inet_aton(3) reads it -- what curl, Python's socket and glibc connect to -- so
    127.1, 0x7f.1, 0177.0.0.1 and 2130706433 are all 127.0.0.1: one lane, one gate."""
    import ipaddress

    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])  # drop an IPv6 zone id
    except ValueError:
        number = inet_aton(host)
        return ipaddress.IPv4Address(number) if number is not None else None
    mapped = getattr(address, "ipv4_mapped", None)
    return mapped or address


def inet_aton(text: str) -> int | None:
    """The IPv4 address inet_aton(3) makes of text, as an integer, or None. One to four parts
    separated by dots, each decimal, octal (leading 0) or hex (0x); the last part fills the
    bytes that are left: a.b.c.d, a.b.c (c: 16 bits), a.b (b: 24 bits), a (32 bits)."""
    parts = text.split(".")
    if not 1 <= len(parts) <= 4 or not text.isascii():
        return None
    values = []
    for part in parts:
        if not part or not part[0].isdigit():
            return None
        # The digits are checked here, not left to int(), which also takes a second "0x" prefix
        # ("0x0x0553"), underscores and signs that inet_aton(3) refuses; "0x" alone is refused.
        if part[:2].lower() == "0x":
            digits, base, allowed = part[2:], 16, "0123456789abcdefABCDEF"
        elif part[0] == "0" and len(part) > 1:
            digits, base, allowed = part[1:], 8, "01234567"
        else:
            digits, base, allowed = part, 10, "0123456789"
        if not digits or any(char not in allowed for char in digits):
            return None
        values.append(int(digits, base))
    last_bits = 8 * (5 - len(values))
    if any(value > 255 for value in values[:-1]) or values[-1] >= 1 << last_bits:
        return None
    number = values[-1]
    for index, value in enumerate(values[:-1]):
        number |= value << (24 - 8 * index)
    return number


def lane_for(backend: str, *, model: str | None = None, key_by: str = "backend") -> Lane:
    """The lane a backend (and, with key_by="model", a model) stands for."""
    host, port, spelled = split_backend(backend)
    if key_by not in ("backend", "model"):
        raise BackendError(f"--key-by must be 'backend' or 'model', not {key_by!r}")
    if key_by == "model":
        model = (model or "").strip()
        if not model:
            raise BackendError("--key-by model needs a model (--model NAME or LANELOCK_MODEL)")
    else:
        model = None
    scope = classify(host)
    if scope == "local":
        host = LOCAL_HOST
    return Lane(host=host, port=port, scope=scope, model=model, given=spelled)


def lane_named(name: str) -> Lane:
    """The lane a store lists by name ("HOST:PORT[@MACHINE][#MODEL]", Lane.name) -- a lane the
    store already keys, so its scope is read from the host as lane_for reads it."""
    base, _, model = name.partition("#")
    base, _, machine = base.partition("@")
    host, _, port = base.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    scope = "local" if host == LOCAL_HOST else classify(host)
    return Lane(host, int(port), scope, model or None, base, machine or None)


def as_seen_elsewhere(lane: Lane) -> Lane:
    """The lane as another host keys the same spelling, for a store several hosts share. This
    machine collapses its own LAN address or name (10.0.0.5:8080, gpubox:8080) into
    localhost:PORT; every other host keys that spelling by the address or name itself -- two
    keys, two gates for one engine. So a local lane spelled by anything but a loopback name or
    address is keyed as the others key it; a loopback spelling stays this machine's own."""
    if lane.scope != "local" or not lane.given:
        return lane
    host, port, _ = split_backend(lane.given)
    if host == LOCAL_HOST or host.endswith(".localhost") or _LOOPBACK_QUAD.match(host):
        return lane
    address = _address(host)
    if address is not None and (address.is_loopback or address.is_unspecified):
        return lane
    import ipaddress

    if address is not None:
        private = address.is_private or address.is_link_local or \
            address in ipaddress.ip_network(CGNAT)
        scope = "lan" if private else "public"
    else:
        scope = "lan" if "." not in host or host.endswith(LAN_SUFFIXES) else "public"
    if scope == "public":   # other hosts would not gate it at all: stay this machine's lane
        return lane
    return Lane(str(address) if address is not None else host, port, scope, lane.model,
                lane.given)


def qualified(lane: Lane, machine: str) -> Lane:
    """The same lane, named with the machine it is on (for a store shared by several hosts)."""
    return Lane(lane.host, lane.port, lane.scope, lane.model, lane.given, machine)


def classify(host: str) -> str:
    """'local' (this machine), 'lan' (private network) or 'public'."""
    if host == LOCAL_HOST or _LOOPBACK_QUAD.match(host):   # the common case, without ipaddress
        return "local"
    address = _address(host)
    if address is None:
        return _classify_name(host)
    if address.is_loopback or address.is_unspecified:
        return "local"
    if str(address) in own_addresses():
        return "local"
    import ipaddress

    if address.is_private or address.is_link_local or address in ipaddress.ip_network(CGNAT):
        return "lan"
    return "public"


def _classify_name(name: str) -> str:
    if name == LOCAL_HOST or name.endswith(".localhost"):
        return "local"
    own = os.uname().nodename.lower().rstrip(".")   # gethostname() without importing socket
    if name in (own, own.split(".", 1)[0]):
        return "local"
    mapped = hosts_file().get(name)
    if mapped is not None:
        return classify(mapped)
    if "." not in name or name.endswith(LAN_SUFFIXES):
        return "lan"
    return "public"


def own_addresses() -> frozenset[str]:
    """Addresses of this machine's interfaces (psutil is imported only when an address needs it)."""
    try:
        import socket

        import psutil

        found = set()
        for entries in psutil.net_if_addrs().values():
            for entry in entries:
                if entry.family in (socket.AF_INET, socket.AF_INET6):
                    address = _address(entry.address)
                    if address is not None:
                        found.add(str(address))
        return frozenset(found)
    except (ImportError, OSError):
        return frozenset()


def hosts_file(path: str = "/etc/hosts") -> dict[str, str]:
    """name -> first address in /etc/hosts; a missing or odd file is simply empty."""
    table: dict[str, str] = {}
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            lines = handle.read(1 << 20).splitlines()
    except OSError:
        return table
    for line in lines:
        words = line.split("#", 1)[0].split()
        if len(words) >= 2 and _address(words[0]) is not None:
            for name in words[1:]:
                table.setdefault(name.lower().rstrip("."), words[0])
    return table


def name_from_stem(stem: str) -> str | None:
    """The lane name a lock file's stem stands for (None when the stem is not one of ours)."""
    from urllib.parse import unquote

    base, _, model = stem.partition("~")
    host, _, port = base.rpartition("-")
    if not host or not port.isdigit():
        return None
    if host.startswith("[") and host.endswith("]"):
        host = host.replace("_", ":")
    return f"{host}:{port}" + (f"#{unquote(model)}" if model else "")


def listen_address(text: str) -> tuple[str, int, bool]:
    """(host, port, loopback) of a --listen value: HOST:PORT, [V6]:PORT, http://HOST:PORT (the URL
    a client is given), or a bare PORT (127.0.0.1). IPv4 is read as everywhere in lanelock
    (inet_aton: 127.1 is 127.0.0.1), so a spelling of loopback never asks for a token. Port 0
    picks a free one (the startup line says which)."""
    text = text.strip()
    if text.lower().startswith("http://"):
        text = text[len("http://"):].rstrip("/")
    if text.isascii() and text.isdigit():
        text = f"127.0.0.1:{text}"
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    else:
        host, _, port = text.rpartition(":")
    if not host or "/" in text or not (port.isascii() and port.isdigit()) or int(port) > 65535:
        from .errors import UsageProblem

        raise UsageProblem(f"--listen {text!r}: expected HOST:PORT or a port (e.g. "
                           "127.0.0.1:8089, 8089)")
    if host.lower() == "localhost":
        return "127.0.0.1", int(port), True
    import ipaddress

    number = inet_aton(host)
    try:
        address = ipaddress.ip_address(number if number is not None else host)
    except ValueError:
        return host, int(port), False
    return str(address), int(port), address.is_loopback
