"""Edges where the gate broke as a new user met it -- a terminal hangup with lanelock as
the session leader, lanelock's own output failing, long prompts in argv, loopback shorthands, store
URL typos, bad config values, a stopped holder. Every test here failed on the code before its fix.
"""

from __future__ import annotations

import json
import os
import re
import pty
import resource
import shutil
import signal
import subprocess
import sys
import threading

import pytest

from support.cli import LANELOCK, TIMEOUT, environ, json_of
from support.holding import HOLD_SCRIPT
from support.processes import read_line, wait_exit, wait_for

BUSY = 75


def wait_pid(pid: int, timeout: float = TIMEOUT) -> int:
    """waitpid() in a thread with a deadline: the exit status as the shell shows it."""
    box = {}
    thread = threading.Thread(target=lambda: box.update(status=os.waitpid(pid, 0)[1]), daemon=True)
    thread.start()
    thread.join(timeout)
    if "status" not in box:
        raise AssertionError(f"pid {pid} did not exit within {timeout}s")
    return os.waitstatus_to_exitcode(box["status"]) if box["status"] & 0x7f == 0 \
        else 128 + (box["status"] & 0x7f)


def probe(lanelock, backend: str) -> subprocess.CompletedProcess:
    return lanelock("probe", "-b", backend)


# -- 1. a terminal hangup with lanelock as the session leader --------------------------------------
def test_hangup_of_a_terminal_whose_session_leader_is_lanelock_ends_the_turn(lanelock, procs):
    pid, master = pty.fork()
    if pid == 0:   # the child: lanelock is the session leader of a new terminal
        try:
            os.execvp(sys.executable, [*LANELOCK, "run", "-b", "localhost:7010", "--",
                                       "sh", "-c", "echo ready; exec sleep 25"])
        finally:
            os._exit(127)
    procs.adopt(pid)
    data = b""
    while b"ready" not in data:
        chunk = os.read(master, 1024)
        assert chunk, f"no 'ready' from the turn: {data!r}"
        data += chunk
    assert probe(lanelock, "localhost:7010").returncode == 1   # held
    os.close(master)   # the terminal goes away: the kernel sends SIGHUP to the session leader only
    assert wait_pid(pid) == 128 + signal.SIGHUP   # the child got the HUP and died of it
    assert probe(lanelock, "localhost:7010").returncode == 0


def test_a_turn_run_under_nohup_goes_on_through_a_hangup(holder, lanelock):
    """`nohup lanelock run -- CMD`: the hangup reaches the wrapper, which passes it on; the
    command ignores it as nohup asked, and the turn holds the lane to the command's own end."""
    held = holder("-b", "localhost:7009",
                  preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    os.kill(held.pid, signal.SIGHUP)
    assert probe(lanelock, "localhost:7009").returncode == 1   # still held
    assert held.release(3) == 3
    assert probe(lanelock, "localhost:7009").returncode == 0


def test_the_hangup_tests_hold_in_a_suite_run_under_nohup(procs):
    """`nohup pytest`: the commands the suite starts begin with SIGHUP at its default all the
    same (support/signals.py), so the hangup tests test lanelock, not nohup."""
    test = (f"{os.path.abspath(__file__)}::"
            "test_an_ending_signal_to_the_wrapper_ends_its_stopped_command[1]")
    suite = procs.start(["nohup", sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                         "-p", "no:xdist", "-o", "addopts=", test],
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                        cwd=os.path.dirname(os.path.abspath(__file__)))
    out, _ = suite.communicate(timeout=3 * TIMEOUT)
    assert suite.returncode == 0, out


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux not installed")
def test_tmux_kill_session_frees_a_lane_held_by_its_first_command(lanelock, tmp_path, lock_dir):
    socket = tmp_path / "tmux.sock"
    fifo = tmp_path / "ready"
    os.mkfifo(fifo)
    # O_RDWR: a FIFO with no writer yet must not read as EOF; the turn's line is the signal.
    reader = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
    command = (f"{sys.executable} -m lanelock run -b localhost:7011 -- "
               f"sh -c 'echo \"ready $$\" > {fifo}; exec sleep 25'")
    started = subprocess.run(["tmux", "-S", str(socket), "-f", "/dev/null", "new-session", "-d",
                              "-e", f"LANELOCK_DIR={lock_dir}", command],
                             env=environ(), capture_output=True, text=True, timeout=TIMEOUT)
    assert started.returncode == 0, started.stderr
    try:
        with os.fdopen(reader, "rb", buffering=0) as stream:
            child = int(read_line(stream).split()[1])
        status = json.loads(lanelock("status", "-b", "localhost:7011", "--json").stdout)
        (wrapper,) = [holder["pid"] for holder in status["lanes"][0]["holders"]]
        subprocess.run(["tmux", "-S", str(socket), "kill-server"], timeout=TIMEOUT)
        wait_exit(wrapper)
        wait_exit(child)
        assert probe(lanelock, "localhost:7011").returncode == 0
    finally:
        subprocess.run(["tmux", "-S", str(socket), "kill-server"], capture_output=True,
                       timeout=TIMEOUT)


# -- 2. lanelock's own output failing never changes what runs or the exit status -------------------
def _broken_pipe():
    read_end, write_end = os.pipe()
    os.close(read_end)
    return write_end


@pytest.mark.parametrize("how", ["closed", "broken-pipe"])
@pytest.mark.parametrize("fallback", [False, True])
def test_a_busy_turn_with_a_failing_stderr_keeps_its_exit_status(how, fallback, holder, procs,
                                                                 tmp_path):
    holder("-b", "localhost:7012")
    marker = tmp_path / "fallback-ran"
    args = [*LANELOCK, "run", "-b", "localhost:7012"]
    if fallback:
        args += ["-f", f"touch {marker}"]
    args += ["--", "true"]
    if how == "closed":
        proc = procs.start(["sh", "-c", 'exec "$@" 2>&-', "sh", *args], stdout=subprocess.PIPE)
    else:
        fd = _broken_pipe()
        proc = procs.start(args, stdout=subprocess.PIPE, stderr=fd)
        os.close(fd)
    proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == (0 if fallback else BUSY)
    assert marker.exists() == fallback


READ_COMMANDS = [("probe", 0), ("status", 0), ("history", 0), ("where", 0), ("config show", 0),
                 ("config path", 0), ("--version", 0), ("duel --hold 0.2", 0)]


READERS = ["stdout-closed", "stderr-closed", "stdout-into-true", "stdout-into-head"]


@pytest.mark.parametrize("how, command, status", [
    # The duel takes seconds: one way in the default tier, every way in the slow one.
    pytest.param(how, command, status, id=f"{how}-{command}",
                 marks=pytest.mark.slow if command.startswith("duel") and how != READERS[-1]
                 else ())
    for command, status in READ_COMMANDS for how in READERS])
def test_read_commands_end_with_their_own_status_when_the_reader_goes(command, status, how,
                                                                      run_cmd):
    """A reader that went away (`| true`, `| head -c 1`) or a closed stderr leaves the status as
    it is; a closed stdout is output that could not be written: one line, and 1 (probe: 2, its
    error status), as coreutils do (tests/test_messages.py has /dev/full)."""
    line = f"{sys.executable} -m lanelock {command} -b localhost:7013" if command not in (
        "config show", "config path", "--version") else f"{sys.executable} -m lanelock {command}"
    shell = {"stdout-closed": f"{line} >&-; echo \"rc=$?\" >&2",
             "stderr-closed": f"{line} 2>&- >/dev/null; echo \"rc=$?\"",
             "stdout-into-true": f"{line} | true; echo \"rc=${{PIPESTATUS[0]}}\" >&2",
             "stdout-into-head": f"{line} | head -c 1 >/dev/null; echo \"rc=${{PIPESTATUS[0]}}\" >&2"}[how]
    result = run_cmd(["bash", "-c", shell])
    text = result.stdout + result.stderr
    if how == "stdout-closed":
        status = 2 if command == "probe" else 1
        assert "lanelock: cannot write the output: Bad file descriptor" in text, text
    assert f"rc={status}" in text, text
    assert "internal error" not in text and "Traceback" not in text, text


def test_probe_of_a_busy_lane_into_a_closed_stdout_still_says_busy(holder, run_cmd):
    holder("-b", "localhost:7014")
    result = run_cmd(["bash", "-c", f"{sys.executable} -m lanelock probe -b localhost:7014 | true;"
                                    " echo rc=${PIPESTATUS[0]}"])
    assert "rc=1" in result.stdout, result


# -- 3. long prompts in argv ----------------------------------------------------------------------
def _big_stack():
    # ARG_MAX is a quarter of the stack limit (at most 6 MiB): room for several MB of arguments.
    resource.setrlimit(resource.RLIMIT_STACK, (256 << 20, 256 << 20))


@pytest.mark.parametrize("size", [70_000, 5 << 20])   # execve caps argv + env at 6 MiB
def test_a_huge_argv_keeps_the_holder_record_readable(size, lanelock, holder):
    words = ["a" * 100_000] * (size // 100_000) + ["b" * (size % 100_000 or 1)]
    held = holder("-s", "long-prompt", "-m", "qwen", "-b", "localhost:7015",
                  command=["sh", "-c", HOLD_SCRIPT, "x", *words], preexec_fn=_big_stack)
    status = json.loads(lanelock("status", "-b", "localhost:7015", "--json").stdout)["lanes"][0]
    assert status["verdict"] == "held", status["message"]
    assert (status["holder"]["session"], status["holder"]["model"]) == ("long-prompt", "qwen")
    assert status["holder"]["argv_bytes"] >= size
    deflected = lanelock("run", "-b", "localhost:7015", "--", "true")
    assert deflected.returncode == BUSY
    assert "session long-prompt" in deflected.stderr and "not a lanelock turn" not in deflected.stderr
    assert held.release() == 0
    assert held.stderr() == ""   # no warning: the record was written


# -- 4. loopback shorthands are the local lane ------------------------------------------------------
@pytest.mark.parametrize("spelling", ["127.1", "127.000.000.001", "2130706433", "0x7f.1",
                                      "0177.0.0.1", "0x7f000001", "127.0.1", "0",
                                      "[::ffff:127.0.0.1]", "[::ffff:7f00:1]",
                                      "http://127.1:7016/v1", "[0:0:0:0:0:0:0:1]"])
def test_every_spelling_of_loopback_meets_a_live_holder(spelling, holder, lanelock):
    holder("-b", "127.0.0.1:7016")
    backend = spelling if "://" in spelling else f"{spelling}:7016"
    where = json.loads(lanelock("where", "-b", backend, "--json").stdout)
    assert (where["lane"], where["scope"]) == ("localhost:7016", "local")
    turn = lanelock("run", "-b", backend, "--", "true")
    assert turn.returncode == BUSY, turn.stderr


@pytest.mark.parametrize("spelling, lane", [("10.1:80", "10.0.0.1:80"),
                                            ("0xc0.0xa8.1.50:80", "192.168.1.50:80"),
                                            ("3232235826:80", "192.168.1.50:80")])
def test_shorthand_spellings_of_a_lan_address_are_that_lan_lane(spelling, lane, lanelock):
    where = json.loads(lanelock("where", "-b", spelling, "--json").stdout)
    assert (where["lane"], where["scope"]) == (lane, "lan")


def test_names_made_of_hex_letters_are_still_names(lanelock):
    where = json.loads(lanelock("where", "-b", "beef.cafe:80", "--json").stdout)
    assert where["lane"] == "beef.cafe:80"


# -- 6. store URL typos are usage errors ------------------------------------------------------------
@pytest.mark.parametrize("url", ["mysql://x", "redis://localhost/0", "postgresql", "postgres:/x",
                                 "http://db/lanes"])
def test_a_malformed_store_url_is_a_usage_error_and_nothing_runs(url, lanelock, tmp_path):
    marker = tmp_path / "ran"
    turn = lanelock("run", "--store", url, "--", "touch", str(marker))
    assert turn.returncode == 2 and not marker.exists()
    assert turn.stderr.count("\n") == 1 and turn.stderr.startswith("lanelock: "), turn.stderr
    env_turn = lanelock("run", "--", "touch", str(marker), env={"LANELOCK_STORE": url})
    assert env_turn.returncode == 2 and not marker.exists()
    assert "LANELOCK_STORE" in env_turn.stderr
    assert lanelock("config", "set", "store", url).returncode == 2


# -- 7. config set refuses what would break every turn; a bad file fails open ----------------------
@pytest.mark.parametrize("value", ["bad::", "localhost:99999", "localhost", "http://x:0/"])
def test_config_set_checks_a_backend_with_the_flags_parser(value, lanelock):
    result = lanelock("config", "set", "backend", value)
    assert result.returncode == 2 and "backend" in result.stderr, result.stderr
    assert lanelock("run", "--", "true").returncode == 0


def test_a_bad_backend_written_by_hand_fails_open_with_one_warning(lanelock, tmp_path, monkeypatch):
    config = tmp_path / "user.toml"
    config.write_text('model = "qwen"\nbackend = "localhost:99999"\n')
    monkeypatch.setenv("LANELOCK_CONFIG", str(config))
    turn = lanelock("run", "--", "sh", "-c", "echo $LANELOCK_STATE")
    assert (turn.returncode, turn.stdout) == (0, "fail-open\n")
    assert turn.stderr.count("\n") == 1 and f"{config}: line 2" in turn.stderr, turn.stderr
    for command in (["status"], ["probe"], ["where"], ["config", "show"]):
        result = lanelock(*command)
        assert result.returncode == 2 and f"{config}: line 2" in result.stderr, (command, result)


# -- 8. a stopped holder is named as such ------------------------------------------------------------
def test_status_and_deflections_say_the_holder_is_stopped(holder, lanelock):
    held = holder("-b", "localhost:7017", "-s", "paused-agent")

    def lane() -> dict:
        return json_of(["status", "-b", "localhost:7017", "--json"])["lanes"][0]

    os.kill(held.child_pid, signal.SIGSTOP)
    try:
        # The wrapper hears of the stop (SIGCHLD) and writes it down; nothing tells the test when.
        # /proc shows the stop at once; the record's "since" only once the wrapper wrote it.
        found = wait_for(lambda: (lambda seen: seen if ((seen["holder"] or {}).get("stopped") or
                                                        {}).get("since") else None)(lane()),
                         what="the wrapper to record the stop")
        assert found["verdict"] == "held"
        assert f"pid {held.child_pid} is stopped" in found["message"], found["message"]
        assert f"kill -CONT {held.child_pid}" in found["message"]
        assert found["holder"]["stopped"]["pid"] == held.child_pid
        assert found["holder"]["stopped"]["since"]
        deflected = lanelock("run", "-b", "localhost:7017", "--", "true")
        assert deflected.returncode == BUSY and "stopped" in deflected.stderr, deflected.stderr
    finally:
        os.kill(held.child_pid, signal.SIGCONT)
    wait_for(lambda: "stopped" not in lane()["message"], what="the wrapper to record the continue")
    assert held.release() == 0


@pytest.mark.parametrize("stop", ["command SIGSTOP", "job kill -TSTP"])
def test_following_status_advice_ends_a_stopped_holder(stop, holder, lanelock, run_cmd):
    """`status` says how to end a stopped holder; doing exactly that ends it and
    frees the lane (a TERM forwarded to a stopped command used to wait for a resume forever)."""
    held = holder("-b", "localhost:7018", "-s", "paused-agent")
    if stop == "command SIGSTOP":
        os.kill(held.child_pid, signal.SIGSTOP)
    else:   # ^Z without a terminal: the wrapper stops its command, then itself
        os.kill(held.pid, signal.SIGTSTP)

    def advice() -> str | None:
        lane = json_of(["status", "-b", "localhost:7018", "--json"])["lanes"][0]
        found = re.search(r"ended \(([^)]*)\)", lane["message"])
        return found.group(1) if found else None

    command = wait_for(advice, what="status to advise how to end the stopped holder")
    assert f"kill {held.pid}" in command, command
    assert run_cmd(["sh", "-c", command]).returncode == 0
    assert held.wait() == 128 + signal.SIGTERM
    assert lanelock("probe", "-b", "localhost:7018").returncode == 0


@pytest.mark.parametrize("signo", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_an_ending_signal_to_the_wrapper_ends_its_stopped_command(signo, holder, lanelock):
    held = holder("-b", "localhost:7019")
    os.kill(held.child_pid, signal.SIGSTOP)
    wait_stopped_state = lambda: open(f"/proc/{held.child_pid}/stat").read().rsplit(")", 1)[1].split()[0] == "T"  # noqa: E731
    wait_for(wait_stopped_state, what="the command to stop")
    os.kill(held.pid, signo)
    assert held.wait() == 128 + signo
    assert lanelock("probe", "-b", "localhost:7019").returncode == 0


from hypothesis import example, given, settings as hypothesis_settings, strategies as st  # noqa: E402


@hypothesis_settings(max_examples=500, deadline=None, database=None)
@given(st.text(alphabet="0123456789abcdefxX._o+", max_size=20))
@example("0x0x0553")   # found by this property in a full run: int() took the second "0x"
@example("1_0")
def test_ipv4_shorthands_are_read_exactly_as_inet_aton_reads_them(text):
    import socket

    from lanelock.lanes import inet_aton

    try:
        expected = int.from_bytes(socket.inet_aton(text), "big")
    except OSError:
        expected = None
    assert inet_aton(text) == expected
