"""TOML configuration: round trip, line-numbered errors, validation that leaves the file alone,
and the JSON of every read command."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

from support.cli import LANELOCK


def show(lanelock) -> dict:
    done = lanelock("config", "show", "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["settings"]


@pytest.mark.parametrize("key,text,value", [
    ("grace", "0.2", 0.2), ("busy_exit_code", "9", 9), ("backend", "localhost:8081", "localhost:8081"),
    ("key_by", "model", "model"), ("gate", "never", "never"), ("wait", "5", 5),
    ("journal_max_bytes", "65536", 65536), ("model", "qwen2.5:7b", "qwen2.5:7b"),
    ("chains", '{cloud = [{command = "llm -m x"}, {backend = "127.0.0.1:8081", command = ["a", "b"]}]}',
     {"cloud": [{"command": "llm -m x"}, {"backend": "127.0.0.1:8081", "command": ["a", "b"]}]}),
])
def test_set_then_show_round_trip(lanelock, config_files, key, text, value):
    _, user = config_files
    done = lanelock("config", "set", key, text)
    assert done.returncode == 0, done.stderr
    assert show(lanelock)[key] == {"value": value, "source": f"user file {user}"}


@pytest.mark.parametrize("key,text", [("grace", "-1"), ("busy_exit_code", "256"), ("bogus", "1"),
                                      ("key_by", "host"), ("chains", "[1, 2]"), ("gate", "maybe")])
def test_bad_set_is_a_usage_error_and_leaves_the_file_untouched(lanelock, config_files, key, text):
    _, user = config_files
    user.write_text("# mine\ngrace = 0.1\n")
    before = user.read_bytes()
    done = lanelock("config", "set", key, text)
    assert done.returncode == 2
    assert done.stderr.startswith("lanelock: ") and len(done.stderr.strip().splitlines()) == 1
    assert user.read_bytes() == before


# -- config set edits the file in place: comments, spacing and order stay -------
HAND_WRITTEN = """\
# lanelock settings for this workstation
#   edited by hand: keep the comments

backend   =   "localhost:8080"   # the llama-swap port
grace=0.1 # seconds
key_by = 'model'

# --- where a busy lane's turns go ---
[[chains.local]]
backend = "127.0.0.1:8081"   # the small model
command = ["llm", "-m", "local-small"]

\t# an indented comment between tables
[[chains.cloud]]
command = "llm -m gpt-4o-mini"

# the end
"""


@pytest.mark.parametrize("system", [False, True], ids=["user", "system"])
def test_set_keeps_a_hand_written_files_comments_and_layout(lanelock, config_files, system):
    path = config_files[0] if system else config_files[1]
    path.write_text(HAND_WRITTEN)
    path.chmod(0o600)
    flags = ["--system"] if system else []

    assert lanelock("config", "set", "grace", "0.25", *flags).returncode == 0
    changed = HAND_WRITTEN.replace("grace=0.1 # seconds", "grace=0.25 # seconds")
    assert path.read_text() == changed          # only the value moved, its comment stayed

    assert lanelock("config", "set", "wait", "5", *flags).returncode == 0
    added = changed.replace("key_by = 'model'\n", "key_by = 'model'\nwait = 5\n")
    assert path.read_text() == added            # one line, after the last top-level key
    assert path.stat().st_mode & 0o777 == 0o600

    settings = show(lanelock)
    source = f"{'system' if system else 'user'} file {path}"
    assert settings["grace"] == {"value": 0.25, "source": source}
    assert settings["wait"] == {"value": 5, "source": source}
    assert settings["key_by"]["value"] == "model"
    assert settings["chains"]["value"] == {
        "local": [{"backend": "127.0.0.1:8081", "command": ["llm", "-m", "local-small"]}],
        "cloud": [{"command": "llm -m gpt-4o-mini"}]}


def test_set_in_a_file_of_tables_only_keeps_every_line(lanelock, config_files):
    _, user = config_files
    original = "# chains only\n\n[[chains.cloud]]\ncommand = 'llm'  # cloud\n"
    user.write_text(original)
    assert lanelock("config", "set", "grace", "0.3").returncode == 0
    lines = user.read_text().splitlines()
    assert [line for line in lines if line.strip() not in ("", "grace = 0.3")] == \
        [line for line in original.splitlines() if line.strip()]
    assert lines.count("grace = 0.3") == 1
    assert show(lanelock)["grace"]["value"] == 0.3


@pytest.mark.parametrize("broken", [
    b"grace = \n", b"grace = 0.1\ngrace = 0.2\n", b"[[chains.cloud]\ncommand = 'x'\n",
    b"# caf\xe9\ngrace = 0.1\n", b'store = "soon"\n',
], ids=["no-value", "duplicate-key", "bad-header", "not-utf8", "invalid-store"])
def test_set_on_a_file_that_does_not_parse_leaves_it_alone(lanelock, config_files, broken):
    _, user = config_files
    user.write_bytes(broken)
    done = lanelock("config", "set", "wait", "5")
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.splitlines()
    assert line.startswith(f"lanelock: {user}")
    assert user.read_bytes() == broken


def test_user_file_cannot_set_the_lock_root(lanelock, config_files, tmp_path):
    system, user = config_files
    assert lanelock("config", "set", "lock_dir", str(tmp_path / "mine")).returncode == 2
    user.write_text(f'lock_dir = "{tmp_path / "mine"}"\n')
    where = lanelock("where", "--json", env={"LANELOCK_DIR": None})
    info = json.loads(where.stdout)
    assert info["root_source"] != "user-config" and str(tmp_path / "mine") not in info["lock_path"]
    assert "IGNORED" in where.stderr and str(user) in where.stderr
    assert lanelock("config", "set", "lock_dir", str(tmp_path / "sys"), "--system").returncode == 0
    where = lanelock("where", "--json", env={"LANELOCK_DIR": None})
    assert json.loads(where.stdout)["root"] == str(tmp_path / "sys")
    assert json.loads(where.stdout)["root_source"] == "system-config"


def test_invalid_config_reports_file_and_line(lanelock, config_files):
    system, _ = config_files
    system.write_text('backend = "localhost:8080"\n\nstore = "soon"\n')
    done = lanelock("where")
    assert done.returncode == 2
    assert f"{system}: line 3:" in done.stderr
    system.write_text('backend = "localhost:8080"\n\ngrace = "soon"\n')
    done = lanelock("where")   # a safe setting's bad value is its default, with one warning
    assert done.returncode == 0 and f"{system}: line 3:" in done.stderr
    system.write_text('backend = "localhost:8080"\ngrace = \n')
    done = lanelock("status")
    assert done.returncode == 2 and str(system) in done.stderr and "line 2" in done.stderr


def test_config_values_take_effect(lanelock, config_files, holder):
    system, user = config_files
    user.write_text('busy_exit_code = 9\n[[chains.cloud]]\ncommand = "echo from-chain"\n')
    held = holder()
    assert lanelock("run", "--", "true").returncode == 9
    chained = lanelock("run", "--chain", "cloud", "--", "true")
    assert chained.returncode == 0 and chained.stdout.strip() == "from-chain"
    assert lanelock("run", "--chain", "nope", "--", "true").returncode == 2
    assert held.release() == 0


def test_config_path(lanelock, config_files):
    system, user = config_files
    data = json.loads(lanelock("config", "path", "--json").stdout)
    assert data == {"system": {"path": str(system), "exists": False},
                    "user": {"path": str(user), "exists": False}}


# Every read command's --json keys: documented in docs/json.md, stable.
READ_COMMANDS = {
    ("where",): {"lane", "backend", "scope", "gated", "store", "root", "root_source", "root_detail",
                 "lock_path", "sidecar_path", "journal_path", "config_files", "warnings"},
    ("probe",): {"lane", "lock_path", "gated", "state"},
    ("status",): {"lanes"},
    ("history",): {"lane", "events", "summary", "unreadable_lines"},
    ("config", "show"): {"settings", "files", "ignored"},
    ("config", "path"): {"system", "user"},
}


@pytest.mark.parametrize("command", sorted(READ_COMMANDS), ids=" ".join)
def test_json_keys_are_stable_and_documented(lanelock, command):
    assert lanelock("run", "--", "true").returncode == 0
    done = lanelock(*command, "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert READ_COMMANDS[command] <= set(data)
    readme = (Path(__file__).resolve().parent.parent / "docs" / "json.md").read_text()
    for key in READ_COMMANDS[command]:
        assert f"`{key}`" in readme, f"{key} of {' '.join(command)} --json is not in docs/json.md"
    if command == ("status",):
        lane_keys = {"lane", "lock_path", "state", "verdict", "message", "holders", "waiters",
                     "kernel_source", "holder", "last", "sidecar_problem", "exists", "sidecar_path"}
        assert lane_keys <= set(data["lanes"][0])
        for key in lane_keys:
            assert f"`{key}`" in readme
    if command == ("history",):
        for key in ("turns", "local", "deflected", "fail_open", "deflection_rate", "busy_fraction",
                    "longest_hold", "way_back"):
            assert key in data["summary"] and f"`{key}`" in readme


def test_no_color_and_dumb_terminal_give_plain_text(lanelock, procs):
    import pexpect

    lanelock("run", "--", "true")
    for extra in ({"NO_COLOR": "1"}, {"TERM": "dumb"}):
        env = dict(os.environ, **extra)
        child = procs.spawn(pexpect.spawn(sys.executable, ["-m", "lanelock", "status"], env=env,
                                          timeout=30))
        child.expect(pexpect.EOF)
        output = child.before.decode()
        child.close()
        colours = re.findall(r"\x1b\[[0-9;]*(?:3[0-9]|9[0-7]|38;)[0-9;]*m", output)
        assert colours == [], (extra, repr(output))
        if extra.get("TERM") == "dumb":
            assert "\x1b[" not in output


def test_version(lanelock):
    done = lanelock("--version")
    assert done.returncode == 0 and done.stdout.startswith("lanelock, version ")


# -- a relative lock root is refused -----------------------------------------------
# LANELOCK_DIR=locks, --lock-dir locks and a file's lock_dir = "locks" made one gate per working
# directory. Every spelling, asked from two working directories: the read commands exit 2 with one
# line naming the setting and where it came from, `run` fails open with one warning (the command's
# exit status kept), and nothing is created in either directory. `~` is not expanded (a root that
# followed HOME would be one gate per user): it is refused like any relative path.
RELATIVE_ROOTS = ["env", "env-tilde", "flag", "flag-tilde", "system-file"]


def relative_root(spelling: str, config_files) -> tuple[dict, list, list]:
    """(environment, flags, the words the refusal must name) for a relative root so spelled."""
    system, user = config_files
    value = "~/locks" if spelling.endswith("tilde") else "locks"
    if spelling.startswith("env"):
        return {"LANELOCK_DIR": value}, [], [f"LANELOCK_DIR={value} is relative"]
    if spelling.startswith("flag"):
        return {"LANELOCK_DIR": None}, ["--lock-dir", value], [f"--lock-dir {value} is relative"]
    system.write_text(f'# the lanes\nlock_dir = "{value}"\n')
    return {"LANELOCK_DIR": None}, [], [f"{system}: line 2:", "'lock_dir'", "is relative"]


@pytest.mark.parametrize("spelling", RELATIVE_ROOTS)
def test_a_relative_lock_root_is_refused(spelling, lanelock, config_files, tmp_path):
    env, flags, names = relative_root(spelling, config_files)
    for place in ("here", "there"):
        cwd = tmp_path / place
        cwd.mkdir()
        ran = lanelock("run", *flags, "--", "sh", "-c", 'echo "$LANELOCK_STATE"; exit 7',
                       env=env, cwd=cwd)
        assert (ran.returncode, ran.stdout) == (7, "fail-open\n"), ran
        (warning,) = ran.stderr.splitlines()
        assert warning.startswith("lanelock: warning: gate unavailable ("), warning
        assert all(words in warning for words in names), warning
        for command in ("probe", "where", "status", "history", "metrics"):
            done = lanelock(command, *flags, env=env, cwd=cwd)
            assert (done.returncode, done.stdout) == (2, ""), (command, done)
            (line,) = done.stderr.splitlines()
            assert line.startswith("lanelock: ") and "absolute path" in line, (command, line)
            assert all(words in line for words in names), (command, line)
        assert list(cwd.iterdir()) == [], "a gate was made in the working directory"


def test_a_relative_lock_root_in_a_user_file_is_ignored_like_any_user_lock_root(
        lanelock, config_files, lock_dir):
    """A user file may never move the gate, so its lock_dir -- relative or not -- is ignored
    with a note; it must not spoil the rest of the file (a refused file ungates every turn)."""
    _, user = config_files
    user.write_text('lock_dir = "locks"\nbusy_exit_code = 99\n')
    ran = lanelock("run", "--", "printenv", "LANELOCK_STATE")
    assert (ran.returncode, ran.stdout) == (0, "held\n"), ran
    assert "gate unavailable" not in ran.stderr
    assert "IGNORED" in lanelock("where").stderr      # where says so, loudly
    with_holder = lanelock("run", "--", "sh", "-c",
                           f"env -u LANELOCK_TURNS {' '.join(LANELOCK)} run -- true; echo $?")
    assert with_holder.stdout.strip() == "99", with_holder      # the file's other setting holds


@pytest.mark.parametrize("value", ["locks", "./locks", "../locks", "~/locks", "lanes/../locks"])
def test_config_set_refuses_a_relative_lock_root(value, lanelock, config_files, tmp_path):
    system, _ = config_files
    system.write_text("# the admin's own\n")
    done = lanelock("config", "set", "--system", "lock_dir", value, cwd=tmp_path)
    assert (done.returncode, done.stdout) == (2, ""), done
    (line,) = done.stderr.splitlines()
    assert "'lock_dir'" in line and f"{value!r} is relative" in line and "absolute path" in line
    assert system.read_text() == "# the admin's own\n"
    done = lanelock("config", "set", "--system", "lock_dir", str(tmp_path / "lanes"))
    assert done.returncode == 0, done   # an absolute one is taken as before


def test_a_retired_setting_is_ignored_with_a_note_never_an_ungated_turn(config_files, lanelock):
    """proxy_paths (the proxy's gated list) is retired: the proxy gates by default. A file that
    still sets it must not make every turn fail open as an unknown key would."""
    system, user = config_files
    user.write_text('proxy_paths = ["/v1/chat/completions"]\nwait = 0\n')
    done = lanelock("run", "-b", "127.0.0.1:8080", "--", "printenv", "LANELOCK_STATE")
    assert (done.returncode, done.stdout.strip()) == (0, "held"), done.stderr
    shown = lanelock("config", "show")
    assert shown.returncode == 0
    assert "proxy_paths: IGNORED, it is retired" in shown.stderr
    assert "proxy_cheap_paths" in shown.stderr


# -- a bad value of a setting with a safe default is that default, with one warning ----------------
# LANELOCK_PRIORITY=bogus stopped every command (exit 2: a crontab's typo stopped
# the job) and `priority = "bogus"` in a file ran every turn ungated. Walked over the whole table:
# a bad value from the environment or a file is passed over with ONE warning line, the rest of the
# file still applies and the turn is gated (held). backend, lock_dir and store say where the gate
# is, so no value is safe in place of a bad one: they refuse, with one line.
BAD_VALUES = {   # setting: (the file's bad value as TOML, the environment's bad text or None)
    "backend": ('"bogus::"', "bogus::"), "lock_dir": ('"locks"', "locks"),
    "model": ("3", "m" * 5000), "session": ("4", "s" * 5000), "key_by": ('"host"', "host"),
    "store": ('"mysql://x"', "mysql://x"), "gate": ('"maybe"', None), "wait": ('"soon"', None),
    "busy_exit_code": ("300", None), "priority": ('"bogus"', "bogus"),
    "priority_aging": ('"abc"', "abc"), "grace": ("-1", None), "kill_after": ("-3", None),
    "on_lost": ('"kill"', None),
    "journal_max_bytes": ("1", None), "chains": ("3", None), "proxy_listen": ('"x"', None),
    "proxy_linger": ("-1", None), "proxy_session_header": ('"a b"', None),
    "proxy_pin_slots": ('"yes"', None),
    "proxy_cheap_paths": ("3", None), "proxy_wait": ('"soon"', None),
    "proxy_max_wait": ('"later"', None), "proxy_priority": ('"bogus"', None),
    "proxy_fallback": ('["ftp://x"]', None), "proxy_fallback_model": ("[3]", None),
    "proxy_fallback_key_env": ("[]", None),
    "proxy_fallback_timeout": ("0", None), "proxy_fallback_pass_auth": ('"no"', None),
    "proxy_max_priority": ('"top"', None), "proxy_clients": ('[{match = "llm"}]', None),
    "proxy_token_env": ('"A B"', None), "proxy_witness": ("1", None),
    "proxy_engine": ('"ftp://e"', None), "proxy_witness_interval": ("61", None),
    "proxy_max_connections": ("0", None), "proxy_header_timeout": ("31", None),
    "proxy_idle_timeout": ('"never"', None), "proxy_quiet": ('"yes"', None),
    "proxy_verbose": ("2", None),
}


def test_the_walk_covers_the_whole_table():
    from lanelock.settings import SETTINGS

    assert set(BAD_VALUES) == set(SETTINGS), "a new setting needs its bad value here"
    for name, (_, env_text) in BAD_VALUES.items():
        assert (env_text is None) == (SETTINGS[name].env is None), name


def _one_line(done) -> str:
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("lanelock: "), done.stderr
    assert "Traceback" not in done.stderr
    return lines[0]


@pytest.mark.parametrize("name", sorted(BAD_VALUES))
def test_a_bad_value_in_a_file_is_the_default_with_one_warning(name, lanelock, config_files):
    from lanelock.settings import SETTINGS

    system, _ = config_files   # the system file: the one file that may set every key
    other = ("grace", "0.1", 0.1) if name == "busy_exit_code" else ("busy_exit_code", "9", 9)
    system.write_text(f"# the admin's\n{name} = {BAD_VALUES[name][0]}\n{other[0]} = {other[1]}\n")
    ran = lanelock("run", "--", "printenv", "LANELOCK_STATE")
    line = _one_line(ran)
    assert f"{system}: line 2:" in line and f"'{name}'" in line, line
    read = lanelock("status")
    if not SETTINGS[name].safe:   # where the gate is: refused, never guessed
        assert (ran.returncode, ran.stdout) == (0, "fail-open\n"), ran
        assert line.startswith("lanelock: warning: gate unavailable ("), line
        assert (read.returncode, read.stdout) == (2, ""), read
        assert f"'{name}'" in _one_line(read)
        return
    assert (ran.returncode, ran.stdout) == (0, "held\n"), ran   # gated, the command ran
    assert line.startswith("lanelock: warning: ") and "; using " in line, line
    assert read.returncode == 0 and _one_line(read) == line, read
    shown = lanelock("config", "show", "--json")
    assert shown.returncode == 0 and _one_line(shown) == line, shown
    settings = json.loads(shown.stdout)["settings"]
    assert settings[name]["value"] == SETTINGS[name].default
    assert settings[name]["source"].startswith("default"), settings[name]
    assert settings[other[0]] == {"value": other[2], "source": f"system file {system}"}


@pytest.mark.parametrize("name", sorted(name for name, (_, text) in BAD_VALUES.items() if text))
def test_a_bad_value_in_the_environment_is_the_default_with_one_warning(name, lanelock,
                                                                        config_files):
    from lanelock.settings import SETTINGS

    setting = SETTINGS[name]
    env = {setting.env: BAD_VALUES[name][1]}
    ran = lanelock("run", "--", "printenv", "LANELOCK_STATE", env=env)
    line = _one_line(ran)
    assert setting.env in line, line
    read = lanelock("status", env=env)
    if not setting.safe:   # where the gate is: refused, never guessed
        assert ran.stdout in ("", "fail-open\n") and ran.returncode in (0, 2), ran
        assert (read.returncode, read.stdout) == (2, ""), read
        assert setting.env in _one_line(read)
        return
    assert (ran.returncode, ran.stdout) == (0, "held\n"), ran
    assert line.startswith(f"lanelock: warning: env {setting.env}: ") and "; using " in line
    assert read.returncode == 0 and _one_line(read) == line, read
    # below the bad variable, the files still count: the value falls to them, then the default
    _, user = config_files
    if name == "priority":
        user.write_text('priority = "batch"\n')
        shown = json.loads(lanelock("config", "show", "--json", env=env).stdout)["settings"]
        assert shown["priority"] == {"value": "batch", "source": f"user file {user}"}


def test_a_hand_typed_bad_flag_stays_a_usage_error(lanelock):
    for args in (["--priority", "bogus"], ["--grace", "-1"], ["--wait=soon"], ["-E", "300"]):
        done = lanelock("run", *args, "--", "true")
        assert (done.returncode, done.stdout) == (2, ""), (args, done)
        _one_line(done)


def test_an_unknown_key_is_ignored_with_one_warning_never_an_ungated_turn(lanelock,
                                                                        config_files):
    _, user = config_files
    user.write_text('priorty = "batch"\nbusy_exit_code = 9\n')
    ran = lanelock("run", "--", "printenv", "LANELOCK_STATE")
    assert (ran.returncode, ran.stdout) == (0, "held\n"), ran
    line = _one_line(ran)
    assert f"{user}: line 1: unknown setting 'priorty'" in line and line.endswith("; ignored")
    assert show(lanelock)["busy_exit_code"]["value"] == 9


def test_config_set_mends_a_file_with_a_bad_value(lanelock, config_files):
    _, user = config_files
    user.write_text('# mine\npriority = "bogus"\n')
    assert lanelock("config", "set", "priority", "batch").returncode == 0
    assert user.read_text() == '# mine\npriority = "batch"\n'
    done = lanelock("config", "show")
    assert done.returncode == 0 and done.stderr == "", done


def test_config_show_aligns_its_columns_whatever_the_longest_key(lanelock):
    """proxy_session_header (20 characters) pushed its value out of an 18-character column."""
    shown = lanelock("config", "show")
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    values = {line.split()[1] for line in lines}
    starts = {len(line) - len(line[len(line.split()[0]):].lstrip()) for line in lines}
    assert len(starts) == 1, lines
    comments = {line.index(" # ") for line in lines if len(line.split()[1]) <= 40}
    assert len(comments) == 1, lines
    assert values
