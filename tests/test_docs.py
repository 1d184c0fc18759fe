"""README, the reference pages in docs/, --help, the man page and the completions stay in step
with the CLI and with each other: the man page is the complete command reference, the README names
every command and links to the pages, and the pages build as a site whose every link resolves."""

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
from support.doc_blocks import DOCS, MAN, README, TOP, doc_pages, docs_text


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
    """The man page is the complete reference: every command and every option. The README names
    every command (its table), not every option: it links to the man page for those."""
    text, readme = man_text(), README.read_text()
    assert re.search(rf"\b{re.escape(path[-1])}\b", text), f"{path} missing from the man page"
    assert f"lanelock {' '.join(path)}" in readme or f"`{path[-1]}" in readme
    for option in long_options(command):
        assert option in text, f"{option} of {' '.join(path)} missing from the man page"


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
    text, docs = man_text(), docs_text()
    for name in sorted(names):
        assert name in text, f"{name} missing from the man page"
        assert name in docs, f"{name} missing from README.md and docs/ (docs/running.md lists them)"


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
    """The man SYNOPSIS and README's table of commands name every top-level command, and the
    table names nothing else."""
    man = MAN.read_text()
    synopsis = man.split(".SH SYNOPSIS\n", 1)[1].split("\n.SH ", 1)[0]
    listed = README.read_text().split("\n## Commands\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `lanelock (\w+)", listed, re.M)
    top = sorted(path[0] for path, _ in commands() if len(path) == 1)
    for name in top:
        assert f".B lanelock {name}\n" in synopsis, f"{name} missing from SYNOPSIS"
    assert sorted(rows) == top, f"README's table of commands: {sorted(rows)}, the CLI: {top}"


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


# -- the docs site ----------------------------------------------------------------------------------
def test_the_docs_build_as_a_site_with_every_link_and_anchor_resolved(tmp_path):
    """`mkdocs build --strict` (what CI runs): a link to a page or an anchor that is not there, a
    page left out of the navigation, is an error."""
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
                            "--config-file", TOP / "mkdocs.yml", "--site-dir", tmp_path / "site"],
                           capture_output=True, text=True, cwd=TOP, timeout=120,
                           env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert built.returncode == 0, built.stdout + built.stderr
    assert (tmp_path / "site" / "proxy" / "index.html").exists()


def anchors(path: Path) -> set[str]:
    """The anchors of a markdown file's headings, as MkDocs (Python-Markdown's toc) makes them;
    GitHub makes the same ones for these headings."""
    from markdown.extensions.toc import slugify

    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    return {slugify(re.sub(r"[`*]", "", title), "-")
            for title in re.findall(r"^#{1,6} +(.+?) *$", text, re.M)}


def test_every_link_of_the_readme_resolves():
    """MkDocs checks the pages' links; the README is not one of them. Each relative link names a
    file of the checkout, and each anchor a heading of its file."""
    pytest.importorskip("markdown")
    problems = []
    for target in re.findall(r"\]\(([^)\s]+)\)", README.read_text()):
        if re.match(r"\w+://", target):
            continue
        name, _, anchor = target.partition("#")
        path = (TOP / name) if name else README
        if not path.exists():
            problems.append(f"{target}: no file {name}")
        elif anchor and anchor not in anchors(path):
            problems.append(f"{target}: no heading of {path.name} makes #{anchor}")
    assert not problems, "\n".join(problems)


def test_the_architecture_page_names_every_module_and_no_other():
    """docs/architecture.md cannot go stale: every module under lanelock/ is named on it by its
    path, and every lanelock/ path it names exists."""
    text = (DOCS / "architecture.md").read_text()
    named = set(re.findall(r"`(lanelock/[\w/.]+\.py)`", text))
    modules = {str(path.relative_to(TOP)) for path in (TOP / "lanelock").rglob("*.py")}
    assert not modules - named, f"add to docs/architecture.md: {sorted(modules - named)}"
    assert not named - modules, f"gone, remove from docs/architecture.md: {sorted(named - modules)}"
    folders = set(re.findall(r"`(lanelock/[\w/]+/)`", text))
    assert all((TOP / folder).is_dir() for folder in folders), folders


def docs_and_man() -> dict[str, str]:
    return {str(path.relative_to(TOP)): path.read_text() for path in [README, *doc_pages(), MAN]}


def test_the_docs_cite_no_tracker_of_ours():
    """History belongs in git log: the docs say what is, not which of our issues made it so (a
    public upstream issue is cited by its repository: ggml-org/llama.cpp#14262)."""
    others = [*(TOP / "docs").glob("*.json"), *(TOP / "bench").glob("*.py")]
    texts = {**docs_and_man(), **{str(path.relative_to(TOP)): path.read_text() for path in others}}
    for name, text in texts.items():
        for words in re.findall(r"\b(?:issues? \d+|PITFALLS[^\n]{0,20})", text, re.I):
            raise AssertionError(f"{name}: {words!r}")


def test_install_words_work_from_a_clone():
    """pip cannot find 'lanelock[proxy]' (lanelock is installed from its checkout): the docs say
    '.[proxy]', and so does the proxy when aiohttp is missing."""
    for name, text in docs_and_man().items():
        assert not re.search(r"pip install \S*lanelock\[", text.replace("\\(aq", "'")), name
    without_aiohttp = ("import sys; sys.modules['aiohttp'] = None; sys.argv = ['lanelock', 'proxy']; "
                       "from lanelock.__main__ import entry; entry()")
    done = subprocess.run([sys.executable, "-c", without_aiohttp], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == exitcodes.USAGE, done.stderr
    assert "pip install '.[proxy]'" in done.stderr, done.stderr
