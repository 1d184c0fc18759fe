"""The threat model (docs/threat-model.md, man page THREAT MODEL): another local user may hold
a shared lane, never split it unseen, switch the gate off for everyone, or make lanelock write
through a link. Real processes under two throwaway users made here (useradd) and removed after.

The default root is tested in a mount namespace of its own with a fresh tmpfs on /run/lock
(unshare, nsenter): the machine's /run/lock is never touched, and the namespace (with its root)
goes when its one process is killed.
"""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import subprocess
import sys
import time

import pytest

from support.cli import LANE, STEM
from support.processes import read_line
from support.other_users import AS_USER, shared_root, two_users  # noqa: F401 - fixtures

NOWHERE = "/nonexistent-lanelock"   # config files another user could not read: none at all


def uid(user: str) -> int:
    return pwd.getpwnam(user).pw_uid


@pytest.fixture
def launcher_script(tmp_path) -> str:
    """test_users' launcher (starts as root, imports, then becomes the user for good), where
    root reads it before it is another user."""
    script = tmp_path / "lanelock"
    script.write_text(AS_USER)
    return str(script)


@pytest.fixture
def user_env(monkeypatch):
    monkeypatch.setenv("LANELOCK_CONFIG", f"{NOWHERE}/user.toml")
    monkeypatch.setenv("LANELOCK_SYSTEM_CONFIG", f"{NOWHERE}/system.toml")


class Namespace:
    """One process in a mount namespace of its own, a fresh 1777 tmpfs on /run/lock there; every
    command of the test enters it (nsenter). The default root is then /run/lock/lanelock, this
    test's alone."""

    def __init__(self, procs, script: str):
        self.script = script
        self.process = procs.start(
            ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
             "mount -t tmpfs -o mode=1777,size=4m lanelock-threat /run/lock && echo ready "
             "&& exec sleep 3600"], stdout=subprocess.PIPE)
        assert read_line(self.process.stdout).strip() == "ready"

    def argv(self, *words) -> list[str]:
        return ["nsenter", "-t", str(self.process.pid), "-m", "--", *words]

    def as_user(self, user: str, *words) -> list[str]:
        """A command as user in the namespace (root: as is)."""
        if user == "root":
            return self.argv(*words)
        return self.argv("runuser", "-u", user, "--", *words)

    def lanelock(self, user: str, *args) -> list[str]:
        """lanelock ARGS as user in the namespace, with the default root (no LANELOCK_DIR)."""
        return self.argv("env", "-u", "LANELOCK_DIR", sys.executable, self.script, user, *args)


@pytest.fixture
def namespace(procs, launcher_script, two_users, user_env):
    if shutil.which("unshare") is None or shutil.which("nsenter") is None:
        pytest.skip("needs unshare and nsenter")
    return Namespace(procs, launcher_script)


def deflected_saying(done, *words) -> str:
    """The command did not run (the turn deflected: attacked is not broken, so never fail open),
    and lanelock said why in exactly one line."""
    assert (done.returncode, done.stdout) == (75, ""), done
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("lanelock:"), done.stderr
    for word in words:
        assert word in lines[0], done.stderr
    return lines[0]


# -- the default root -----------------------------------------------------------------------------
def test_lanelock_makes_the_default_root_sticky_and_every_user_shares_it(namespace, two_users,
                                                                       run_cmd):
    mallory, alice = two_users
    for user in ("root", mallory, alice):
        done = run_cmd(namespace.lanelock(user, "run", "-b", LANE, "--", "echo", "ran"))
        assert (done.returncode, done.stdout, done.stderr) == (0, "ran\n", ""), (user, done)
    mode = run_cmd(namespace.argv("stat", "-c", "%a %U", "/run/lock/lanelock")).stdout.split()
    assert mode == ["1777", "root"]


@pytest.mark.parametrize("mode", ["755", "1777"])
def test_a_default_root_squatted_by_another_user_is_refused_with_the_fix(namespace, two_users,
                                                                         run_cmd, mode):
    """mallory makes /run/lock/lanelock first after boot: as its owner she could remove every
    lock file in it (splitting each lane) or chmod it shut. Every other user's turn -- root's
    too -- refuses it, deflecting (never failing open: that would be her switch to turn the gate
    off for everyone), naming her and the fix, and creates nothing there."""
    mallory, alice = two_users
    made = run_cmd(namespace.as_user(mallory, "mkdir", "-m", mode, "/run/lock/lanelock"))
    assert made.returncode == 0, made
    for user in (alice, "root"):
        done = run_cmd(namespace.lanelock(user, "run", "-b", LANE, "--", "echo", "ran"))
        deflected_saying(done, "gate_untrusted", f"owned by uid {uid(mallory)} ({mallory})",
                           "install -d -m 1777 /run/lock/lanelock")
    listed = run_cmd(namespace.argv("ls", "-A", "/run/lock/lanelock"))
    assert listed.stdout == "", "a turn created files in the squatter's root"


def test_a_root_owned_default_root_writable_without_the_sticky_bit_is_refused(namespace,
                                                                             two_users, run_cmd):
    """0777 and root's: anyone may remove anyone's lock file in it. Refused whoever owns it."""
    mallory, alice = two_users
    assert run_cmd(namespace.argv("sh", "-c", "mkdir /run/lock/lanelock && "
                                  "chmod 0777 /run/lock/lanelock")).returncode == 0
    for user in (alice, "root"):
        done = run_cmd(namespace.lanelock(user, "run", "-b", LANE, "--", "echo", "ran"))
        deflected_saying(done, "gate_untrusted", "without the sticky bit", "not trusting it")
    assert run_cmd(namespace.argv("ls", "-A", "/run/lock/lanelock")).stdout == ""


@pytest.mark.skipif(shutil.which("systemd-tmpfiles") is None, reason="no systemd-tmpfiles")
def test_the_readme_tmpfiles_line_makes_a_default_root_no_one_can_squat(namespace, two_users,
                                                                        run_cmd, tmp_path):
    """README's /etc/tmpfiles.d line, applied as at boot: the default root is root's and 1777
    before any user runs; mallory cannot take it, and every user's turns run without a word."""
    from support.doc_blocks import block

    mallory, alice = two_users
    conf = tmp_path / "lanelock.conf"
    conf.write_text(block("tmpfiles-root").text)
    made = run_cmd(namespace.argv("systemd-tmpfiles", "--create", str(conf)))
    assert made.returncode == 0, made
    assert run_cmd(namespace.as_user(mallory, "mkdir", "/run/lock/lanelock")).returncode != 0
    for user in (mallory, alice, "root"):
        done = run_cmd(namespace.lanelock(user, "run", "-b", LANE, "--", "echo", "ran"))
        assert (done.returncode, done.stdout, done.stderr) == (0, "ran\n", ""), (user, done)
    mode = run_cmd(namespace.argv("stat", "-c", "%a %U", "/run/lock/lanelock")).stdout.split()
    assert mode == ["1777", "root"]


# -- nothing written through a link or to a file of the wrong type ---------------------------------
WRITTEN = ("journal", "counts", "witness", "json")   # every file a turn or a witness writes


@pytest.fixture
def hardlinks_allowed():
    """fs.protected_hardlinks=0 (as on some distributions): anyone may hard-link a file they
    cannot even read. Restored after the test."""
    path = "/proc/sys/fs/protected_hardlinks"
    with open(path) as handle:
        before = handle.read().strip()
    with open(path, "w") as handle:
        handle.write("0")
    yield
    with open(path, "w") as handle:
        handle.write(before)


def claim_witness(root: str) -> list[str]:
    """A witness's claim on the lane, in a process of its own (what `lanelock watch` takes)."""
    return [sys.executable, "-c", f"""
import types
from lanelock.paths import Root
from lanelock.store.flock.store import FlockStore
from lanelock.errors import GateUnavailable
try:
    claim, _ = FlockStore(Root({root!r}, "flag", "test")).claim_witness(types.SimpleNamespace(stem={STEM!r}))
    print("claimed" if claim else "not claimed")
except GateUnavailable as error:
    print("refused:", error)
"""]


def test_no_write_goes_through_a_hard_link_another_user_planted(two_users, shared_root,
                                                                 hardlinks_allowed, lanelock,
                                                                 run_cmd):
    """mallory links root's private file at every name a turn writes; root's turn and witness
    run and write none of it."""
    mallory, _ = two_users
    os.mkdir(shared_root)
    os.chmod(shared_root, 0o1777)
    secret = os.path.join(os.path.dirname(shared_root), "secret")
    with open(secret, "w") as handle:
        handle.write("root's own\n")
    os.chmod(secret, 0o600)
    for kind in WRITTEN:
        link = run_cmd(["runuser", "-u", mallory, "--", "ln", secret,
                        os.path.join(shared_root, f"{STEM}.{kind}")])
        assert link.returncode == 0, link
    done = lanelock("run", "-b", LANE, "--", "echo", "ran")
    assert (done.returncode, done.stdout) == (0, "ran\n"), done
    assert "hard link" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    claimed = run_cmd(claim_witness(shared_root))
    assert claimed.stdout.startswith("refused:") and "hard link" in claimed.stdout, claimed
    with open(secret) as handle:
        assert handle.read() == "root's own\n"


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_fifo_or_directory_planted_where_a_turn_writes_hangs_nothing(shared_root, lanelock,
                                                                       run_cmd, kind):
    os.mkdir(shared_root)
    os.chmod(shared_root, 0o1777)
    for name in ("journal", "counts", "witness"):
        path = os.path.join(shared_root, f"{STEM}.{name}")
        os.mkfifo(path) if kind == "fifo" else os.mkdir(path)
    done = lanelock("run", "-b", LANE, "--", "echo", "ran", timeout=30)
    assert (done.returncode, done.stdout) == (0, "ran\n"), done
    said = "not a regular file" if kind == "fifo" else "Is a directory"
    assert said in done.stderr and "Traceback" not in done.stderr, done.stderr
    claimed = run_cmd(claim_witness(shared_root), timeout=30)
    assert claimed.stdout.startswith("refused:"), claimed


# -- a queue entry counts only when it is a regular file of its pid's user ---------------------------
FAKE_ENTRY = """
import fcntl, json, os, sys, time
queue, kind = sys.argv[1], sys.argv[2]
name = os.path.join(queue, f"{time.monotonic_ns() - 10**9:020d}.2.1.{os.urandom(4).hex()}")
if kind == "fifo":
    os.mkfifo(name)
    fd = os.open(name, os.O_RDWR)   # holds it open: a reader's open never waits for a writer
else:
    fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    os.write(fd, json.dumps({"session": "systemd", "class": "interactive", "pid": 1}).encode())
fcntl.flock(fd, fcntl.LOCK_EX)
print("ready", flush=True)
sys.stdin.read()
"""


@pytest.mark.parametrize("kind", ["flocked", "fifo"])
def test_a_fake_queue_entry_of_another_user_queues_no_one(two_users, shared_root, procs, lanelock,
                                                         kind):
    """mallory's entry, locked and named for pid 1 (a session "systemd") or a FIFO: a free lane
    is still taken (before: every turn deflected, blaming pid 1 or 'its pid unknown'), and
    status shows no waiter."""
    mallory, _ = two_users
    os.mkdir(shared_root)
    os.chmod(shared_root, 0o1777)
    queue = os.path.join(shared_root, f"{STEM}.queue")
    os.mkdir(queue)
    os.chmod(queue, 0o1777)
    fake = procs.start(["runuser", "-u", mallory, "--", "/usr/bin/python3", "-c", FAKE_ENTRY, queue,
                        kind], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert read_line(fake.stdout).strip() == "ready"
    done = lanelock("run", "-b", LANE, "--", "echo", "ran", timeout=30)
    assert (done.returncode, done.stdout, done.stderr) == (0, "ran\n", ""), done
    status = json.loads(lanelock("status", "-b", LANE, "--json", timeout=30).stdout)["lanes"][0]
    assert status.get("queue", []) == [], status


# -- a holder record is believed only from the lock's holder --------------------------------------
def start_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as handle:
        return int(handle.read().rsplit(")", 1)[1].split()[19])


def forge(run_cmd, user: str, sidecar: str, record: dict) -> None:
    """user rewrites the shared (0666) record in place."""
    from lanelock.holder import SCHEMA

    text = json.dumps({"schema": SCHEMA, **record}) + "\n"
    done = run_cmd(["runuser", "-u", user, "--", "/usr/bin/python3", "-c",
                    "import sys\nwith open(sys.argv[1], 'r+') as f: f.write(sys.argv[2]); "
                    "f.truncate()", sidecar, text])
    assert done.returncode == 0, done
    with open(sidecar) as handle:
        assert json.load(handle)["session"] == record["session"]


@pytest.fixture
def used_lane(shared_root, lanelock) -> str:
    """A lane one turn has used: its lock file and its 0666 record are there."""
    done = lanelock("run", "-b", LANE, "--", "true")
    assert done.returncode == 0, done
    sidecar = os.path.join(shared_root, f"{STEM}.json")
    assert os.stat(sidecar).st_mode & 0o777 == 0o666
    return sidecar


def test_a_forged_record_naming_a_running_command_deflects_no_one(two_users, used_lane, procs,
                                                                  lanelock, run_cmd):
    """mallory's record says a killed turn's command still runs: root's own `sleep` (a group
    and session leader, as a turn's command is), or pid 1. Every turn still takes the free lane
    (before: each deflected while that process lived), and status blames no one."""
    mallory, _ = two_users
    bystander = procs.start(["sleep", "600"])
    dead = procs.start(["true"])
    dead.wait()
    for command in (bystander.pid, 1):
        forge(run_cmd, mallory, used_lane, {
            "pid": dead.pid, "start_ticks": 1, "session": "systemd", "lock_inode": os.stat(
                used_lane[:-len(".json")] + ".lock").st_ino, "command_pid": command,
            "command_start_ticks": start_ticks(command), "command_pgid": command,
            "command_sid": command})
        status = json.loads(lanelock("status", "-b", LANE, "--json").stdout)["lanes"][0]
        assert status["state"] != "held" and not re.search(rf"pid {command}\b", status["message"]), \
            status
        done = lanelock("run", "-b", LANE, "--", "echo", "ran")
        assert (done.returncode, done.stdout, done.stderr) == (0, "ran\n", ""), done


def test_a_forged_record_naming_pid_1_as_holder_blames_no_one(two_users, used_lane, holder,
                                                              lanelock, run_cmd):
    """The lane is held; mallory rewrites the record to say pid 1 (session "systemd") holds it.
    A deflected turn names the real holder."""
    mallory, _ = two_users
    held = holder("-b", LANE, "-s", "the-real-one")
    forge(run_cmd, mallory, used_lane, {
        "pid": 1, "start_ticks": start_ticks(1), "session": "systemd",
        "lock_inode": os.stat(used_lane[:-len(".json")] + ".lock").st_ino})
    done = lanelock("run", "-b", LANE, "--", "echo", "ran")
    assert done.returncode == 75, done
    assert f"pid {held.pid}" in done.stderr and "systemd" not in done.stderr, done.stderr
    assert held.release() == 0


@pytest.mark.skipif(not shutil.which("strace"), reason="needs strace")
def test_another_users_holder_is_named_without_reading_proc_locks(two_users, shared_root, holder,
                                                                 launcher_script, run_cmd,
                                                                 tmp_path):
    """alice holds; mallory's turn may not look at alice's open files, yet names her turn from
    its record (a lanelock process of the uid the record names) without the kernel's lock table,
    which no turn may read."""
    mallory, alice = two_users
    held = holder("-b", LANE, "-s", "alices", launcher=[sys.executable, launcher_script, alice])
    trace = tmp_path / "trace"
    done = run_cmd(["strace", "-f", "-qq", "-e", "trace=openat,open", "-o", str(trace),
                    sys.executable, launcher_script, mallory, "run", "-b", LANE, "--", "true"])
    assert done.returncode == 75, done
    assert f"pid {held.pid}, session alices" in done.stderr, done.stderr
    assert "/proc/locks" not in trace.read_text()
    assert held.release() == 0


def test_another_users_killed_turn_keeps_the_lane_while_its_group_runs(two_users, shared_root,
                                                                       holder, launcher_script,
                                                                       procs, run_cmd):
    """alice's wrapper is killed; the sleep its command started runs on in the command's group.
    mallory's turn cannot read alice's processes' environment, yet waits for it as root's does:
    the group is one lanelock made (leader of its group, not of a session) and runs as the uid
    the record names (before: mallory's turn took the lane beside it)."""
    import signal

    from support.processes import ExitWatch

    mallory, alice = two_users
    held = holder("-b", LANE, command=["sh", "-c", 'sleep 600 & echo "ready $$ $!"; wait'],
                  launcher=[sys.executable, launcher_script, alice])
    work = int(held.ready_line.split()[2])
    procs.adopt(work)
    shell_death = ExitWatch(held.child_pid)
    os.kill(held.pid, signal.SIGKILL)
    held.wait()
    shell_death.wait()   # the command's parent-death signal; its sleep runs on
    for user in (mallory, "root"):
        busy = run_cmd([sys.executable, launcher_script, user, "run", "-b", LANE, "--", "true"])
        assert busy.returncode == 75 and "still ending" in busy.stderr, (user, busy)
    os.kill(work, signal.SIGKILL)


# -- a lock file removed under its holder: the split is found -----------------------------------
def test_a_lock_file_removed_under_its_holder_is_found_and_status_says_split(
        two_users, shared_root, holder, lanelock, run_cmd):
    """alice used the lane first, so its lock file (and record) are hers; while root's turn
    holds the lane she removes both. The next turn creates a new lock file: it finds the live
    holder of the removed one in /proc and deflects, so does every turn after it, and status
    says the lane is split (before: the next turn was held beside it, status said free)."""
    _, alice = two_users
    os.mkdir(shared_root)
    os.chmod(shared_root, 0o1777)
    lock = os.path.join(shared_root, f"{STEM}.lock")
    record = os.path.join(shared_root, f"{STEM}.json")
    made = run_cmd(["runuser", "-u", alice, "--", "/usr/bin/python3", "-c",
                    "import os, sys\nfor path in sys.argv[1:]: os.fchmod(os.open(path, os.O_CREAT"
                    " | os.O_RDWR), 0o666 if path.endswith('.json') else 0o644)", lock, record])
    assert made.returncode == 0 and os.stat(lock).st_uid == uid(alice), made
    held = holder("-b", LANE, "-s", "the-holder")
    assert os.stat(record).st_uid == uid(alice)   # the holder wrote its record in alice's file
    removed = run_cmd(["runuser", "-u", alice, "--", "rm", "-f", lock, record])
    assert removed.returncode == 0 and not os.path.exists(lock), removed
    for _ in range(2):   # the turn that creates the file, and one that opens it
        done = lanelock("run", "-b", LANE, "--", "echo", "ran")
        assert (done.returncode, done.stdout) == (75, ""), done
        assert f"pid {held.pid}" in done.stderr and "split" in done.stderr, done.stderr
    status = json.loads(lanelock("status", "-b", LANE, "--json").stdout)["lanes"][0]
    assert status["state"] == "held" and "split" in status["message"], status
    assert status["holder"]["pid"] == held.pid
    assert held.release() == 0
    done = lanelock("run", "-b", LANE, "--", "echo", "ran")
    assert (done.returncode, done.stdout) == (0, "ran\n"), done


# -- a lock file planted wrong deflects with the reason -------------------------------------------
def plant(kind: str, path: str, user: str, run_cmd) -> None:
    script = {"fifo": "os.mkfifo(p)", "directory": "os.mkdir(p)",
              "0600": "os.close(os.open(p, os.O_CREAT | os.O_RDWR, 0o600))"}[kind]
    done = run_cmd(["runuser", "-u", user, "--", "/usr/bin/python3", "-c",
                    f"import os, sys; p = sys.argv[1]; {script}", path])
    assert done.returncode == 0, done


@pytest.mark.parametrize("kind", ["fifo", "directory", "0600"])
def test_a_lock_file_planted_wrong_deflects_with_the_reason(two_users, shared_root, launcher_script,
                                                           lanelock, run_cmd, kind):
    """mallory plants something at the lane's lock name that alice's turns cannot lock: they
    deflect (75), naming it and the fix, instead of all failing open; status says the same."""
    mallory, alice = two_users
    os.mkdir(shared_root)
    os.chmod(shared_root, 0o1777)
    lock = os.path.join(shared_root, f"{STEM}.lock")
    plant(kind, lock, mallory, run_cmd)
    for wait in ((), ("--wait", "5")):
        done = run_cmd([sys.executable, launcher_script, alice, "run", "-b", LANE, *wait, "--",
                        "echo", "ran"])
        assert (done.returncode, done.stdout) == (75, ""), done
        assert f"lock file {lock}" in done.stderr and "remove it" in done.stderr, done.stderr
    lane = json.loads(lanelock("status", "-b", LANE, "--json").stdout)["lanes"][0]
    assert lane["verdict"] == "bad-lock-file" and "deflect" in lane["message"], lane


# -- status --all asks no engine it was not asked about, beyond a bound ---------------------------
LISTENERS = """
import selectors, socket, sys
chosen, ports = selectors.DefaultSelector(), []
for _ in range(int(sys.argv[1])):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    server.setblocking(False)
    ports.append(server.getsockname()[1])
    chosen.register(server, selectors.EVENT_READ)
chosen.register(sys.stdin, selectors.EVENT_READ)
print(*ports, flush=True)
asked = set()
while True:
    for key, _ in chosen.select():
        if key.fileobj is sys.stdin:
            print(*sorted(asked), flush=True)
            sys.exit(0)
        connection, _ = key.fileobj.accept()
        asked.add(key.fileobj.getsockname()[1])
        connection.close()
"""


def test_status_all_looks_at_a_bounded_number_of_engines_on_this_machine_only(lock_dir, procs,
                                                                            lanelock):
    """Anyone can make lanes (lock files) in the shared root: 3,000 named for hosts elsewhere
    and 20 for local ports, made last. `status --all` judges the ALL_LANES made last (saying in
    one line how many more there are), reaches no other host, and looks at no more than
    ALL_ENGINE_LOOKS local engines (before: it resolved and asked every one)."""
    from lanelock.inspection.status import ALL_ENGINE_LOOKS, ALL_LANES

    listeners = procs.start([sys.executable, "-c", LISTENERS, "20"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    ports = read_line(listeners.stdout).split()
    lock_dir.mkdir()
    # Made last by their times, not by the order of the touches: the kernel stamps files with a
    # coarse clock, and 3,020 touches can share one tick.
    an_hour_ago = time.time() - 3600
    for number in range(3000):
        far = lock_dir / f"10.{number // 250}.{number % 250}.9-80.lock"
        far.touch()
        os.utime(far, (an_hour_ago, an_hour_ago))
    for port in ports:
        (lock_dir / f"localhost-{port}.lock").touch()
    done = lanelock("status", "--all", "--json", timeout=60)
    lanes = json.loads(done.stdout)["lanes"]
    assert len(lanes) == ALL_LANES
    assert f"{3020 - ALL_LANES} more lanes not listed" in done.stderr, done.stderr
    far = [lane for lane in lanes if lane["lane"].startswith("10.")]
    assert all("looks only at engines on this machine" in lane["engine"]["problem"]
               for lane in far), far[0]
    listeners.stdin.close()
    asked = read_line(listeners.stdout).split()
    assert 0 < len(asked) <= ALL_ENGINE_LOOKS, asked
    near = [lane for lane in lanes if lane["lane"].startswith("localhost:")]
    assert len(near) == 20
    assert sum("at most" in (lane["engine"]["problem"] or "") for lane in near) \
        == len(near) - ALL_ENGINE_LOOKS


# -- the threat model is written where users read -------------------------------------------------
def test_the_threat_model_is_in_the_readme_and_the_man_page():
    """docs/threat-model.md and the man page's THREAT MODEL say who is trusted with what and
    what another user can never make lanelock do, the same four things in both."""
    from pathlib import Path

    top = Path(__file__).resolve().parent.parent
    section = (top / "docs" / "threat-model.md").read_text()
    man = (top / "man" / "lanelock.1").read_text()
    manual = man.split(".SH THREAT MODEL", 1)[1].split("\n.SH ", 1)[0]
    for text in (" ".join(section.split()), " ".join(manual.split())):   # lines joined
        assert "not with your files or your terminal" in text
        for never in ("write through a link", "print to your terminal what they wrote",
                      "split a lane unseen", "switch the gate off for everyone"):
            assert never in text.lower().replace("**", ""), never
        assert "journal" in text and "counts" in text   # what is not protected, said plainly


# -- a holder record another user made unwritable: no turn runs unrecorded -----------------------
def test_a_holder_record_its_owner_made_unwritable_keeps_other_users_turns_from_running_unseen(
        two_users, shared_root, holder, launcher_script, procs, run_cmd, lanelock):
    """alice used the lane first (the record is hers) and chmods it 0644: mallory's turns cannot
    record themselves there, so a kill -9 of one would leave its command unseen. They deflect,
    or wait and deflect, naming the record to remove (before: each ran with a warning, and the
    next turn ran beside a killed one's command); status says so. Root's turn records itself
    (and shares the file again); then mallory's killed turn keeps the lane while its group runs."""
    import signal

    from support.processes import ExitWatch

    mallory, alice = two_users
    os.mkdir(shared_root)
    os.chmod(shared_root, 0o1777)
    record = os.path.join(shared_root, f"{STEM}.json")
    first = run_cmd([sys.executable, launcher_script, alice, "run", "-b", LANE, "--", "true"])
    assert first.returncode == 0 and os.stat(record).st_uid == uid(alice), first
    assert run_cmd(["runuser", "-u", alice, "--", "chmod", "0644", record]).returncode == 0
    for wait in ((), ("--wait", "0.3")):
        done = run_cmd([sys.executable, launcher_script, mallory, "run", "-b", LANE, *wait, "--",
                        "echo", "ran"])
        deflected_saying(done, record, "remove it")
    lane = json.loads(lanelock("status", "-b", LANE, "--json").stdout)["lanes"][0]
    assert record in lane["message"] and "remove it" in lane["message"], lane
    done = lanelock("run", "-b", LANE, "--", "echo", "ran")   # root writes any file
    assert (done.returncode, done.stdout, done.stderr) == (0, "ran\n", ""), done
    assert os.stat(record).st_mode & 0o777 == 0o666
    held = holder("-b", LANE, command=["sh", "-c", 'sleep 600 & echo "ready $$ $!"; wait'],
                  launcher=[sys.executable, launcher_script, mallory])
    work = int(held.ready_line.split()[2])
    procs.adopt(work)
    assert run_cmd(["runuser", "-u", alice, "--", "chmod", "0644", record]).returncode == 0
    shell_death = ExitWatch(held.child_pid)
    os.kill(held.pid, signal.SIGKILL)
    held.wait()
    shell_death.wait()
    busy = lanelock("run", "-b", LANE, "--", "true")
    assert busy.returncode == 75 and "still ending" in busy.stderr, busy
    os.kill(work, signal.SIGKILL)


# -- a turn in another pid namespace (a container sharing the root) -----------------------------
def host_pid(namespace_pid: int, of: int) -> int:
    """The pid here of the process numbered namespace_pid in the pid namespace of process of."""
    ns = os.stat(f"/proc/{of}/ns/pid").st_ino
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry}/ns/pid").st_ino != ns:
                continue
            with open(f"/proc/{entry}/status") as handle:
                line = next(line for line in handle if line.startswith("NSpid:"))
        except (OSError, StopIteration):
            continue
        if line.split()[-1] == str(namespace_pid):
            return int(entry)
    raise LookupError(namespace_pid)


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare")
def test_a_killed_turn_in_another_pid_namespace_keeps_the_lane_while_its_group_runs(
        lock_dir, procs, lanelock):
    """A turn in a pid namespace of its own (`unshare --pid --fork --mount-proc`, a container
    sharing the root) records its namespace's pids; its wrapper killed -9 from here, its
    command's sleep runs on: this machine's next turn maps the record through NSpid and waits
    for that group (before: it took the lane beside it)."""
    import signal

    from support.cli import LANELOCK

    container = procs.start(
        ["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c",
         " ".join(LANELOCK) + " run -b " + LANE + " -- sh -c 'sleep 600 & echo \"ready $$ $!\"; "
         "wait'; sleep 600"], stdout=subprocess.PIPE, text=True)
    words = read_line(container.stdout).split()
    assert words[0] == "ready", words
    shell = host_pid(int(words[1]), _child(container.pid))
    work = host_pid(int(words[2]), shell)
    wrapper = int(open(f"/proc/{shell}/stat").read().rsplit(")", 1)[1].split()[1])
    record = json.loads((lock_dir / f"{STEM}.json").read_text())
    assert record["pid"] != wrapper, record   # the namespace's own pid
    os.kill(wrapper, signal.SIGKILL)
    busy = lanelock("run", "-b", LANE, "--", "true")
    assert busy.returncode == 75 and "still ending" in busy.stderr, busy
    os.kill(work, signal.SIGKILL)


def _child(pid: int) -> int:
    """unshare's one child (the namespace's first process)."""
    with open(f"/proc/{pid}/task/{pid}/children") as handle:
        return int(handle.read().split()[0])
