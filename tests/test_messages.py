"""Messages that used to send a user the wrong way, and small things a
user notices. Each asserts the one `lanelock:` line and the exit status."""

from __future__ import annotations

import json
import os
import select
import re
import subprocess

import pytest

from support.cli import LANELOCK, STEM, TIMEOUT, environ
from support.kernel_locks import is_queued
from support.processes import read_line, wait_for


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
    (["run", "--wait=-1", "--", "true"], "-1 is negative: SECONDS must be 0 or more"),
    (["run", "--grace", "-1", "--", "true"], "-1 is negative: SECONDS must be 0 or more"),
    (["run", "--kill-after", "soon", "--", "true"], "'soon' is not a duration (SECONDS: 90, "),
    (["run", "--grace", "nan", "--", "true"], "'nan' is not a duration (SECONDS: 90, "),
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


# -- a group called without its command prints its help, readably ---------------
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
                     ["completion", "config", "duel", "history", "metrics", "models", "probe",
                      "proxy", "run", "seats", "status", "watch", "where"]), commands


@pytest.mark.parametrize("args", [["nosuchcmd"], ["config", "nosuchcmd"]])
def test_an_unknown_command_stays_one_line(args, lanelock):
    result = lanelock(*args)
    assert result.returncode == 2
    assert "No such command 'nosuchcmd'" in one_line(result)


# -- small things, each said in words that help -----------------------------------
@pytest.mark.parametrize("args", [
    ["run", "--wait", "nan", "--", "true"], ["run", "-w", "NaN", "--", "true"],
    ["run", "--wait=nan", "--", "true"], ["proxy", "--wait", "nan"], ["proxy", "--linger", "nan"],
    ["run", "--grace", "inf", "--", "true"], ["duel", "--hold", "nan"],
])
def test_nan_is_not_a_duration_not_a_negative_number(args, lanelock):
    line = one_line(lanelock(*args))
    assert "is not a duration (SECONDS: 90, 0.5, 500ms, 30s, 5m, 2h, 1d)" in line, line
    assert "negative" not in line and "optional" not in line, line


@pytest.mark.parametrize("args", [
    ["run", "--wait=-nan", "--", "true"], ["run", "-w-nan", "--", "true"],
    ["run", "--wait=-5m", "--", "true"], ["proxy", "--wait=-nan"], ["proxy", "-w-1"],
    ["run", "-qw-nan", "--", "true"],
])
def test_a_value_glued_to_wait_that_starts_with_a_dash_is_judged_as_a_value(args, lanelock):
    """click reads `--wait=-nan` as a bare --wait followed by the options -n -a -n ("No such
    option '-n'"): --wait's value is optional, and click puts a glued value back among the words
    where a dash means an option. It is the value the user wrote: judge it."""
    value = args[1].partition("=")[2] if "=" in args[1] else args[1][args[1].index("w") + 1:]
    result = lanelock(*args)
    line = one_line(result)
    assert result.returncode == 2
    assert line.startswith(f"lanelock: Invalid value for '--wait' / '-w': {value} is negative"
                           if value[1:2].isdigit() else
                           f"lanelock: Invalid value for '--wait' / '-w': {value!r} is not a "
                           "duration (SECONDS: 90, 0.5, 500ms, 30s, 5m, 2h, 1d) (see"), line

@pytest.mark.parametrize("backend, works", [
    ("8080", "127.0.0.1:8080"), ("localhost", "localhost:8080"), ("10.0.0.5", "10.0.0.5:8080")])
@pytest.mark.parametrize("command", ["run", "status"])
def test_a_backend_without_a_port_says_what_would_work(backend, works, command, lanelock):
    result = lanelock(command, "-b", backend, *(["--", "true"] if command == "run" else []))
    assert result.returncode == 2
    line = one_line(result)
    assert f"backend {backend!r} has no port: write HOST:PORT, e.g. {works}" in line, line


def test_every_option_that_takes_a_duration_reads_the_same_syntax(lanelock, holder, procs,
                                                                   lock_dir):
    """--wait 5s was refused while history --since 2h worked: one syntax now (duration.py)."""
    done = lanelock("run", "--wait", "5s", "--grace", "50ms", "--kill-after", "1m", "--",
                    "printenv", "LANELOCK_STATE")
    assert (done.returncode, done.stdout, done.stderr) == (0, "held\n", ""), done
    done = lanelock("run", "-w", "2m", "--", "true")   # the click-free path and click agree
    assert done.returncode == 0, done.stderr
    for since in ("90", "90s", "2h", "1d", "1w", "0.5m"):
        done = lanelock("history", "--since", since, "--json")
        assert done.returncode == 0, (since, done.stderr)
    assert lanelock("history", "--since", "2x").returncode == 2
    assert lanelock("config", "set", "wait", "30s").returncode == 0
    shown = json.loads(lanelock("config", "show", "--json").stdout)["settings"]["wait"]
    assert shown["value"] == 30.0   # read as seconds, whatever the spelling
    held = holder()   # a file's "30s" is 30 seconds of waiting: the turn waits, then runs
    waiter = procs.start([*LANELOCK, "run", "--", "printenv", "LANELOCK_STATE"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    # The waiter blocks in the kernel: nothing it can report says so, so its queue entry is asked.
    wait_for(lambda: waiter.poll() is None and is_queued(lock_dir / f"{STEM}.lock", waiter.pid),
             what="the turn to wait")
    assert held.release() == 0
    out, err = waiter.communicate(timeout=TIMEOUT)
    assert (waiter.returncode, out, err) == (0, b"held\n", b""), err
    env = {"LANELOCK_PRIORITY_AGING": "45s"}   # and the environment's: no warning
    assert lanelock("run", "--", "true", env=env).stderr == ""


READ_INTO_FULL = [("status", 1), ("status --json", 1), ("history", 1), ("metrics", 1),
                  ("where", 1), ("config show", 1), ("--version", 1), ("probe", 2)]


@pytest.mark.parametrize("command, status", READ_INTO_FULL, ids=[c for c, _ in READ_INTO_FULL])
def test_a_read_command_that_cannot_write_its_output_says_so_and_fails(command, status, run_cmd):
    result = run_cmd(["sh", "-c", f'"$@" {command} >/dev/full', "sh", *LANELOCK])
    assert result.returncode == status, result
    assert one_line(result) == "lanelock: cannot write the output: No space left on device"


def test_runs_own_output_failing_never_changes_what_runs_or_its_status(run_cmd, holder,
                                                                      tmp_path):
    marker = tmp_path / "ran"
    run = ["sh", "-c", '"$@" 2>/dev/full', "sh", *LANELOCK, "run"]
    ran = run_cmd([*run, "-v", "--", "sh", "-c", f"touch {marker}; exit 3"])
    assert ran.returncode == 3 and marker.exists(), ran
    holder()
    busy = run_cmd([*run, "--", "true"])   # its deflection line is lost, its status is not
    assert (busy.returncode, busy.stderr) == (75, ""), busy


def test_a_proxy_on_a_port_in_use_says_so_with_its_own_status(lanelock):
    """It exited 2, a usage error, though nothing typed was wrong: 69 (EX_UNAVAILABLE) now."""
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        result = lanelock("proxy", "--listen", f"127.0.0.1:{port}", "-b", "127.0.0.1:8080")
    finally:
        taken.close()
    assert result.returncode == 69, result
    # the proxy's own lines start with their time (a service's log)
    line = re.sub(r"^\S+ (?=lanelock: )", "", result.stderr)
    assert line == f"lanelock: cannot listen on 127.0.0.1:{port}: Address already in use\n", line


# -- what `run --help` says of its options -----------------------------------------------------------
def test_run_help_says_what_a_bare_wait_and_the_lock_dir_do(lanelock):
    """A newcomer read "(up to SECONDS)" and never learnt that a bare --wait waits for ever, and
    read "(system file only)" as a riddle; a default is said once, not twice."""
    text = " ".join(lanelock("run", "--help").stdout.split())
    assert "a bare --wait waits for ever" in text, text
    assert "only the system config file (/etc/lanelock/config.toml) may set it" in text, text
    assert "system file only" not in text
    for doubled in ("(default) or", "normal (default)", "continue (default)"):
        assert doubled not in text, doubled
