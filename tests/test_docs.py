"""README, --help, the man page and the completions stay in step with the CLI."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import click
import pytest

from lanelock import exitcodes
from lanelock.cli import cli

TOP = Path(__file__).resolve().parent.parent
MAN = TOP / "man" / "lanelock.1"
README = TOP / "README.md"


def commands():
    def walk(group, prefix):
        for name, command in sorted(group.commands.items()):
            yield prefix + [name], command
            if isinstance(command, click.Group):
                yield from walk(command, prefix + [name])
    return list(walk(cli, []))


def long_options(command):
    # A hidden option is a protocol, not an interface (`completion --complete`: the scripts' call).
    for param in command.params:
        if isinstance(param, click.Option) and not param.hidden:
            for opt in param.opts + param.secondary_opts:
                if opt.startswith("--"):
                    yield opt


def man_text() -> str:
    # roff escapes the hyphen: \- stands for -.
    return MAN.read_text().replace("\\-", "-").replace("\\fR", "").replace("\\fI", "")


@pytest.mark.skipif(shutil.which("groff") is None, reason="groff is not installed")
def test_man_page_renders_without_warnings():
    result = subprocess.run(["groff", "-man", "-ww", "-z", str(MAN)], capture_output=True, text=True)
    assert result.returncode == 0 and result.stderr == ""


@pytest.mark.parametrize("path,command", commands(), ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_every_command_and_option_is_in_the_man_page_and_readme(path, command):
    text, readme = man_text(), README.read_text()
    assert re.search(rf"\b{re.escape(path[-1])}\b", text), f"{path} missing from the man page"
    assert f"lanelock {' '.join(path)}" in readme or f"`{path[-1]}" in readme
    for option in long_options(command):
        assert option in text, f"{option} of {' '.join(path)} missing from the man page"
        bare = option.split("/")[0]
        assert bare in readme, f"{option} of {' '.join(path)} missing from README.md"


def test_exit_status_table_is_documented():
    text, readme = man_text(), README.read_text()
    for code in (exitcodes.BUSY, exitcodes.CANNOT_EXECUTE, exitcodes.NOT_FOUND, exitcodes.USAGE,
                 exitcodes.INTERNAL, exitcodes.GATE_UNAVAILABLE, exitcodes.OUTPUT_FAILED,
                 exitcodes.CANNOT_LISTEN, exitcodes.RESOURCES):
        assert re.search(rf"^\| {code} \|", readme, re.M), f"{code} missing from README table"
        assert re.search(rf"^{code}$", text, re.M), f"{code} missing from man EXIT STATUS"
    assert "128+N" in readme and "128+" in text
    for words in ("could not write its output", "cannot listen on its address"):
        assert words in " ".join(text.split()), f"{words!r} missing from man EXIT STATUS"


def test_every_lanelock_variable_is_documented():
    source = "".join(p.read_text() for p in (TOP / "lanelock").rglob("*.py"))
    names = set(re.findall(r"LANELOCK_[A-Z_]+", source))
    text, readme = man_text(), README.read_text()
    for name in sorted(names):
        assert name in text, f"{name} missing from the man page"
        assert name in readme, f"{name} missing from README.md"


COMPLETIONS = {"bash": "completions/bash/lanelock", "zsh": "completions/zsh/_lanelock",
               "fish": "completions/fish/lanelock.fish"}


@pytest.mark.parametrize("shell", sorted(COMPLETIONS))
def test_completions_are_fresh(shell):
    """completions/ (what pip installs) is what `lanelock completion SHELL` prints. The scripts
    take subcommands and options from the CLI at TAB time; tests/test_completion.py drives them."""
    fresh = subprocess.run([sys.executable, "-m", "lanelock", "completion", shell],
                           capture_output=True, text=True)
    assert fresh.returncode == 0, fresh.stderr
    committed = (TOP / COMPLETIONS[shell]).read_text()
    assert fresh.stdout == committed, \
        f"regenerate: lanelock completion {shell} > {COMPLETIONS[shell]}"


def test_the_completion_command_is_documented():
    assert re.search(r"^\.B completion$", MAN.read_text(), re.M), "completion missing from COMMANDS"
    section = README.read_text().split("\n## Shell completion\n", 1)[1].split("\n## ", 1)[0]
    for shell in sorted(COMPLETIONS):
        assert f"lanelock completion {shell} > " in section


def test_synopsis_and_commands_list_every_command():
    """The man SYNOPSIS and README's Commands list name every top-level command."""
    man = MAN.read_text()
    synopsis = man.split(".SH SYNOPSIS\n", 1)[1].split("\n.SH ", 1)[0]
    listed = README.read_text().split("\n## Commands\n", 1)[1].split("\n## ", 1)[0]
    for path, _ in commands():
        if len(path) == 1:
            assert f".B lanelock {path[0]}\n" in synopsis, f"{path[0]} missing from SYNOPSIS"
            assert f"- `lanelock {path[0]}" in listed, f"{path[0]} missing from README Commands"


def test_help_works_for_every_command():
    for path, _ in commands():
        result = subprocess.run([sys.executable, "-m", "lanelock", *path, "-h"],
                                capture_output=True, text=True)
        assert result.returncode == 0 and "Usage:" in result.stdout


def man_section(title: str) -> str:
    text = man_text()
    start = text.index(f"\n.SH {title}\n")
    end = text.find("\n.SH ", start + 1)
    return text[start:end if end >= 0 else None]


def test_every_config_key_is_documented_with_its_type_default_and_readers():
    """The config file's keys were explained only by an error message: the man page's
    CONFIGURATION lists each key the settings table knows, with its type, default and readers."""
    from lanelock.settings import TABLE

    section = man_section("CONFIGURATION")
    entries = dict(re.findall(r"\n\.TP\n\.B (\w+)\n(.*?)(?=\n\.TP\n|\n\.SS |\Z)", section, re.S))
    for setting in TABLE:
        assert setting.name in entries, f"config key {setting.name} missing from CONFIGURATION"
        words = " ".join(entries[setting.name].split())
        assert re.search(r"\b(string|number|seconds|integer|list|table|one of)\b", words, re.I), \
            f"{setting.name}: no type in {words!r}"
        assert "Default" in words, f"{setting.name}: no default in {words!r}"
        assert "Read by" in words, f"{setting.name}: no reader in {words!r}"
    assert set(entries) <= {setting.name for setting in TABLE}, set(entries)
    example = re.search(r"\n\.nf\n(\[\[chains\..*?)\n\.fi\n", section, re.S).group(1)
    import tomllib

    from lanelock.settings import validate

    chains = tomllib.loads(example.replace("\n.PP\n", "\n\n"))["chains"]
    assert validate("chains", chains) is None, example
    assert [entry.get("backend") for entry in chains["cloud"]] == ["192.168.1.50:8080", None]
