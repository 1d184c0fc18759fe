"""README, --help, the man page and the completions stay in step with the CLI."""

from __future__ import annotations

import os
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
    for param in command.params:
        if isinstance(param, click.Option):
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
                 exitcodes.INTERNAL):
        assert re.search(rf"^\| {code} \|", readme, re.M), f"{code} missing from README table"
        assert re.search(rf"^{code}$", text, re.M), f"{code} missing from man EXIT STATUS"
    assert "128+N" in readme and "128+" in text


def test_every_lanelock_variable_is_documented():
    source = "".join(p.read_text() for p in (TOP / "lanelock").glob("*.py"))
    names = set(re.findall(r"LANELOCK_[A-Z_]+", source))
    text, readme = man_text(), README.read_text()
    for name in sorted(names):
        assert name in text, f"{name} missing from the man page"
        assert name in readme, f"{name} missing from README.md"


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_completions_are_fresh(shell):
    env = dict(os.environ, _LANELOCK_COMPLETE=f"{shell}_source")
    fresh = subprocess.run([sys.executable, "-m", "lanelock"], env=env, capture_output=True, text=True)
    committed = (TOP / "completions" / f"lanelock.{shell}").read_text()
    assert fresh.stdout == committed, f"regenerate completions/lanelock.{shell}"


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")
def test_bash_completion_offers_commands_and_existing_lanes(tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    shim = bindir / "lanelock"
    shim.write_text(f"#!/bin/sh\nexec {sys.executable} -m lanelock \"$@\"\n")
    shim.chmod(0o755)
    root = Path(os.environ["LANELOCK_DIR"])
    subprocess.run([sys.executable, "-m", "lanelock", "run", "-b", "127.0.0.1:8099", "--", "true"],
                   check=True)
    script = f"""
source {TOP / 'completions' / 'lanelock.bash'}
COMP_WORDS=(lanelock pr); COMP_CWORD=1; _lanelock_completion lanelock; echo "${{COMPREPLY[@]}}"
COMP_WORDS=(lanelock probe --backend ''); COMP_CWORD=3; COMPREPLY=(); _lanelock_completion lanelock
echo "${{COMPREPLY[@]}}"
"""
    env = dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}", LANELOCK_DIR=str(root))
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True).stdout
    first, second = out.splitlines()[:2]
    assert first.split() == ["probe"]
    assert "localhost:8099" in second.split()


def test_help_works_for_every_command():
    for path, _ in commands():
        result = subprocess.run([sys.executable, "-m", "lanelock", *path, "-h"],
                                capture_output=True, text=True)
        assert result.returncode == 0 and "Usage:" in result.stdout
