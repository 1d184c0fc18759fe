"""The threat model (README "Several users", man page THREAT MODEL): another local user may hold
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
import shutil
import subprocess
import sys
import tempfile

import pytest

from conftest import LANE, STEM, read_line
from test_users import AS_USER, shared_root  # noqa: F401 - a fixture

NOWHERE = "/nonexistent-lanelock"   # config files another user could not read: none at all


@pytest.fixture(scope="module")
def two_users():
    """Two unprivileged users of this test's own, removed after it: (mallory, alice)."""
    if os.geteuid() != 0 or shutil.which("useradd") is None:
        pytest.skip("needs root and useradd to make throwaway users")
    names = [f"llt{which}{os.urandom(3).hex()}" for which in ("m", "a")]
    made = []
    try:
        for name in names:
            subprocess.run(["useradd", "--no-create-home", "--no-user-group", "--shell",
                            "/usr/sbin/nologin", name], check=True, capture_output=True)
            made.append(name)
        yield tuple(names)
    finally:
        for name in made:
            subprocess.run(["userdel", name], capture_output=True)


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


def ran_ungated_saying(done, *words) -> str:
    """The command ran (fail open), and lanelock said why in exactly one line."""
    assert (done.returncode, done.stdout) == (0, "ran\n"), done
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
    lock file in it (splitting each lane) or chmod it shut (everyone fails open). Every other
    user's turn -- root's too -- refuses it, naming her and the fix, and creates nothing there."""
    mallory, alice = two_users
    made = run_cmd(namespace.as_user(mallory, "mkdir", "-m", mode, "/run/lock/lanelock"))
    assert made.returncode == 0, made
    for user in (alice, "root"):
        done = run_cmd(namespace.lanelock(user, "run", "-b", LANE, "--", "echo", "ran"))
        ran_ungated_saying(done, f"owned by uid {uid(mallory)} ({mallory})",
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
        ran_ungated_saying(done, "without the sticky bit", "not trusting it")
    assert run_cmd(namespace.argv("ls", "-A", "/run/lock/lanelock")).stdout == ""


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
