"""A turn is its command's whole process tree: `lanelock run` runs its command in a
process group of its own, and the lane is not free while any process of that group runs --
whether the wrapper is alive (the command ended first), sent SIGTERM (the whole group ends), or
killed outright (the holder record names the group; the next turn waits until it is empty). A
process that leaves the group on purpose (setsid) is outside the turn. The terminal's foreground
goes to the command's group and comes back, with ^Z and fg/bg working as for any job.

How "the lane never reads free while a process of the turn runs" is shown: a turn waiting for the
lane (`lanelock run --wait`) runs CHECK the moment it gets it, and CHECK says whether any of the
turn's processes still runs then; before that, `probe` and a deflect-mode `run` find it busy.
Synchronisation: lines on pipes (the command's "ready", the engine's first streamed event, the
wrapper's warning), pidfds for deaths; wait_for only for a waiter blocked in the kernel and a
setsid() that no process reports. Commands run for ever (sleep 600, an endless stream): the test
ends them itself, so their length never sets its pace.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys

import pexpect
import psutil
import pytest

from support.cli import LANELOCK, TIMEOUT, environ
from support.kernel_locks import flock_entries, is_waiting
from support.processes import ExitWatch, pid_gone, read_line, wait_exit, wait_for

# The stand-in engine, its port on stdout once it listens: a stream of (practically) endless
# tokens, one every 50 ms, until the client hangs up.
ENGINE_SCRIPT = """
from lanelock.testing.standin import make_server
server = make_server(0, 0.1, "stand-in", tokens=1000000, token_interval=0.05)
print(server.server_address[1], flush=True)
server.serve_forever()
"""

# Run by the next turn the moment it has the lane: does any of these pids still run?
CHECK = """
import sys
for pid in sys.argv[1:]:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            state = handle.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        continue
    if state not in ("Z", "X"):
        print("beside", pid)
        break
else:
    print("clear")
"""


@pytest.fixture
def engine(procs) -> str:
    proc = procs.start([sys.executable, "-c", ENGINE_SCRIPT], stdout=subprocess.PIPE)
    port = read_line(proc.stdout, TIMEOUT).strip()
    assert port.isdigit(), port
    return f"http://127.0.0.1:{port}"


def curl_turn(url: str) -> list[str]:
    """`sh -c 'curl …; echo done'`: a script whose curl streams from the engine."""
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "stream": True})
    return ["sh", "-c", f'echo "ready $$"; curl -sN -H "Content-Type: application/json" '
                        f"-d {shlex.quote(body)} {url}/v1/chat/completions; echo done"]


SLEEP_TURN = ["sh", "-c", 'sleep 600 & echo "ready $$ $!"; wait']


def started(held, kind: str, procs) -> list[int]:
    """The turn's processes once its work is under way: [sh, its child]."""
    if kind == "curl":
        line = held.read_line()
        while not line.startswith("data:"):   # the engine has begun streaming to curl
            assert line, "the stream ended before it began"
            line = held.read_line()
        (worker,) = psutil.Process(held.child_pid).children()
        work = worker.pid
    else:
        work = int(held.ready_line.split()[2])
    procs.adopt(work)
    return [held.child_pid, work]


def waiter(procs, pids: list[int]) -> subprocess.Popen:
    return procs.start([*LANELOCK, "run", "--wait", "--", sys.executable, "-c", CHECK,
                        *map(str, pids)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True)


def held_by(lock, pid: int) -> bool:
    return pid in flock_entries(lock)[0]


@pytest.mark.parametrize("kind", ["curl", "sleep"])
def test_sigterm_to_the_wrapper_alone_ends_the_whole_group_before_the_lane_frees(
        kind, holder, procs, lanelock, lock_dir, request):
    command = curl_turn(request.getfixturevalue("engine")) if kind == "curl" else SLEEP_TURN
    held = holder(command=command)
    pids = started(held, kind, procs)
    deaths = [ExitWatch(pid) for pid in pids]
    lock = lock_dir / "localhost-8080.lock"
    after = waiter(procs, pids)
    wait_for(lambda: is_waiting(lock, after.pid) or after.poll() is not None,
             what="the next turn to wait for the lane")
    os.kill(held.pid, signal.SIGTERM)   # the wrapper alone, as timeout(1) or systemd's stop does
    assert held.wait() == 128 + signal.SIGTERM, held.stderr()
    for death in deaths:                # the whole group ended: sh and what it ran
        death.wait()
    out, err = after.communicate(timeout=TIMEOUT)
    assert (after.returncode, out) == (0, "clear\n"), err
    assert "done" not in held.proc.stdout.read().decode()   # the script did not go on


@pytest.mark.parametrize("kind", ["curl", "sleep"])
def test_sigkill_of_the_wrapper_leaves_the_lane_to_its_group_until_the_group_is_empty(
        kind, holder, procs, lanelock, lock_dir, request):
    command = curl_turn(request.getfixturevalue("engine")) if kind == "curl" else SLEEP_TURN
    held = holder(command=command)
    shell, work = started(held, kind, procs)
    shell_death = ExitWatch(shell)
    os.kill(held.pid, signal.SIGKILL)
    held.wait()
    shell_death.wait()   # the command's parent-death signal; what it started runs on
    assert not pid_gone(work)
    probe = lanelock("probe")
    assert probe.returncode == 1 and f"process group {shell}" in probe.stdout, probe
    busy = lanelock("run", "--", "true")
    assert busy.returncode == 75 and "still ending" in busy.stderr, busy.stderr
    lane = json.loads(lanelock("status", "--json").stdout)["lanes"][0]
    assert lane["verdict"] == "ending" and f"pid {work}" in lane["message"], lane
    history = lanelock("history").stdout
    assert f"died without releasing; its command's process group {shell} still runs" in history
    lock = lock_dir / "localhost-8080.lock"
    after = waiter(procs, [shell, work])
    # It takes the kernel's lock, and holds it while it waits for the killed turn's group.
    wait_for(lambda: held_by(lock, after.pid) or after.poll() is not None,
             what="the next turn to take the lock and wait for the group")
    assert after.poll() is None, after.communicate()
    os.kill(work, signal.SIGKILL)
    out, err = after.communicate(timeout=TIMEOUT)
    assert (after.returncode, out) == (0, "clear\n"), err


def test_kill_after_kills_the_whole_group(holder, procs, lanelock):
    """A group that ignores the forwarded TERM (`trap "" TERM` is inherited by the script's
    children) is killed whole once --kill-after passes, and only then is the lane free."""
    held = holder("--kill-after", "0.2",
                  command=["sh", "-c", 'trap "" TERM; sleep 600 & echo "ready $$ $!"; wait'])
    work = int(held.ready_line.split()[2])
    procs.adopt(work)
    death = ExitWatch(work)
    os.kill(held.pid, signal.SIGTERM)
    assert held.wait() == 128 + signal.SIGKILL
    death.wait()
    assert lanelock("probe").returncode == 0


def test_the_command_ending_first_leaves_the_lane_held_until_its_group_is_empty(
        holder, procs, lanelock, lock_dir):
    held = holder(command=["sh", "-c", 'sleep 600 & echo "ready $$ $!"'], stderr=subprocess.PIPE)
    work = int(held.ready_line.split()[2])
    procs.adopt(work)
    warning = read_line(held.proc.stderr, TIMEOUT)   # said once, when the command has ended
    # (pid N (its command line): the forked shell may not have exec'd sleep yet)
    assert (f"the command ended, but 1 process of its process group still runs (pid {work} ("
            in warning and "lane localhost:8080 stays held until it ends" in warning), warning
    assert pid_gone(held.child_pid) and held.proc.poll() is None
    assert lanelock("probe").returncode == 1
    status = lanelock("status").stdout
    assert (f"its command has ended, and the lane waits for the rest of its process group "
            f"{held.child_pid} (pid {work} (") in status, status
    lock = lock_dir / "localhost-8080.lock"
    after = waiter(procs, [work])
    wait_for(lambda: is_waiting(lock, after.pid) or after.poll() is not None,
             what="the next turn to wait for the lane")
    os.kill(work, signal.SIGKILL)
    assert held.wait() == 0   # the command's own status
    out, err = after.communicate(timeout=TIMEOUT)
    assert (after.returncode, out) == (0, "clear\n"), err
    assert held.proc.stderr.read() == b"", "the warning is said once"


def test_a_process_that_leaves_the_group_with_setsid_is_outside_the_turn(holder, procs, lanelock):
    held = holder(command=["sh", "-c", 'setsid sleep 600 & daemon=$!; sleep 600 & '
                                       'echo "ready $$ $daemon $!"; read code; exit "${code:-0}"'],
                  stderr=subprocess.PIPE)
    daemon, member = map(int, held.ready_line.split()[2:])
    for pid in (daemon, member):
        procs.adopt(pid)
    # setsid(2) takes effect in the daemon's own time, and says so to no one.
    wait_for(lambda: os.getsid(daemon) == daemon, what="the daemon to leave the session")
    held.proc.stdin.write(b"0\n")
    held.proc.stdin.close()
    warning = read_line(held.proc.stderr, TIMEOUT)
    assert f"(pid {member} (" in warning and f"pid {daemon}" not in warning, warning
    os.kill(member, signal.SIGKILL)
    assert held.wait() == 0
    assert lanelock("probe").returncode == 0, "the daemon outside the group keeps no lane"
    assert not pid_gone(daemon)


# An API turn that runs a command of its own in a process group it leads (process_group=0).
# Started with the turn's environment (LANELOCK_HELD: a killed turn's process is believed only
# when it says which lock its turn held), then named to the turn.
API_TURN = """
import os, subprocess, sys
from lanelock import Gate
with Gate().turn() as turn:
    command = subprocess.Popen(["sh", "-c", 'sleep 600 & echo "ready $$ $!"; wait'],
                               process_group=0, stdout=subprocess.PIPE, text=True,
                               env={**os.environ, **turn.env})
    turn.command_started(command.pid)
    print(turn.state, command.stdout.readline().strip(), flush=True)
    sys.stdin.read()
"""


def test_an_api_turn_whose_command_leads_a_group_leaves_the_lane_to_the_group(procs, lanelock):
    """An API turn's command (turn.command_started, as Gate.turn(command_pid=...)) that leads its
    own group: the record names the group, and a killed turn's lane waits for all of it, not for
    that one process."""
    turn = procs.start([sys.executable, "-c", API_TURN], stdin=subprocess.PIPE,
                       stdout=subprocess.PIPE)
    state, ready, shell, work = read_line(turn.stdout, TIMEOUT).split()
    assert (state, ready) == ("held", "ready"), (state, ready)
    shell, work = int(shell), int(work)
    procs.adopt(shell)
    procs.adopt(work)
    turn.kill()
    turn.wait(timeout=TIMEOUT)
    death = ExitWatch(shell)
    os.kill(shell, signal.SIGKILL)   # the process the turn named; its group runs on
    death.wait()
    probe = lanelock("probe")
    assert probe.returncode == 1 and f"process group {shell}" in probe.stdout, probe
    os.kill(work, signal.SIGKILL)
    wait_exit(work)
    assert lanelock("probe").returncode == 0


# -- the terminal ----------------------------------------------------------------------------------
def tpgid(pid: int) -> int:
    """The foreground process group of pid's terminal (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as handle:
        return int(handle.read().rsplit(")", 1)[1].split()[5])


def test_ctrl_z_fg_and_bg_move_the_command_s_group_with_the_terminal(procs, lanelock):
    """An interactive shell's job: the command's own group has the terminal (cat reads it);
    ^Z stops the group and the shell sees the job stopped with the lane still held; fg gives it
    the terminal again; bg continues it without, until it wants the terminal and stops again."""
    shell = procs.spawn(pexpect.spawn("bash", ["--norc", "--noprofile", "-i"], timeout=30,
                                      encoding="utf-8",
                                      env=environ({"PS1": "PROMPT$ ", "HISTFILE": "/dev/null"})))
    shell.expect_exact("PROMPT$ ")
    shell.sendline(f"{shlex.join(LANELOCK)} run -- sh -c 'echo \"READY $$\"; exec cat'")
    shell.expect(r"READY (\d+)")
    command = int(shell.match.group(1))
    wrapper = psutil.Process(command).ppid()
    assert os.getpgid(command) == command != os.getpgid(wrapper)
    assert tpgid(command) == command, "the command's group has the terminal"

    def cat_echoes(word: str) -> None:   # the terminal echoes the word, then cat writes it
        shell.sendline(word)
        shell.expect_exact(f"{word}\r\n{word}\r\n")

    cat_echoes("ping")
    shell.sendcontrol("z")
    shell.expect("Stopped")
    shell.expect_exact("PROMPT$ ")
    assert psutil.Process(command).status() == psutil.STATUS_STOPPED
    assert psutil.Process(wrapper).status() == psutil.STATUS_STOPPED
    assert lanelock("probe").returncode == 1, "a stopped turn keeps the lane"
    shell.sendline("fg")
    cat_echoes("pong")
    assert tpgid(command) == command
    shell.sendcontrol("z")
    shell.expect("Stopped")
    shell.expect_exact("PROMPT$ ")
    shell.sendline("bg")   # cat reads the terminal from the background: SIGTTIN stops the job
    shell.expect_exact("PROMPT$ ")
    # bash tells of a background job's stop at its next prompt; the wrapper tells no one.
    wait_for(lambda: psutil.Process(wrapper).status() == psutil.STATUS_STOPPED,
             what="the job to stop for the terminal")
    assert psutil.Process(command).status() == psutil.STATUS_STOPPED
    shell.sendline("jobs")
    shell.expect("Stopped")
    shell.expect_exact("PROMPT$ ")
    shell.sendline("fg")
    cat_echoes("again")
    shell.sendcontrol("d")   # cat's end of input: the turn ends
    shell.expect_exact("PROMPT$ ")
    shell.sendline("echo rc=$?")
    shell.expect(r"rc=(\d+)")
    assert shell.match.group(1) == "0"
    wait_exit(wrapper)
    assert lanelock("probe").returncode == 0
    shell.sendline("exit")
    shell.expect(pexpect.EOF)


def test_a_pipeline_s_reader_keeps_the_terminal(procs, lanelock):
    """`lanelock run -- cmd | less`: the pager shares the wrapper's group, so the foreground is
    not handed away from it (it would stop for SIGTTIN while the command fills the pipe); ^C
    reaches the wrapper, which sends it to the command's group."""
    shell = procs.spawn(pexpect.spawn("bash", ["--norc", "--noprofile", "-i"], timeout=30,
                                      encoding="utf-8",
                                      env=environ({"PS1": "PROMPT$ ", "HISTFILE": "/dev/null"})))
    shell.expect_exact("PROMPT$ ")
    reader = "read first; echo \"pipe: $first\"; read x < /dev/tty; echo \"got $x\"; cat >/dev/null"
    shell.sendline(f"{shlex.join(LANELOCK)} run -- sh -c 'echo \"READY $$\"; exec sleep 600' | "
                   f"sh -c {shlex.quote(reader)}")
    shell.expect(r"pipe: READY (\d+)")
    command = int(shell.match.group(1))
    procs.adopt(command)
    shell.sendline("hello")
    shell.expect_exact("got hello")   # the reader had the terminal
    death = ExitWatch(command)
    shell.sendintr()
    death.wait()
    shell.expect_exact("PROMPT$ ")
    assert lanelock("probe").returncode == 0
    shell.sendline("exit")
    shell.expect(pexpect.EOF)


def test_ctrl_c_ends_the_command_and_the_rest_of_its_group_keeps_the_lane(procs, lanelock):
    """^C goes to the command's group, which has the terminal. A background job of a script
    ignores SIGINT: sh dies of the ^C, its job does not, and the lane waits for the job; the
    wrapper then dies of the SIGINT its command died of (a calling loop stops)."""
    # The job says READY once it ignores SIGINT (as `sleep &` would, but without a race).
    job = (f"{shlex.quote(sys.executable)} -c 'import os, signal, time; "
           "signal.signal(signal.SIGINT, signal.SIG_IGN); print(\"READY\", os.getpid(), "
           "flush=True); time.sleep(600)' & wait; echo done")
    child = procs.spawn(pexpect.spawn(LANELOCK[0], [*LANELOCK[1:], "run", "--", "sh", "-c", job],
                                      env=environ(), timeout=30, encoding="utf-8"))
    child.expect(r"READY (\d+)")
    work = int(child.match.group(1))
    procs.adopt(work)
    death = ExitWatch(work)
    child.sendintr()
    child.expect(r"process group still runs \(pid (\d+)")
    assert int(child.match.group(1)) == work
    assert lanelock("probe").returncode == 1
    os.kill(work, signal.SIGTERM)
    death.wait()
    child.expect(pexpect.EOF)
    child.close()
    assert child.signalstatus == signal.SIGINT or child.exitstatus == 130, child.before
    assert "done" not in child.before
    assert lanelock("probe").returncode == 0


# -- PostgreSQL -------------------------------------------------------------------------------------
def test_a_killed_wrapper_s_group_keeps_a_postgresql_lane(postgres, monkeypatch, holder, procs,
                                                          lanelock):
    import psycopg

    from lanelock.store.pg.store import lane_key

    monkeypatch.setenv("LANELOCK_STORE", postgres.dsn)
    held = holder(command=SLEEP_TURN)
    shell, work = started(held, "sleep", procs)
    shell_death = ExitWatch(shell)
    os.kill(held.pid, signal.SIGKILL)
    held.wait()
    shell_death.wait()
    where = json.loads(lanelock("where", "--json").stdout)
    # The server lets the killed session's lock go once it sees the connection close: take it
    # and let it go, so what follows is the record's doing, not the dead session's.
    with psycopg.connect(postgres.dsn, autocommit=True, connect_timeout=10,
                         options=f"-c statement_timeout={int(TIMEOUT * 1000)}") as conn:
        conn.execute("SELECT pg_advisory_lock(%s, %s)", lane_key(where["lane"]))
    try:
        probe = lanelock("probe")
        assert probe.returncode == 1 and f"process group {shell}" in probe.stdout, probe
        busy = lanelock("run", "--", "true")
        assert busy.returncode == 75 and "still ending" in busy.stderr, busy.stderr
    finally:
        os.kill(work, signal.SIGKILL)
    wait_exit(work)
    assert lanelock("probe").returncode == 0
