"""Shell completion: `lanelock completion SHELL`, installed by the README's line for that shell,
driven through a pseudo-terminal in real bash (with bash-completion when installed), zsh and fish.

Each shell starts without rc files (bash --norc --noprofile, zsh -f, fish --no-config), with its
own HOME and a prompt marker it only prints when ready. A case types a partial command line and
TAB, then moves to the start of the line (^A) and turns it into `printf '[%s]\\n' …`: the shell
prints the completed words one per line, which is what the test reads -- no screen scraping, no
sleeps.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tomllib
from pathlib import Path

import pytest

from lanelock import completion
from lanelock.cli import cli

TOP = Path(__file__).resolve().parent.parent
README = TOP / "README.md"
# The console script users run (the completion scripts call `lanelock` by name).
SCRIPT = Path(sys.executable).parent / "lanelock"
INSTALLED = {"bash": "share/bash-completion/completions/lanelock",
             "zsh": "share/zsh/site-functions/_lanelock",
             "fish": "share/fish/vendor_completions.d/lanelock.fish"}
COMMITTED = {"bash": "completions/bash/lanelock", "zsh": "completions/zsh/_lanelock",
             "fish": "completions/fish/lanelock.fish"}
BASH_COMPLETION = Path("/usr/share/bash-completion/bash_completion")
MARKER = "PR" + "OMPT>"          # typed as 'PR''OMPT>', so only the prompt itself contains it
ANSI = re.compile(r"\x1b(\[[0-?]*[ -/]*[@-~]|\][^\x07]*\x07|[()][0-9A-B]|[=>])")


# -- the protocol, without a terminal -----------------------------------------------------------
def candidates(line: str, shell: str = "zsh", word: str | None = None) -> list[tuple[str, ...]]:
    """(TYPE, VALUE, EXTRA) lines that `lanelock completion SHELL --complete LINE` prints."""
    text = completion.answer(shell, line, word, group=cli)
    return [tuple(row.split("\t")) for row in text.splitlines()]


def values(line: str, **kwargs) -> list[str]:
    return [row[1] for row in candidates(line, **kwargs) if row[0] == "plain"]


@pytest.fixture
def lanes(lanelock):
    """Two lanes under the test's lock root, made the way users make them: by a turn."""
    for port in (7201, 7202):
        assert lanelock("run", "-b", f"localhost:{port}", "--", "true").returncode == 0
    return ["localhost:7201", "localhost:7202"]


def test_subcommands_and_their_options_come_from_the_cli():
    from lanelock.cli import cli

    assert values("lanelock ") == sorted(cli.commands)
    assert values("lanelock st") == ["status"]
    assert values("lanelock run --lo") == ["--lock-dir"]
    assert "--fallback" in values("lanelock run -") and "--wait" in values("lanelock run -")
    assert values("lanelock config ") == ["path", "set", "show"]
    assert values("lanelock completion ") == ["bash", "zsh", "fish"]
    # Descriptions for the shells that show them (zsh, fish).
    status = [row for row in candidates("lanelock st")][0]
    assert status[2].startswith("Who holds the lane")
    # The scripts' own option is not offered.
    assert not any(value.startswith("--complete") for value in values("lanelock completion bash -"))


def test_backends_are_the_existing_lanes(lanes, tmp_path):
    assert values("lanelock status -b ") == lanes
    assert values("lanelock run --backend localhost:7202") == ["localhost:7202"]
    assert values("lanelock duel -b ") == lanes
    # --lock-dir given before -b: the lanes of that root (none there).
    assert values(f"lanelock probe --lock-dir {tmp_path / 'elsewhere'} -b ") == []


def test_bash_gets_the_words_after_its_own_word_breaks(lanes):
    """bash replaces only the part of `localhost:72` after the colon (COMP_WORDBREAKS)."""
    assert values("lanelock status -b localhost:72", shell="bash", word="72") == ["7201", "7202"]
    assert values("lanelock status -b localhost:", shell="bash", word="") == ["7201", "7202"]
    assert values("lanelock status --backend=localhost:720", shell="bash", word="720") == \
        ["7201", "7202"]
    # zsh and fish keep the whole word.
    assert values("lanelock status -b localhost:72", shell="zsh") == lanes


@pytest.mark.parametrize("line,head", [("lanelock run --lock-dir /tm", ""),
                                       ("lanelock run --lock-dir=/tm", "--lock-dir="),
                                       ("lanelock where --lock-dir /tm", ""),
                                       ("lanelock duel --lock-dir /tm", "")])
def test_lock_dir_completes_directories(line, head):
    assert candidates(line) == [("dir", "/tm", head)]


@pytest.mark.parametrize("line", ["lanelock run -- ech", "lanelock run ech",
                                  "lanelock run -b localhost:8080 -q ech",
                                  "lanelock run -f ech", "lanelock run --fallback=ech",
                                  "lanelock duel -- ech", "lanelock duel --fallback ech",
                                  "X=1 lanelock run -- ech", "lanelock run 'ech"])
def test_commands_complete_from_path(line, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    assert values(line) == ["echo"]


def test_command_names_are_executables_on_path(monkeypatch, tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name, mode in (("ask-local.sh", 0o755), ("ask-notes.txt", 0o644)):
        (bindir / name).write_text("#!/bin/sh\n")
        (bindir / name).chmod(mode)
    (bindir / "ask-dir").mkdir()
    monkeypatch.setenv("PATH", f"{tmp_path / 'missing'}:{bindir}:{bindir}")
    assert values("lanelock run -- ask") == ["ask-local.sh"]
    # A word with a slash is a path: the shell completes it.
    assert candidates("lanelock run -- ./as") == [("file", "./as", "")]


@pytest.mark.parametrize("line", ["lanelock run -- echo ", "lanelock run -- echo -b ",
                                  "lanelock run echo --lock-dir ", "lanelock run -q ls -",
                                  "lanelock duel -- curl -s "])
def test_after_the_command_its_arguments_are_files(line):
    assert [row[0] for row in candidates(line)] == ["file"]


def test_config_set_offers_the_settings():
    from lanelock.settings import SETTINGS

    assert values("lanelock config set ") == list(SETTINGS)
    assert "backend" in values("lanelock config set ba")


def test_pip_installs_the_scripts_where_each_shell_looks():
    """completions/ holds what `lanelock completion SHELL` prints (tests/test_docs.py checks it);
    a system-wide install puts each file where its shell loads completions from."""
    setuptools = tomllib.loads((TOP / "pyproject.toml").read_text())["tool"]["setuptools"]
    data_files = setuptools["data-files"]
    for shell in completion.SHELLS:
        directory, name = INSTALLED[shell].rsplit("/", 1)
        assert COMMITTED[shell] in data_files[directory]
        assert COMMITTED[shell].endswith("/" + name)


# -- real shells in a pseudo-terminal -----------------------------------------------------------
def install_lines() -> dict[str, str]:
    """The README's one install line per shell (its "Shell completion" section)."""
    section = README.read_text().split("\n## Shell completion\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```sh\n(.*?)```", section, re.S).group(1)
    lines = {}
    for line in block.splitlines():
        found = re.search(r"lanelock completion (\w+)", line)
        if found:
            lines[found.group(1)] = line
    assert sorted(lines) == sorted(completion.SHELLS), block
    return lines


SETUP = {
    # bash-completion's loader finds the installed file on the first TAB; without the package,
    # the README says to source the file (bash-sourced: what those users have).
    "bash": ["PS1='PR''OMPT>'; PS2=''",
             f"source {BASH_COMPLETION}" if BASH_COMPLETION.exists()
             else "source ~/.local/share/bash-completion/completions/lanelock"],
    "bash-sourced": ["PS1='PR''OMPT>'; PS2=''",
                     "source ~/.local/share/bash-completion/completions/lanelock"],
    # The README's ~/.zshrc line, then compinit (-D: no dump file); a slash that completion
    # added stays (zsh would otherwise drop it when the next key is typed).
    "zsh": ["PS1='PR''OMPT>'; unsetopt auto_remove_slash; fpath=(~/.zfunc $fpath)",
            "autoload -Uz compinit && compinit -u -D"],
    # --no-config leaves fish_complete_path empty: give back the user directory the README
    # installs into (what a configured fish has first).
    "fish": ["function fish_prompt; echo -n 'PR''OMPT>'; end",
             "set -g fish_complete_path $__fish_config_dir/completions $fish_complete_path"],
}
ARGV = {"bash": ["--norc", "--noprofile", "-i"], "zsh": ["-f", "-i"], "fish": ["--no-config", "-i"]}
LIST_KEY = {"bash": "\x1b?", "zsh": "\x04", "fish": "\t"}   # M-? ; ^D at the end of a line ; TAB


class Shell:
    def __init__(self, name: str, child):
        self.name, self.child = name, child

    def ready(self):
        self.child.expect_exact(MARKER)

    def complete(self, typed: str) -> list[str]:
        """Type TYPED (TABs included), then print the resulting words."""
        self.child.send(typed)
        self.child.send("\x01printf '[%s]\\n' \r")
        self.ready()
        lines = ANSI.sub("", self.child.before).replace("\r", "").split("\n")
        return [line[1:-1] for line in lines if re.fullmatch(r"\[[^\]]*\]", line)]

    def listing(self, typed: str, pattern: str) -> str:
        """Type TYPED and the shell's list key, wait for PATTERN, then abandon the line."""
        self.child.send(typed + LIST_KEY[self.name])
        self.child.expect(pattern)
        shown = self.child.after
        self.child.send("\x03")
        self.ready()
        return shown


@pytest.fixture(params=[*completion.SHELLS, "bash-sourced"])
def shell(request, procs, run_cmd, tmp_path) -> Shell:
    """A real shell with lanelock's completion installed by the README's line for it."""
    pexpect = pytest.importorskip("pexpect")
    setup = SETUP[request.param]
    name = request.param.split("-")[0]
    binary = shutil.which(name)
    if binary is None:
        pytest.skip(f"{name} is not installed")
    assert SCRIPT.exists(), f"no lanelock console script next to {sys.executable}"
    home = tmp_path / "home"
    home.mkdir()
    env = {name: value for name, value in os.environ.items()
           if name.startswith("LANELOCK_")}   # the test's isolated root and configs
    env.update(HOME=str(home), PATH=f"{SCRIPT.parent}:/usr/bin:/bin", TERM="xterm",
               LANG="C.UTF-8", INPUTRC="/dev/null")
    installed = run_cmd(["sh", "-c", install_lines()[name]], env={**env, "EDITOR": None})
    assert installed.returncode == 0, installed.stderr
    child = procs.spawn(pexpect.spawn(binary, ARGV[name], env=env, cwd=str(tmp_path),
                                      encoding="utf-8", timeout=30, dimensions=(24, 200)))
    session = Shell(name, child)
    for line in setup:      # the first sets the prompt: each ends when the marker shows
        child.sendline(line)
        session.ready()
    return session


def test_tab_completes_a_subcommand(shell):
    assert shell.complete("lanelock st\t") == ["lanelock", "status"]


def test_tab_completes_an_option(shell):
    assert shell.complete("lanelock run --lo\t") == ["lanelock", "run", "--lock-dir"]


def test_tab_completes_a_directory_after_lock_dir(shell):
    assert shell.complete("lanelock run --lock-dir /tm\t") == ["lanelock", "run", "--lock-dir",
                                                                "/tmp/"]


def test_tab_completes_a_backend_from_the_existing_lanes(shell, lanelock):
    assert lanelock("run", "-b", "localhost:7201", "--", "true").returncode == 0
    assert shell.complete("lanelock status -b \t") == ["lanelock", "status", "-b", "localhost:7201"]
    # Past the colon (a word break in bash).
    assert shell.complete("lanelock probe -b localhost:72\t") == ["lanelock", "probe", "-b",
                                                                   "localhost:7201"]


def test_the_shell_lists_every_lane(shell, lanes):
    shown = shell.listing("lanelock status -b localhost:720", r"7201\s[\s\S]*7202")
    assert "7201" in shown and "7202" in shown


def test_tab_completes_a_command_name_after_the_double_dash(shell):
    assert shell.complete("lanelock run -- ech\t") == ["lanelock", "run", "--", "echo"]
    # As run's first non-option word, and as a fallback.
    assert shell.complete("lanelock run -q ech\t") == ["lanelock", "run", "-q", "echo"]
    assert shell.complete("lanelock run -f ech\t")[:4] == ["lanelock", "run", "-f", "echo"]


def test_the_commands_arguments_complete_as_files(shell, tmp_path):
    (tmp_path / "prompt-notes.txt").write_text("hi\n")
    assert shell.complete("lanelock run -- cat prompt-n\t") == ["lanelock", "run", "--", "cat",
                                                                 "prompt-notes.txt"]
