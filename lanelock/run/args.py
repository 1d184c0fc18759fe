"""`lanelock run`'s arguments, read without click.

`run` sits in front of every turn, and importing click costs more than everything else the turn
does (on a slow VM, 60 ms of a 100 ms start). So the console script reads the common forms of `run`
here and hands the turn straight to the wrapper; click stays the reference. Whatever this module is
not sure of -- help, an unknown option, a value it would have to judge, a missing command -- makes
parse() return None, and click parses the same argv and says what is wrong in its own words.

The rules below are click's, for this one command (allow_interspersed_args=False): options stop at
`--` or at the first word that is not an option; `--name=value` and `--name value`; a short option's
value may be glued on (`-bHOST:PORT`) and short flags may be grouped (`-qv`); a value-taking option
takes the next word whatever it looks like, except --wait, whose value is optional (it is not taken
when the next word looks like an option). tests/test_runargs.py holds this table to click's and
checks parse() against click on a corpus of argument lists.
"""

from __future__ import annotations

from ..settings import RUN_FLAGS, SETTINGS
from ..priority import class_named

# Options of `run` that are not settings: (spellings, parameter, kind, metavar, help).
RUN_ONLY = (
    (("--fallback", "-f"), "fallbacks", "multiple", "CMD",
     "Fallback command when busy; repeatable, tried in order. '@BACKEND CMD' binds it to a "
     "backend, skipped when that lane is busy."),
    (("--chain",), "chain", "text", "NAME", "Use a fallback chain from the config."),
    (("--quiet", "-q"), "quiet", "flag", None, "No notes or warnings from lanelock."),
    (("--verbose", "-v"), "verbose", "flag", None, "Report the wait time and the lock path."),
)
# A setting's kind as this parser reads its text.
_KINDS = {"text": "text", "store": "text", "key-by": "key-by", "on-lost": "on-lost",
          "priority": "priority",
          "seconds": "float",
          "optional-seconds": "optional-float", "exit": "exit"}

# name -> (parameter, kind). Kinds: text, multiple (repeatable text), float (>= 0), optional-float
# (--wait: a bare --wait means forever), exit (an int 0-255), key-by (a choice), flag, and
# on / off for --gate / --no-gate. Built from the settings table and RUN_ONLY.
LONG: dict = {}
SHORT: dict = {}
DEFAULTS: dict = {}
for _setting in (SETTINGS[name] for name in RUN_FLAGS):
    if _setting.kind == "gate":
        LONG["--gate"], LONG["--no-gate"] = ("gate", "on"), ("gate", "off")
    else:
        LONG[_setting.flags[0]] = (_setting.name, _KINDS[_setting.kind])
    for _short in _setting.flags[1:]:
        SHORT[_short] = _setting.flags[0]
    DEFAULTS[_setting.name] = None
for _spellings, _parameter, _kind, _metavar, _help in RUN_ONLY:
    LONG[_spellings[0]] = (_parameter, _kind)
    for _short in _spellings[1:]:
        SHORT[_short] = _spellings[0]
    DEFAULTS[_parameter] = {"multiple": (), "flag": False}.get(_kind)
FLAGS = ("flag", "on", "off")


class Request:
    """`lanelock run`'s command line as parsed, by click or by parse(): every option as given
    (None, (), False: not given) and the command. The settings table resolves the rest."""

    __slots__ = tuple(DEFAULTS) + ("command",)

    def __init__(self, **params):
        for name, default in DEFAULTS.items():
            object.__setattr__(self, name, params.pop(name, default))
        object.__setattr__(self, "command", tuple(params.pop("command", ())))
        if params:
            raise TypeError(f"unknown run parameters: {sorted(params)}")

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.__slots__}

    def __eq__(self, other) -> bool:
        return isinstance(other, Request) and self.as_dict() == other.as_dict()

    def __repr__(self) -> str:
        return f"Request({self.as_dict()!r})"

    def settings_flags(self) -> dict:
        """The settings given on the command line, as the settings table takes them."""
        flags = {name: getattr(self, name) for name in RUN_FLAGS}
        if self.gate is not None:
            flags["gate"] = "always" if self.gate else "never"
        flags["lock_dir"] = self.lock_dir or None   # an empty --lock-dir means "not given"
        flags["model"] = self.model or None
        return flags


class _Unsure(Exception):
    """click must read this argv: it knows the error message, or the form is rare."""


def parse(args: list[str]) -> Request | None:
    """`run`'s parameters as click would pass them, or None when click should parse args."""
    try:
        return _parse(list(args))
    except _Unsure:
        return None


def _parse(rest: list[str]) -> Request:
    params = dict(DEFAULTS)
    fallbacks: list[str] = []
    while rest:
        word = rest.pop(0)
        if word == "--":
            break
        if word[:1] != "-" or len(word) == 1:
            rest.insert(0, word)   # the command starts here
            break
        if word.startswith("--"):
            name, equals, attached = word.partition("=")
            _take(name, attached if equals else None, rest, params, fallbacks)
        else:
            _cluster(word, rest, params, fallbacks)
    if not rest:
        raise _Unsure   # click says "Missing argument 'COMMAND...'"
    params["fallbacks"] = tuple(fallbacks)
    params["command"] = tuple(rest)
    return Request(**params)


def _cluster(word: str, rest: list[str], params: dict, fallbacks: list[str]) -> None:
    """-qv, -b HOST, -bHOST, -qbHOST: short flags, then at most one option that takes a value."""
    for index in range(1, len(word)):
        name = SHORT.get("-" + word[index])
        if name is None:
            raise _Unsure
        glued = word[index + 1:]
        if LONG[name][1] in FLAGS:
            _take(name, None, rest, params, fallbacks)
            continue
        if glued[:1] == "-":
            raise _Unsure   # e.g. -w-1: click's reading of it is an error either way
        if glued:
            rest.insert(0, glued)   # the glued text is the value, as click does it
        _take(name, None, rest, params, fallbacks)
        return


def _take(name: str, attached: str | None, rest: list[str], params: dict,
          fallbacks: list[str]) -> None:
    if name not in LONG:
        raise _Unsure
    parameter, kind = LONG[name]
    if kind in FLAGS:
        if attached is not None:
            raise _Unsure   # "--quiet=1": click's error
        params[parameter] = {"flag": True, "on": True, "off": False}[kind]
        return
    if attached is not None:
        value = attached
    elif kind == "optional-float" and (not rest or (rest[0][:1] == "-" and len(rest[0]) > 1)):
        params[parameter] = float("inf")
        return
    elif rest:
        value = rest.pop(0)
    else:
        raise _Unsure   # "requires an argument"
    if kind == "multiple":
        fallbacks.append(value)
    else:
        params[parameter] = _convert(kind, value)


def _convert(kind: str, value: str):
    if kind == "text":
        return value
    if kind == "key-by":
        if value not in ("backend", "model"):
            raise _Unsure
        return value
    if kind == "on-lost":
        if value not in ("continue", "stop"):
            raise _Unsure
        return value
    if kind == "priority":
        named = class_named(value)
        if named is None:
            raise _Unsure   # click says which classes there are
        return named
    if not value.isascii():
        raise _Unsure
    if kind == "exit":
        try:   # int() refuses over 4300 digits, as it does for click: then click says why
            number = int(value) if value.isdigit() else 256
        except ValueError:
            raise _Unsure from None
        if number > 255:
            raise _Unsure
        return number
    # float, optional-float: plain decimals only ("5", "0.5", ".5", "5."); click judges the rest
    whole, _, fraction = value.partition(".")
    if not (whole + fraction).isdigit():
        raise _Unsure
    return float(value)
