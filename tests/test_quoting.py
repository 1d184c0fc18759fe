"""The fallback splitter reads bash's quoting: whatever real bash's `printf %q`
writes for a prompt -- `$'…'` as soon as the prompt has a newline, a tab or any control
character -- comes back as that prompt, byte for byte, so README's recipe
`--fallback "cmd $(printf %q "$PROMPT")"` carries any prompt. Every other line reads as shlex read
it before. Bash itself is the oracle: no expected value here is written by hand."""

from __future__ import annotations

import os
import shlex
import sys

import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

from lanelock.run import chain

FIXTURES_OK = settings(suppress_health_check=[HealthCheck.function_scoped_fixture],
                       deadline=None, database=None)

# Text a prompt can hold: any character a command line can carry (no NUL, no lone surrogate),
# the shell's own punctuation often, and bytes that are not UTF-8 (as argv decodes them: U+DC80-FF).
SHELLISH = "\n\t\r\x1b\x7f\x01 '\"$\\`!#~*?[]{}()<>|&;=%^@,.:-_"
CHARS = st.one_of(st.characters(exclude_categories=("Cs",), exclude_characters="\x00"),
                  st.sampled_from(SHELLISH),
                  st.characters(min_codepoint=0xDC80, max_codepoint=0xDCFF))
TEXTS = st.lists(st.text(CHARS, max_size=40), min_size=1, max_size=25)


def printf_q(run_cmd, texts: list[str], locale: str) -> list[str]:
    """What real bash's `printf %q` writes for each text: one bash for the lot, NUL-separated."""
    done = run_cmd(["bash", "-c", 'for arg; do printf "%q\\0" "$arg"; done', "bash", *texts],
                   env={"LC_ALL": locale})
    assert done.returncode == 0, done.stderr
    quoted = done.stdout.split("\0")[:-1]
    assert len(quoted) == len(texts)
    return quoted


def as_bytes(words) -> list[bytes]:
    """argv as exec(2) gets it: the comparison is on bytes (U+DC80-FF are the bytes 80-FF)."""
    return [os.fsencode(word) for word in words]


@pytest.mark.parametrize("locale", ["C.UTF-8", "C"])   # C: bash writes every non-ASCII byte \NNN
@FIXTURES_OK
@given(texts=TEXTS)
def test_what_bash_printf_q_writes_comes_back_byte_exact(run_cmd, locale, texts):
    quoted = printf_q(run_cmd, texts, locale)
    for text, word in zip(texts, quoted):
        assert as_bytes(chain.parse(f"cmd {word}").argv) == as_bytes(["cmd", text]), word
    # The recipe's shape: several quoted words on one fallback line.
    assert as_bytes(chain.parse("llm -m gpt-4o-mini " + " ".join(quoted)).argv) == \
        as_bytes(["llm", "-m", "gpt-4o-mini", *texts])


# -- $'…' read exactly as bash reads it, every escape ------------------------------------------
# A body is plain characters (no quote, no backslash) and escapes: a backslash and any character,
# followed often by what escapes take (octal and hex digits, braces), so \NNN, \xHH, \x{…},
# \uHHHH, \UHHHHHHHH, \cX, \c\\ and the unknown ones (\q, \8, \x alone) all come up. Left out:
# raw bytes 01 and 7f, bash's internal quoting markers (CTLESC, CTLNUL), which show through after a
# backslash in bash 5.2 ($'\<01>' and $'\c<01>' give 01 twice, $'\c<7f>' gives 01 7f); `printf %q`
# never writes them raw (it writes \001 and \177, which are in here).
RAW = dict(exclude_categories=("Cs",), exclude_characters="\x00\x01\x7f'\\")
PLAIN = st.one_of(st.sampled_from("0123456789abcdefABCDEF{}?xuUc \n\t"), st.characters(**RAW))
ESCAPE = st.builds("\\".__add__, st.one_of(st.sampled_from("abeEfnrtv\\'\"?01234567xuUc8q{"),
                                           st.characters(**RAW)))
BODY = st.lists(st.one_of(PLAIN, ESCAPE, ESCAPE), max_size=12).map("".join)
ANSI_WORD = st.tuples(st.sampled_from(["", "pre", "'q'"]), BODY, st.sampled_from(["", "post"])) \
    .map(lambda parts: f"{parts[0]}$'{parts[1]}'{parts[2]}")


def bash_words(run_cmd, words: list[str]) -> list[bytes]:
    """The words as bash reads them from a script, as bytes (od: they need not be UTF-8)."""
    script = "printf '%s\\0' " + " ".join(words) + " | od -An -v -tx1"
    done = run_cmd(["bash", "-c", script], env={"LC_ALL": "C.UTF-8"})
    assert done.returncode == 0, (script, done.stderr)
    return bytes.fromhex("".join(done.stdout.split())).split(b"\0")[:-1]


@FIXTURES_OK
@given(words=st.lists(ANSI_WORD, min_size=1, max_size=20))
@example(words=["$'\\U0010FFFF'", "$'a\\U0110000b'", "$'\\U7FFFFFFFb'", "$'a\\UFFFFFFFFb'",
                "$'\\ud800\\uDFFF'", "$'\\x{41z'", "$'\\x{}z'", "$'\\x4142'", "$'\\c\\\\\\\\'",
                "$'\\c'", "$'\\c?\\c@z'", "$'\\cé'", "$'a\\0b'x", "$'\\777\\400z'", "$'\\8\\q'"])
def test_ansi_c_quoting_reads_as_bash_reads_it(run_cmd, words):
    expected = bash_words(run_cmd, words)
    assert as_bytes(chain.parse("cmd " + " ".join(words)).argv[1:]) == expected, words


# -- nothing that read before reads differently ---------------------------------------------------
@settings(max_examples=2000, deadline=None, database=None)
@given(text=st.text(st.sampled_from("ab \t\n'\"\\$#é"), max_size=14))
def test_without_ansi_c_quoting_it_splits_as_shlex_did(text):
    """shlex.split (POSIX) was the splitter: every line without `$'` splits the same, and a line
    it refused is still refused."""
    from lanelock.run import words

    if "$'" in text:
        return
    try:
        before = shlex.split(text)
    except ValueError:
        with pytest.raises(ValueError):
            words.split(text)
        return
    assert words.split(text) == before


@settings(max_examples=500, deadline=None, database=None)
@given(argv=TEXTS)
def test_the_line_lanelock_prints_reads_back_as_the_argv(argv):
    """A fallback's argv shown in the deflection line is one printable line, and pasting it back
    as a --fallback gives the same argv."""
    from lanelock.run import words

    line = words.join(argv)
    assert line.isprintable()
    assert as_bytes(words.split(line)) == as_bytes(argv)


# -- the README's recipe, through real bash and a held lane ----------------------------------------
PROMPT = ("Summarise this:\n\tline two has a tab, \"double\" and 'single' quotes, $HOME and `date`,\n"
          "a back\\slash, a dollar $'…' of its own, ünïcödé ☃, an escape \x1b[0m and a CR\r\nend")
SHOW_ARGV = "import sys; print(ascii(sys.argv[1:]))"


def test_the_readme_recipe_carries_a_multiline_prompt_to_the_fallback(holder, run_cmd):
    held = holder("-b", "127.0.0.1:8080")
    recipe = ('lanelock() { "$PYTHON" -m lanelock "$@"; }\n'
              f'lanelock run --backend 127.0.0.1:8080 --fallback "$PYTHON -c \'{SHOW_ARGV}\' '
              '$(printf %q "$PROMPT")" -- "$PYTHON" -c "raise SystemExit(9)" "$PROMPT"')
    busy = run_cmd(["bash", "-c", recipe], env={"PYTHON": sys.executable, "PROMPT": PROMPT})
    assert busy.returncode == 0, busy.stderr
    assert busy.stdout == ascii([PROMPT]) + "\n"   # ascii(): byte-exact, \r and all
    [line] = busy.stderr.splitlines()
    assert "deflecting to fallback 1" in line
    assert held.release() == 0


@pytest.mark.parametrize("fallback", ["echo $'unclosed", "echo $'a\\'", "echo 'a' $'b"])
def test_an_unclosed_ansi_c_quote_is_a_usage_error(lanelock, tmp_path, fallback):
    marker = tmp_path / "ran"
    done = lanelock("run", "--fallback", fallback, "--", "touch", marker)
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.splitlines()
    assert line.startswith("lanelock: --fallback") and "closing quotation" in line
    assert not marker.exists()


def test_a_chain_command_that_does_not_split_is_a_usage_error(lanelock, config_files, tmp_path):
    """A config chain's command string goes through the same splitter; one it cannot split is a
    usage error naming the chain (it was an internal error, exit 70)."""
    _, user = config_files
    user.write_text('[[chains.cloud]]\ncommand = "echo \'unclosed"\n')
    marker = tmp_path / "ran"
    done = lanelock("run", "--chain", "cloud", "--", "touch", marker)
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.splitlines()
    assert line.startswith("lanelock: chain 'cloud'") and "closing quotation" in line
    assert not marker.exists()
