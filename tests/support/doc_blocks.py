"""The code blocks of README.md, of the reference pages in docs/ and of the man page's EXAMPLES
section, and KNOWN: each block once, with the test that runs it (in test_examples.py unless named
"FILE::test") or why it cannot run. test_examples.py holds the docs to this list; a test that needs
a block's text asks block(NAME).
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

TOP = Path(__file__).resolve().parents[2]
README = TOP / "README.md"
DOCS = TOP / "docs"
MAN = TOP / "man" / "lanelock.1"


def doc_pages() -> list[Path]:
    """The reference pages (docs/*.md), in name order."""
    return sorted(DOCS.rglob("*.md"))


def page(name: str) -> str:
    """The text of docs/NAME."""
    return (DOCS / name).read_text()


def docs_text() -> str:
    """README.md and every reference page: what a reader of the docs can find."""
    return "\n".join(path.read_text() for path in [README, *doc_pages()])


# -- the blocks ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Block:
    file: str       # README.md, docs/PAGE.md or lanelock.1
    line: int       # where it starts
    lang: str       # the fence's language (markdown), "" for the man page
    text: str       # as the reader sees it (roff escapes undone, a list item's indent removed)

    def __str__(self):
        return f"{self.file}:{self.line} ({self.lang or 'no language'})"


# A fence at any indent (a block inside a list item is indented with it), closed at the same one.
FENCE = re.compile(r"^([ \t]*)```(\w*)\n(.*?)^\1```[ \t]*$", re.M | re.S)


def markdown_blocks(path: Path) -> list[Block]:
    text = path.read_text()
    name = str(path.relative_to(TOP))
    return [Block(name, text.count("\n", 0, match.start()) + 1, match.group(2),
                  textwrap.dedent(match.group(3)) if match.group(1) else match.group(3))
            for match in FENCE.finditer(text)]


def readme_blocks() -> list[Block]:
    return markdown_blocks(README)


def docs_blocks() -> list[Block]:
    return [block for path in doc_pages() for block in markdown_blocks(path)]


ROFF = {"-": "-", "e": "\\", "&": "", " ": " ", "(aq": "'", "(dq": '"', "(ti": "~", "(ha": "^",
        "(rs": "\\"}


def unroff(line: str) -> str:
    """A line of an .nf/.EX block as the reader sees it; an escape not known here fails."""
    def escape(match):
        if match.group(1) not in ROFF:
            raise AssertionError(f"roff escape \\{match.group(1)} in an example: teach unroff()")
        return ROFF[match.group(1)]
    return re.sub(r"\\(\(..|.)", escape, line)


def man_blocks() -> list[Block]:
    """The .nf/.fi and .EX/.EE blocks of the man page's EXAMPLES section."""
    lines = MAN.read_text().splitlines()
    start = lines.index(".SH EXAMPLES")
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith(".SH "))
    blocks, current, first = [], None, 0
    for number in range(start + 1, end):
        line = lines[number]
        if line in (".nf", ".EX"):
            current, first = [], number + 2
        elif line in (".fi", ".EE") and current is not None:
            blocks.append(Block("lanelock.1", first, "", "".join(f"{part}\n" for part in current)))
            current = None
        elif current is not None:
            assert not line.startswith((".", "'")), \
                f"lanelock.1:{number + 1}: a roff request inside an example"
            current.append(unroff(line))
    return blocks


def all_blocks() -> list[Block]:
    return readme_blocks() + docs_blocks() + man_blocks()


@dataclass(frozen=True)
class Known:
    name: str
    file: str
    pattern: str            # a regex the block's text matches (re.M)
    test: str = ""          # the test that runs it ("test_completion.py::name" for another file)
    not_run: str = ""       # what is not run here, and why

    def matches(self, block: Block) -> bool:
        return block.file == self.file and re.search(self.pattern, block.text, re.M) is not None


KNOWN = [
    # README.md
    Known("quickstart", "README.md", r"^python3 -m venv \.venv && \.venv/bin/pip install \. ",
          test="test_quickstart_duel",
          not_run="the venv and pip installs (network, minutes) and the test suite itself (this is "
                  "it); the duel runs with the installed console script"),
    Known("llm-entry", "README.md", r"^- model_id: local\n",
          test="test_readme_recipes.py::test_the_llm_entry_points_llm_at_the_engine"),
    Known("run-with-fallback", "README.md", r"^lanelock run --backend 127\.0\.0\.1:8080 --fallback",
          test="test_run_with_a_fallback"),
    Known("busy-line", "README.md", r"\Alanelock: local_backend_busy: ",
          test="test_run_with_a_fallback"),        # the line a deflection prints, compared there
    Known("cron", "README.md", r"^\*/10 \* \* \* \* ", test="test_cron_line"),
    Known("shell-fallback", "README.md", r"^lanelock run -q .*\./ask-local\.sh",
          test="test_shell_script"),
    Known("systemd-run", "README.md", r"^\[Service\]\nExecStart=\S+ run ",
          test="test_systemd_unit_command"),
    Known("agents-recipe", "README.md", r"^llama-server .*\nlanelock seats ",
          test="test_readme_recipes.py::test_the_several_agents_recipe_runs_as_written",
          not_run="llama-server itself (no model here): the stand-in engine serves its port with "
                  "as many slots as its --parallel"),
    Known("openai-client", "README.md", r"^client = OpenAI\(base_url=",
          test="test_readme_recipes.py::test_the_several_agents_recipe_runs_as_written"),
    Known("claude-code", "README.md", r"^export ANTHROPIC_BASE_URL=",
          test="test_readme_recipes.py::test_claude_code_and_codex_settings_reach_the_proxy",
          not_run="Claude Code itself (not installed here): the anthropic SDK, which reads the "
                  "same variables, sends its request"),
    Known("codex", "README.md", r"^\[model_providers\.lanelock\]",
          test="test_readme_recipes.py::test_claude_code_and_codex_settings_reach_the_proxy",
          not_run="Codex itself (not installed here): a Responses request to the provider's "
                  "base_url, as Codex sends it, goes through the proxy"),
    Known("hosts", "README.md", r"^lanelock config set --system store postgresql://",
          test="test_readme_recipes.py::test_the_several_hosts_recipe_runs_as_written",
          not_run="a second host: the commands run on this one against a PostgreSQL server"),
    Known("completion", "README.md", r"lanelock completion bash > ",
          test="test_completion.py::shell"),   # each line installs the script a real shell loads
    # docs/
    Known("python-loop", "docs/python.md", r"^with gate\.turn\(session=", test="test_python_api"),
    Known("asyncio", "docs/python.md", r"^async def answer", test="test_asyncio_agents"),
    Known("nested", "docs/python.md", r"env=\{\*\*os\.environ, \*\*turn\.env\}",
          test="test_nested_turns"),
    Known("proxy", "docs/proxy.md", r"^lanelock proxy -b .*--fallback ", test="test_proxy_recipe",
          not_run="a deflection to api.openai.com (network)"),
    Known("turn-headers", "docs/proxy.md", r"default_headers=turn\.headers",
          test="test_turn_headers_through_the_proxy"),
    Known("proxy-seats", "docs/proxy.md", r"^lanelock proxy --pin-slots -b 127\.0\.0\.1:8080 ",
          test="test_proxy_seats.py::test_the_readme_proxy_seats_block"),
    Known("proxy-unit", "docs/proxy.md", r"^\[Unit\]\nDescription=lanelock proxy",
          test="test_systemd_units_verify",
          not_run="starting it as a service (no systemd here); the proxy itself runs in "
                  "test_proxy_recipe"),
    Known("proxy-config", "docs/proxy.md", r"^# /etc/lanelock/config\.toml \(or ",
          test="test_proxy_service.py::test_the_readme_config_file_and_unit_run_a_proxy",
          not_run="a deflection to api.openai.com (network)"),
    Known("unseen-line", "docs/witness.md", r"^lanelock: unseen generation on ",
          test="test_watch_unit_and_its_unseen_line"),   # the line a witness prints, compared there
    Known("watch-unit", "docs/witness.md", r"^\[Unit\]\nDescription=lanelock watch",
          test="test_watch_unit_and_its_unseen_line",
          not_run="starting it as a service (no systemd here); systemd-analyze verifies the file "
                  "and its ExecStart runs as systemd would run it"),
    Known("tmpfiles-root", "docs/lanes.md", r"^# /etc/tmpfiles\.d/lanelock\.conf\n",
          test="test_threat.py::test_the_readme_tmpfiles_line_makes_a_default_root_no_one_can_squat"),
    Known("models-map", "docs/lanes.md", r"^lanelock models -b 127\.0\.0\.1:8080 share ",
          test="test_model_lanes.py::test_the_readme_model_map_block"),
    Known("seats-count", "docs/lanes.md", r"^lanelock seats -b 127\.0\.0\.1:8080 2 ",
          test="test_seats.py::test_the_readme_seats_block"),
    Known("seated-views", "docs/lanes.md",
          r"^\$ lanelock status\nlocalhost:8080: 2 of 2 seats held",
          test="test_seat_views.py::test_the_readme_seated_views_block"),
    Known("metrics-cron", "docs/metrics.md", r"^\* \* \* \* \* \S+ metrics ",
          test="test_metrics_textfile_cron_line"),
    Known("scrape-config", "docs/metrics.md", r"^scrape_configs:\n  - job_name: lanelock-proxy",
          test="test_scrape_config",
          not_run="scraping itself: test_metrics.py's real Prometheus scrapes a proxy with it"),
    Known("alert-rule", "docs/metrics.md", r"^groups:\n  - name: lanelock\n", test="test_alert_rule",
          not_run="a running Alertmanager: promtool evaluates the rule on real scrapes instead"),
    # the man page's EXAMPLES
    Known("man-cron", "lanelock.1", r"^\*/10 \* \* \* \* ", test="test_cron_line"),
    Known("man-shell-fallback", "lanelock.1", r"^lanelock run -q .*\./ask-local\.sh",
          test="test_shell_script"),
    Known("man-systemd", "lanelock.1", r"^\[Service\]\nExecStart=",
          test="test_systemd_unit_command"),
    Known("man-python", "lanelock.1", r"^from lanelock import Gate\nwith .*\n    answer",
          test="test_python_api"),
    Known("man-nested", "lanelock.1", r"env=\{\*\*os\.environ, \*\*turn\.env\}",
          test="test_nested_turns"),
    Known("man-turn-headers", "lanelock.1", r"default_headers=turn\.headers",
          test="test_turn_headers_through_the_proxy"),
]
# Not code blocks, and not run here (the inline recipes that can run are tested at the end of
# test_examples.py: --wait, the fallback chain). Each must still be where it is said to be, so this
# list cannot go stale.
NOT_RUN_INLINE = {
    ("docs/lanes.md", "`docker run -v /run/lock/lanelock:/run/lock/lanelock"): "no Docker here",
    ("docs/benchmarks.md", "| on / off | 1.024 | >= 0.99 | PASS |"):
        "a table of minutes of the real engine (bench/witness.py)",
    ("docs/benchmarks.md", "| (b) a 2nd session generates ungated on the same server |"):
        "the real-engine table: llama.cpp and a model (pytest -m real, bench/real_engine.py)",
    ("docs/benchmarks.md", "| 1. `lanelock run -- true` / `python -c 'import click'`"):
        "the benchmark table: minutes of timing runs on a quiet machine (bench/bench.py)",
}


def block(name: str) -> Block:
    known = next(entry for entry in KNOWN if entry.name == name)
    found = [candidate for candidate in all_blocks() if known.matches(candidate)]
    assert len(found) == 1, f"{name}: {len(found)} blocks match {known.pattern!r}"
    return found[0]
