"""Other users on this machine, for the tests of one lane shared by several users
(test_users.py, test_priority_hosts.py, test_threat.py): a lock root every user can reach, and a
launcher that runs lanelock as a given user.

A real process of that user: it starts as root, imports the whole lanelock package (and the
libraries it uses) while it can still read them, then becomes the user for good (groups, gid,
uid) before lanelock reads a single argument. The checkout and its venv may sit where no other
user can reach them (under a 0700 home, as root's is): a module lanelock imports lazily, after
the switch, would fail with "cannot import name" -- so every module is imported first, and an
extra's module whose library is not installed (the proxy's aiohttp, the PostgreSQL store's
psycopg) is left out.

Fixtures (import them by name into the test module: `from support.other_users import users, shared_root
# noqa: F401 - fixtures`): users, two_users (throwaway accounts), shared_root.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import tempfile

import pytest

USERS = ("nobody", "daemon", "root")

AS_USER = """
import importlib, os, pkgutil, pwd, sys
import lanelock
for module in pkgutil.walk_packages(lanelock.__path__, "lanelock."):
    if module.name.startswith("lanelock.testing."):
        continue   # the duel's helpers: a turn never imports them
    try:
        importlib.import_module(module.name)
    except ImportError:
        pass   # an extra whose library is not installed: no turn here needs it
import click, psutil, shlex, datetime, ipaddress, hashlib, ctypes, tomllib, json, select, threading
import difflib, encodings.idna   # click suggests a misspelt option with one; host names need the other
import urllib.parse
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
