"""Issue 16, items 3 and 4: messages that used to send a user the wrong way, and small things a
user notices. Each asserts the one `lanelock:` line and the exit status."""

from __future__ import annotations

import json
import os
import select
import subprocess

import pytest

from conftest import LANELOCK, TIMEOUT, environ, read_line


def one_line(result) -> str:
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("lanelock: "), result.stderr
    return lines[0]


def test_a_path_without_a_scheme_says_so(lanelock):
    result = lanelock("where", "-b", "localhost:8080/v1")
    assert result.returncode == 2
    assert "a path needs a scheme (http://localhost:8080/v1)" in one_line(result)


@pytest.mark.parametrize("args, words", [
    (["run", "-w", "echo", "hi"], "--wait's value is optional: write --wait=SECONDS"),
    (["run", "--wait", "-1", "--", "true"], "-1 is a negative number, not an option"),
    (["run", "--wait=-1", "--", "true"], "-1 is a negative number"),
    (["run", "--grace", "-1", "--", "true"], "-1 is negative: SECONDS must be 0 or more"),
    (["run", "--kill-after", "soon", "--", "true"], "'soon' is not a number of seconds"),
    (["run", "--grace", "nan", "--", "true"], "'nan' is not a number of seconds"),
    (["config", "set", "grace", "-1"], "-1 is a negative number, not an option"),
])
def test_option_values_are_explained(args, words, lanelock):
    result = lanelock(*args)
    assert result.returncode == 2
    assert words in one_line(result)


@pytest.mark.parametrize("command, words", [
    (["cd", "/"], "cd: a shell builtin, not a program: run it in a shell, e.g. lanelock run -- sh -c"),
    ([""], "the command is empty"),
])
def test_commands_that_cannot_start_are_explained(command, words, lanelock):
    result = lanelock("run", "--", *command)
    assert result.returncode == 127
    assert words in one_line(result)


def test_a_script_whose_interpreter_is_missing_names_it(lanelock, tmp_path):
    script = tmp_path / "x.sh"
    script.write_text("#!/usr/bin/no-such-interpreter\necho hi\n")
    script.chmod(0o755)
    for spelled, env in ((str(script), None), ("x.sh", {"PATH": f"{tmp_path}:/usr/bin:/bin"})):
        result = lanelock("run", "--", spelled, env=env)
        assert result.returncode == 127
        assert "its interpreter /usr/bin/no-such-interpreter was not found" in one_line(result)


def test_status_json_watch_streams_one_object_per_refresh(procs):
    proc = procs.start([*LANELOCK, "status", "--json", "--watch", "-b", "localhost:7210"],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=environ())
    first, second = json.loads(read_line(proc.stdout)), json.loads(read_line(proc.stdout))
    assert first["lanes"][0]["lane"] == second["lanes"][0]["lane"] == "localhost:7210"
    assert second["time"] > first["time"]


def test_where_warns_when_the_lock_root_is_a_regular_file(lanelock, tmp_path):
    root = tmp_path / "not-a-dir"
    root.write_text("")
    result = lanelock("where", "--lock-dir", str(root))
    assert result.returncode == 0
    assert "turns here would run ungated (fail open)" in one_line(result)


def test_history_speaks_local_time_with_its_zone(lanelock):
    assert lanelock("run", "-b", "localhost:7211", "--", "true").returncode == 0
    for zone, name in (("Europe/Berlin", "CET"), ("UTC", "UTC"), ("America/New_York", "EST")):
        shown = lanelock("history", "-b", "localhost:7211", env={"TZ": zone}).stdout
        date = subprocess.run(["date", "+%Y-%m-%d %H"], env=environ({"TZ": zone}),
                              capture_output=True, text=True).stdout.strip()
        assert f"{date}:" in shown and f" {name} " in shown, (zone, shown)
    events = json.loads(lanelock("history", "-b", "localhost:7211", "--json").stdout)["events"]
    after = lanelock("history", "-b", "localhost:7211", "--json", "--since",
                     subprocess.run(["date", "-d", "@" + str(int(events[0]["ts"]) + 3600),
                                     "+%Y-%m-%dT%H:%M:%S"], env=environ({"TZ": "Europe/Berlin"}),
                                    capture_output=True, text=True).stdout.strip(),
                     env={"TZ": "Europe/Berlin"})
    assert json.loads(after.stdout)["events"] == []   # a naive --since is local time too


def test_status_keeps_the_commands_quoting(holder, lanelock):
    holder("-b", "localhost:7212")
    shown = lanelock("status", "-b", "localhost:7212").stdout
    assert "command sh -c 'echo \"ready $$\"; read code; exit \"${code:-0}\"'" in shown, shown


def test_backend_error_is_importable_from_the_package():
    import lanelock

    with pytest.raises(lanelock.BackendError):
        lanelock.Gate("bad::")


def test_status_names_the_lanes_of_the_same_backend_keyed_by_model(holder, lanelock):
    holder("-b", "localhost:7213", "--key-by", "model", "-m", "qwen")
    result = lanelock("status", "-b", "localhost:7213")
    assert "localhost:7213#qwen (held)" in result.stderr and "does not exclude" in result.stderr


@pytest.mark.parametrize("command", ["status", "history", "metrics"])
def test_reading_a_public_backend_says_it_has_no_lane(command, lanelock):
    """status, history and metrics of a backend that is never gated say so once (its "free" and
    zeros would otherwise read as an idle lane); a local lane gets no such line."""
    public = lanelock(command, "-b", "https://api.openai.com/v1")
    assert public.returncode == 0
    assert public.stderr == ("lanelock: warning: api.openai.com:443 is not a local lane: turns "
                             "on it are never gated\n")
    local = lanelock(command, "-b", "127.1:8080")
    assert (local.returncode, local.stderr) == (0, "")


# -- issue 23 item 10: a group called without its command prints its help, readably ---------------
@pytest.mark.parametrize("group", [[], ["config"]], ids=["lanelock", "lanelock config"])
def test_a_group_without_its_command_prints_its_help_on_several_lines(group, lanelock):
    """A missing command is a usage error (2, as click does); its help is the one message that is
    not flattened into one `lanelock:` line (that printed a `?` for every newline)."""
    bare = lanelock(*group)
    asked = lanelock(*group, "--help")
    assert (bare.returncode, bare.stdout) == (2, "")   # stdout is for data
    assert bare.stderr == asked.stdout, bare.stderr   # the very help --help prints
    lines = bare.stderr.splitlines()
    assert lines[0].startswith(f"Usage: lanelock {' '.join(group + [''])}[OPTIONS] COMMAND"), lines
    commands = lines[lines.index("Commands:") + 1:]
    names = [line.split()[0] for line in commands]
    assert names == (["path", "set", "show"] if group else
                     ["completion", "config", "duel", "history", "metrics", "probe", "proxy",
                      "run", "status", "watch", "where"]), commands


@pytest.mark.parametrize("args", [["nosuchcmd"], ["config", "nosuchcmd"]])
def test_an_unknown_command_stays_one_line(args, lanelock):
    result = lanelock(*args)
    assert result.returncode == 2
    assert "No such command 'nosuchcmd'" in one_line(result)
