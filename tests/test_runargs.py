"""runargs.py, the click-free fast path of `lanelock run`, held to click: the same option table,
the same parameters for every argv it accepts (None, "let click parse", for the rest), the same
exit status and error line from a real process on either path, and no costly import on a turn.

The contract under test: parse(args) is None, or exactly the dict click passes to `run`.
"""

from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path

import click
import pytest
from hypothesis import given, settings, strategies as st

from lanelock.run import args as runargs
from lanelock.cli import run

ROOT = Path(__file__).resolve().parents[1]
CLICK_MAIN = [sys.executable, "-c",
              "import sys; from lanelock.cli import main; sys.exit(main(sys.argv[1:]))"]
FAST_MAIN = [sys.executable, "-m", "lanelock"]
ERROR = "error"   # what click_params returns when click refuses the argv (or prints help)


def click_params(args) -> dict | str:
    """The parameters click would pass to `run` for args, or ERROR."""
    try:
        with contextlib.redirect_stdout(io.StringIO()):   # --help prints before it exits
            return run.make_context("run", list(args)).params
    except (click.ClickException, click.exceptions.Exit):
        return ERROR


def assert_agrees_with_click(args) -> None:
    fast, reference = runargs.parse(args), click_params(args)
    fast = fast.as_dict() if fast is not None else None   # the Request both paths build
    if reference == ERROR:
        assert fast is None, f"parse({args!r}) = {fast!r}, but click refuses it"
    else:
        assert fast is None or fast == reference, f"parse({args!r}): {fast!r} != {reference!r}"


# -- 1. the table is click's -----------------------------------------------------------------------
def click_options() -> list[click.Option]:
    return [param for param in run.params if isinstance(param, click.Option)]


def runargs_kind(option: click.Option) -> str:
    """The runargs kind that reads this click option the way click does."""
    kind = option.type
    if option.is_flag:
        assert isinstance(kind, click.types.BoolParamType), option.name
        return "flag"
    if option.multiple:
        assert isinstance(kind, click.types.StringParamType), option.name
        return "multiple"
    if isinstance(kind, click.Choice):
        # runargs._convert spells the choices out, so they must be exactly these: the classes in
        # any case (queue.class_named), key-by exactly
        if tuple(kind.choices) == ("interactive", "normal", "batch"):
            assert not kind.case_sensitive, option.name
            return "priority"
        assert kind.case_sensitive, option.name
        if tuple(kind.choices) == ("continue", "stop"):
            return "on-lost"
        assert tuple(kind.choices) == ("backend", "model"), option.name
        return "key-by"
    if isinstance(kind, click.IntRange):
        assert (kind.min, kind.max, kind.min_open, kind.max_open, kind.clamp) == \
            (0, 255, False, False, False), option.name
        return "exit"
    if isinstance(kind, click.FloatRange):
        assert (kind.min, kind.max, kind.min_open, kind.clamp) == (0, None, False, False), \
            option.name
        # --wait: a value is optional and a bare --wait means forever
        return "optional-float" if option.flag_value == float("inf") else "float"
    assert isinstance(kind, click.types.StringParamType), f"{option.name}: unknown type {kind!r}"
    return "text"


def test_long_names_and_kinds_match_click():
    expected = {}
    for option in click_options():
        longs = [name for name in option.opts if name.startswith("--")]
        assert len(longs) == 1, option.opts   # runargs maps one long name per parameter
        if option.secondary_opts:   # --gate/--no-gate
            assert option.is_flag and len(option.secondary_opts) == 1
            expected[longs[0]] = (option.name, "on")
            expected[option.secondary_opts[0]] = (option.name, "off")
        else:
            expected[longs[0]] = (option.name, runargs_kind(option))
    assert runargs.LONG == expected


def test_short_names_match_click():
    expected = {}
    for option in click_options():
        long_name = next(name for name in option.opts if name.startswith("--"))
        for name in option.opts + option.secondary_opts:
            if not name.startswith("--"):
                expected[name] = long_name
    assert runargs.SHORT == expected


def test_defaults_are_what_click_passes_when_no_option_is_given():
    assert set(runargs.DEFAULTS) == {option.name for option in click_options()}
    reference = click_params(["cmd"])
    assert reference.pop("command") == ("cmd",)
    assert runargs.DEFAULTS == reference


def test_the_rules_runargs_relies_on_hold():
    # options stop at the first word that is not one; COMMAND takes the rest verbatim, at least one
    assert run.context_settings["allow_interspersed_args"] is False
    (command,) = [param for param in run.params if isinstance(param, click.Argument)]
    assert (command.name, command.nargs, command.required) == ("command", -1, True)
    assert isinstance(command.type, click.types.UnprocessedParamType)


def test_help_is_clicks_alone():
    help_option = run.get_help_option(run.make_context("run", ["cmd"]))
    assert sorted(help_option.opts) == ["--help", "-h"]
    for name in help_option.opts:
        assert name not in runargs.LONG and name not in runargs.SHORT
        assert runargs.parse([name, "--", "cmd"]) is None
    assert runargs.parse(["-qh", "cmd"]) is None


# -- 2. the same parameters as click, on a corpus --------------------------------------------------
# The forms a turn actually uses: the fast path must take them (parse() is not None).
COMMON = [
    ["-b", "127.0.0.1:8080", "--", "true"],
    ["--wait", "--", "cmd"],
    ["-q", "-f", "x", "--", "cmd"],
    ["cmd"],
    ["--backend", "h:1", "cmd", "arg"],
    ["--backend=h:1", "--", "cmd"],
    ["-bh:1", "--", "cmd"],
    ["-w5", "--", "cmd"],
    ["-w", "5", "--", "cmd"],
    ["--wait=0.5", "cmd"],
    ["-w", ".5", "cmd"],
    ["--wait", "-q", "cmd"],             # bare --wait before another option
    ["-q", "--wait", "--", "cmd"],       # bare --wait at the end of the options
    ["-w", "--", "cmd"],
    ["-E3", "cmd"],
    ["-E", "75", "cmd"],
    ["--busy-exit-code=0", "cmd"],
    ["-E", "00255", "cmd"],
    ["-qv", "cmd"],
    ["-qvb", "HOST:1", "cmd"],
    ["-qbHOST:1", "cmd"],
    ["-m", "llama", "--key-by", "model", "cmd"],
    ["--priority", "batch", "cmd"],
    ["--priority=INTERACTIVE", "cmd"],   # a class in any case, as click reads it
    ["--priority", "Normal", "--", "cmd"],
    ["--key-by=backend", "cmd"],
    ["--on-lost", "stop", "cmd"], ["--on-lost=continue", "cmd"],
    ["-s", "me@tty", "--session", "other", "cmd"],          # last wins
    ["-b", "a:1", "-b", "b:2", "cmd"],
    ["-f", "a", "--fallback", "b", "-f", "c", "cmd"],       # fallbacks accumulate
    ["--fallback=@h:1 cmd x", "--", "cmd"],
    ["--gate", "cmd"],
    ["--no-gate", "cmd"],
    ["--gate", "--no-gate", "cmd"],
    ["--no-gate", "--gate", "cmd"],
    ["--grace", "0", "--kill-after", "2.5", "cmd"],
    ["--grace=5.", "cmd"],
    ["--grace", "00", "cmd"],
    ["--kill-after", "9" * 400, "cmd"],    # float() overflows to inf, as it does in click
    ["--lock-dir", "/tmp/x", "--store", "postgresql://h/db", "--chain", "main", "cmd"],
    ["--quiet", "--verbose", "--quiet", "cmd"],
    ["-b", "-q", "cmd"],                 # a value may start with '-'
    ["-b", "--", "cmd"],                 # ... or be '--'
    ["-b", "-h", "cmd"],                 # ... or look like help
    ["-f", "-x", "--", "cmd"],
    ["-b", "", "--", "cmd"],
    ["--fallback=", "cmd"],
    ["-b=x", "cmd"],                     # a glued short value keeps its '='
    ["--", "cmd", "--help"],
    ["cmd", "--help"],                   # options stop at the command
    ["cmd", "-x"],
    ["-q", "cmd", "-v"],
    ["--", "--", "x"],
    ["--", "-q"],
    ["-", "x"],                          # a lone '-' is a word, not an option
    ["-q", "-"],
    ["", "x"],
]

# Forms parse() may leave to click: errors, help, and values it would have to judge.
OTHERS = [
    # help, unknown options, flags given a value
    ["-h"], ["--help"], ["-h", "cmd"], ["--help", "--", "cmd"], ["-qh", "cmd"],
    ["--wait", "--help", "cmd"], ["--nope", "cmd"], ["-z", "cmd"], ["-qz", "cmd"],
    ["--qu", "cmd"], ["--version", "cmd"], ["--quiet=1", "cmd"], ["--gate=yes", "cmd"],
    ["-q=", "cmd"], ["---", "cmd"], ["--=x", "cmd"], ["-1", "cmd"],
    # missing values, missing command
    ["-b"], ["--backend"], ["-q", "-b"], ["-qb"], ["-E"], ["--fallback"], ["--grace"],
    [], ["-q"], ["--"], ["-b", "x"], ["-w"], ["--wait"], ["--wait", "--"], ["-q", "--"],
    ["-w", "5"],
    # --wait's optional value: a word after it is its value, whatever it is
    ["--wait", "cmd"], ["-w", "-", "cmd"], ["--wait", "-", "cmd"], ["-w", "-1", "cmd"],
    ["-w-1", "cmd"], ["-w-q", "cmd"], ["-wv", "cmd"], ["-vw", "cmd"], ["--wait=", "cmd"],
    ["-w=5", "cmd"], ["--wait=3", "--wait", "cmd"], ["-b-q", "cmd"],
    # bad choices
    ["--key-by", "BACKEND", "cmd"], ["--key-by", "host", "cmd"], ["--key-by=", "cmd"],
    ["--on-lost", "STOP", "cmd"], ["--on-lost", "kill", "cmd"], ["--on-lost=", "cmd"],
]
BAD_FLOATS = ["abc", "nan", "inf", "-inf", "1e3", "-1", "", " 5", "5 ", ".", "1_0", "+1", "0x1",
              "1.2.3", "٣", "５", "²"]
BAD_INTS = ["256", "-1", "0x10", "+5", "", " 5", "5 ", "1_0", "2.0", "abc", "٣", "５", "²"]
OTHERS += [[option, value, "cmd"] for option in ("--grace", "--kill-after", "-w")
           for value in BAD_FLOATS]
OTHERS += [[f"--wait={value}", "cmd"] for value in BAD_FLOATS]
OTHERS += [["-E", value, "cmd"] for value in BAD_INTS]
OTHERS += [[f"-E{value}", "cmd"] for value in BAD_INTS]

# int() refuses more than 4300 digits (sys.int_info.str_digits_check_threshold): parse() must
# leave these to click ("... is not a valid integer range"), not raise.
HUGE_INTS = [["-E", "1" * 5000, "cmd"], ["-E", "0" * 4400 + "5", "cmd"]]


def argv_id(args) -> str:
    text = " ".join(repr(word) if not word or " " in word else word for word in args)
    return text if len(text) < 60 else text[:40] + f"...({len(text)} chars)"


@pytest.mark.parametrize("args", COMMON + OTHERS + HUGE_INTS, ids=argv_id)
def test_parse_gives_clicks_parameters_or_none(args):
    assert_agrees_with_click(args)


@pytest.mark.parametrize("args", COMMON, ids=argv_id)
def test_the_fast_path_takes_the_common_forms(args):
    assert runargs.parse(args) is not None


def test_the_corpus_is_wide_enough():
    # about half the corpus is refused by click: the "never a dict on an error" half is exercised
    errors = [args for args in OTHERS if click_params(args) == ERROR]
    assert len(COMMON) >= 50 and len(errors) >= 60


# -- 3. the same property on arbitrary token lists -------------------------------------------------
TOKENS = sorted(runargs.LONG) + sorted(runargs.SHORT) + [
    "-qv", "-qvb", "--", "-", "5", ".5", "0", "255", "256", "abc", "", "-x", "-1", "cmd", "--help",
    "-h", "--wait=3", "--wait=", "-bX", "-w5", "-E3", "backend", "model", "--quiet=1", "٣",
    "batch", "Interactive", "NORMAL", "urgent"]


@settings(max_examples=300, deadline=None, database=None)   # database: write nothing in the tree
@given(st.lists(st.sampled_from(TOKENS), max_size=8))
def test_any_token_list_parses_as_click_does(args):
    assert_agrees_with_click(args)


# -- 4. real processes: both paths end the same way ------------------------------------------------
BAD_INPUTS = [
    (["-b", "", "--", "true"], True),
    (["-b", "127.0.0.1:18951", "-f", "@bad:x:y true", "--", "true"], True),
    (["-b", "127.0.0.1:18952", "--wait=abc", "--", "true"], False),
    (["-b", "127.0.0.1:18953"], False),
    (["-b", "127.0.0.1:18954", "--nope", "--", "true"], False),
]


@pytest.mark.parametrize("args, fast", BAD_INPUTS, ids=lambda value: argv_id(value)
                         if isinstance(value, list) else None)
def test_bad_input_gives_the_same_error_on_both_paths(args, fast, run_cmd):
    # fast: parse() takes it, so the fast path really runs (the wrapper finds the problem)
    assert (runargs.parse(args) is not None) == fast
    fast_run = run_cmd([*FAST_MAIN, "run", *args])
    click_run = run_cmd([*CLICK_MAIN, "run", *args])
    assert (fast_run.returncode, click_run.returncode) == (2, 2), (fast_run, click_run)
    assert fast_run.stderr == click_run.stderr
    lines = fast_run.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("lanelock: "), fast_run.stderr
    assert fast_run.stdout == click_run.stdout == ""


def test_a_good_turn_gives_the_childs_status_on_both_paths(run_cmd):
    args = ["-b", "127.0.0.1:18956", "--", "sh", "-c", "exit 3"]
    assert runargs.parse(args) is not None
    fast_run = run_cmd([*FAST_MAIN, "run", *args])
    click_run = run_cmd([*CLICK_MAIN, "run", *args])
    assert (fast_run.returncode, click_run.returncode) == (3, 3), (fast_run, click_run)
    assert fast_run.stderr == click_run.stderr == ""


# -- 5. what a turn imports ------------------------------------------------------------------------
SLOW_IMPORTS = {"click", "rich", "psutil", "typing", "dataclasses", "ipaddress", "urllib", "tomlkit",
                "aiohttp", "asyncio", "secrets"}


def importtime_turn(run_cmd, args):
    """`python -X importtime -m lanelock run ARGS` -> (result, modules it imported).

    -S, with the checkout on PYTHONPATH: the editable install's .pth finder imports pathlib, and
    with it urllib and ipaddress, before lanelock starts. importtime lists a module only the first
    time, so that would both fail the check and hide lanelock's own imports of them. Without
    site-packages the listing is lanelock's alone (and click or psutil could not even be found)."""
    result = run_cmd([sys.executable, "-S", "-X", "importtime", "-m", "lanelock", "run", *args],
                     env={"PYTHONPATH": ROOT})
    modules = {line.rpartition("|")[2].strip() for line in result.stderr.splitlines()
               if line.startswith("import time:")}
    assert "lanelock.run.wrapper" in modules, result.stderr   # the listing is real and the turn ran
    return result, modules


def slow(modules) -> set[str]:
    return {name for name in modules if name.split(".")[0] in SLOW_IMPORTS}


def test_a_plain_turn_imports_nothing_slow(run_cmd):
    result, modules = importtime_turn(run_cmd, ["-b", "127.0.0.1:18960", "--", "true"])
    assert result.returncode == 0, result.stderr
    assert slow(modules) == set()
    assert "lanelock.cli" not in modules


def test_a_deflected_turn_imports_nothing_slow(holder, run_cmd):
    held = holder("-b", "127.0.0.1:18962")
    result, modules = importtime_turn(run_cmd, ["-b", "127.0.0.1:18962", "--", "true"])
    assert result.returncode == 75, result.stderr   # busy, no fallback: the deflection ran
    assert slow(modules) == set()
    assert held.release() == 0


def test_a_turn_with_a_fallback_imports_nothing_slow(run_cmd):
    result, modules = importtime_turn(run_cmd, ["-b", "127.0.0.1:18961", "-f", "true", "--",
                                                "true"])
    assert result.returncode == 0, result.stderr
    assert slow(modules) == set()
