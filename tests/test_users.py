"""Issue 15, item 10: several users on one lane. The root is shared by every user (as it must be);
whichever user took the lane first, every other user's turn must record its holder facts where
`status` and deflections find them, with no warning. Real processes under two non-root users and
root, in every order.
"""

from __future__ import annotations

import itertools
import json
import os
import pwd
import shutil
import sys
import tempfile

import pytest

USERS = ("nobody", "daemon", "root")


# This Python may live where other users cannot reach it (pyenv under a 0700 /root): the process
# starts as root, imports everything a turn and `status` need, then becomes the user for good
# (groups, gid, uid) before lanelock reads a single argument. A real process of that user.
AS_USER = """
import os, pwd, sys
import click, psutil, shlex, datetime, ipaddress, hashlib, ctypes, tomllib, json, select, threading
import urllib.parse
import lanelock.cli, lanelock.run.wrapper, lanelock.run.chain, lanelock.run.runner
import lanelock.inspection.status, lanelock.inspection.render, lanelock.inspection.history
import lanelock.holder, lanelock.store.flock.survey, lanelock.store.flock.waiting
from lanelock.__main__ import entry
user = pwd.getpwnam(sys.argv[1])
os.setgroups([])
os.setgid(user.pw_gid)
os.setuid(user.pw_uid)
os.environ.update(HOME=user.pw_dir, USER=user.pw_name, LOGNAME=user.pw_name)
sys.argv = ["lanelock", *sys.argv[2:]]
entry()
"""


@pytest.fixture(scope="module")
def users():
    if os.geteuid() != 0:
        pytest.skip("needs root to run turns as other users")
    for name in USERS:
        try:
            pwd.getpwnam(name)
        except KeyError:
            pytest.skip(f"no user {name}")
    return USERS


@pytest.fixture
def shared_root(monkeypatch, lock_roots):
    """A lock root every user can reach (pytest's tmp_path sits under root's 0700 directories):
    a 1777 directory like /run/lock, in which whoever comes first makes the root. Watched by the
    teardown check, removed after it."""
    base = tempfile.mkdtemp(prefix="lanelock-users-", dir="/tmp")
    lock_roots.after(lambda: shutil.rmtree(base, ignore_errors=True))
    os.chmod(base, 0o1777)
    root = os.path.join(base, "locks")
    lock_roots.watch(root)
    monkeypatch.setenv("LANELOCK_DIR", root)
    # conftest's config paths are under root's 0700 tmp_path: another user could not even look,
    # and an unreadable config fails open
    monkeypatch.setenv("LANELOCK_CONFIG", os.path.join(base, "no-user-config.toml"))
    monkeypatch.setenv("LANELOCK_SYSTEM_CONFIG", os.path.join(base, "no-system-config.toml"))
    return root


def launcher(user: str) -> list[str]:
    """What stands for `python -m lanelock` to run lanelock as user: a script file named
    lanelock, so `status` recognises the wrapper by its command line."""
    script = os.path.join(os.path.dirname(os.environ["LANELOCK_DIR"]), "lanelock")
    if not os.path.exists(script):
        with open(script, "w") as handle:
            handle.write(AS_USER)
    return [sys.executable, script, user]


def as_user(user: str, *args) -> list[str]:
    return [*launcher(user), *args]


def test_the_turns_really_run_as_those_users(users, shared_root, run_cmd):
    for user in USERS:
        done = run_cmd(as_user(user, "run", "-b", "localhost:7041", "--", "id", "-un"))
        assert (done.returncode, done.stdout) == (0, f"{user}\n"), done


@pytest.mark.parametrize("order", list(itertools.permutations(USERS)),
                         ids=lambda order: "-".join(order))
def test_every_users_turn_is_labelled_without_a_warning(order, users, shared_root, holder, lanelock,
                                                       run_cmd):
    backend = "localhost:7040"
    for user in order:
        held = holder("-b", backend, "-s", f"{user}-session", "-m", f"{user}-model",
                      launcher=launcher(user))
        status = lanelock("status", "-b", backend, "--json")
        lane = json.loads(status.stdout)["lanes"][0]
        assert lane["verdict"] == "held", lane["message"]
        assert (lane["holder"]["session"], lane["holder"]["model"]) == (f"{user}-session",
                                                                         f"{user}-model")
        for other in USERS:   # every user's deflection names the holder
            deflected = run_cmd(as_user(other, "run", "-b", backend, "--", "true"))
            assert deflected.returncode == 75
            assert f"session {user}-session" in deflected.stderr, deflected.stderr
            assert "warning" not in deflected.stderr, deflected.stderr
        assert held.release() == 0
        assert held.stderr() == "", f"{user}'s turn warned"
        status = lanelock("status", "-b", backend, "--json")
        lane = json.loads(status.stdout)["lanes"][0]
        assert lane["verdict"] == "released", lane["message"]
        assert lane["last"]["session"] == f"{user}-session"
