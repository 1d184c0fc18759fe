"""Seats under the threat model (docs/threat-model.md): no other local user's file turns the gate
off, crashes a turn or raises a count. A root-owned 1777 lock root shared by two throwaway users
made here (useradd) and removed after; every turn a real process of its user.

The seats folder and seat files are made by whoever sets the count (root here), so a turn's user
owns none of them; anything another user made or changed there makes that seat unusable, said
in one line (deflect or wait, never run beside one too many, never exit 70).
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest

from support.cli import LANE, STEM
from support.processes import read_line
from support.other_users import AS_USER, shared_root, two_users  # noqa: F401 - fixtures

SEATED = ["sh", "-c", 'echo "ready $$ $LANELOCK_SEAT"; read code; exit "${code:-0}"']


@pytest.fixture
def launcher_script(tmp_path) -> str:
    script = tmp_path / "lanelock"
    script.write_text(AS_USER)
    return str(script)


@pytest.fixture
def root_owned(shared_root, monkeypatch) -> str:
    """The shared root, made by root, 1777 like /run/lock."""
    os.mkdir(shared_root)
    os.chmod(shared_root, 0o1777)
    monkeypatch.setenv("LANELOCK_CONFIG", "/nonexistent-lanelock/user.toml")
    monkeypatch.setenv("LANELOCK_SYSTEM_CONFIG", "/nonexistent-lanelock/system.toml")
    return shared_root


def as_user(script: str, user: str, *args) -> list[str]:
    return [sys.executable, script, user, *args]


def as_shell(run_cmd, user: str, code: str, *args):
    """A python snippet run as user (p: its first argument)."""
    done = run_cmd(["runuser", "-u", user, "--", "/usr/bin/python3", "-c",
                    f"import fcntl, os, sys, json\np = sys.argv[1]\n{code}", *args])
    assert done.returncode == 0, done
    return done


def deflected_in_one_line(done, *words) -> str:
    """The command did not run (deflected: an attacked gate is not a broken one), and lanelock
    said why in one line -- never exit 70, never a traceback."""
    assert (done.returncode, done.stdout) == (75, ""), done
    lines = [line for line in done.stderr.splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("lanelock:"), done.stderr
    for word in words:
        assert word in lines[0], done.stderr
    return lines[0]


def flock_as(procs, user: str, path: str, make_folder: bool = False):
    """A process of user holding a flock on path (made 0644; its folder made 1777 first when
    make_folder), until its stdin closes: returned once it holds."""
    flocked = procs.start(["runuser", "-u", user, "--", "/usr/bin/python3", "-c",
                           "import fcntl, os, sys\n"
                           "if sys.argv[2] == '1': os.mkdir(os.path.dirname(sys.argv[1]), 0o1777)\n"
                           "fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR, 0o644)\n"
                           "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('ready', flush=True)\n"
                           "sys.stdin.read()", path, "1" if make_folder else "0"],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert read_line(flocked.stdout).strip() == "ready"
    return flocked


def seats_folder(root: str) -> str:
    return os.path.join(root, f"{STEM}.seats")


def test_the_seats_are_made_by_whoever_sets_the_count(two_users, root_owned, lanelock, run_cmd,
                                                     launcher_script):
    """`lanelock seats 2` (root) makes the folder (1777, sticky, root's), seat 2's lock file
    (0644) and record (0666); a 0700 folder mallory planted before is replaced. No turn's user
    ever owns them, and mallory may not set a count."""
    mallory, alice = two_users
    as_shell(run_cmd, mallory, "os.mkdir(p, 0o700)", seats_folder(root_owned))
    done = lanelock("seats", "-b", LANE, "2")
    assert done.returncode == 0, done
    st = os.lstat(seats_folder(root_owned))
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o1777 | stat.S_ISVTX)
    for name, mode in (("2.lock", 0o644), ("2.json", 0o666)):
        st = os.lstat(os.path.join(seats_folder(root_owned), name))
        assert stat.S_ISREG(st.st_mode) and (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, mode)
    refused = run_cmd(as_user(launcher_script, mallory, "seats", "-b", LANE, "5"))
    assert refused.returncode != 0 and "only root" in refused.stderr, refused
    first = run_cmd(as_user(launcher_script, alice, "run", "-b", LANE, "--", "true"))
    assert first.returncode == 0, first


@pytest.mark.parametrize("how", ["planted-0700", "chmod-by-owner"])
def test_a_seats_folder_another_user_controls_turns_no_gate_off(how, two_users, root_owned,
                                                              lanelock, run_cmd, holder,
                                                              launcher_script):
    """A 0700 folder at STEM.seats of mallory's (planted where none was, or her own chmod'ed):
    alice holds seat 1; every other turn deflects (or waits, and then deflects) naming the folder
    to remove -- never runs beside her, never exit 70 (before: every non-root turn ran)."""
    mallory, alice = two_users
    assert lanelock("seats", "-b", LANE, "2").returncode == 0
    folder = seats_folder(root_owned)
    subprocess.run(["rm", "-rf", folder], check=True)   # a count kept before its folder was made
    if how == "planted-0700":
        as_shell(run_cmd, mallory, "os.mkdir(p, 0o700)", folder)
    else:
        as_shell(run_cmd, mallory, "os.mkdir(p, 0o1777)\n"
                 "os.close(os.open(p + '/2.lock', os.O_CREAT | os.O_RDWR, 0o644))\n"
                 "os.chmod(p, 0o700)", folder)
    held = holder("-b", LANE, "-s", "alices", command=SEATED,
                  launcher=as_user(launcher_script, alice))
    assert held.ready_line.split()[2] == "1"
    for user in (mallory, alice, "root"):
        for wait in ((), ("--wait", "0.3")):
            done = run_cmd(as_user(launcher_script, user, "run", "-b", LANE, *wait, "--",
                                   "echo", "ran"))
            deflected_in_one_line(done, folder)
    status = json.loads(lanelock("status", "-b", LANE, "--json").stdout)["lanes"][0]
    assert status["state"] == "held" and folder in status["message"], status
    assert "remove it" in status["message"], status
    assert held.release() == 0


@pytest.mark.parametrize("kind", ["symlink", "0600", "flocked"])
def test_a_seat_file_planted_by_another_user_deflects_with_the_reason(kind, two_users, root_owned,
                                                                    lanelock, run_cmd, holder,
                                                                    procs, launcher_script):
    """Seat 2's lock file gone, mallory plants one: a symlink (before: every turn failed open), a
    0600 file (before: every waiting turn died with exit 70) or a file she holds a flock on.
    With seat 1 held, every turn deflects or waits naming the seat file and the fix; status
    names it; setting the count again replaces it and seat 2 is taken."""
    mallory, alice = two_users
    assert lanelock("seats", "-b", LANE, "2").returncode == 0
    lock = os.path.join(seats_folder(root_owned), "2.lock")
    os.makedirs(seats_folder(root_owned), exist_ok=True)
    os.chmod(seats_folder(root_owned), 0o1777 | stat.S_ISVTX)
    for name in (lock, lock[:-len(".lock")] + ".json"):   # lost, or never made yet
        if os.path.lexists(name):
            os.unlink(name)
    if kind == "symlink":
        as_shell(run_cmd, mallory, "os.symlink('/etc/hostname', p)", lock)
    elif kind == "0600":
        as_shell(run_cmd, mallory, "os.close(os.open(p, os.O_CREAT | os.O_RDWR, 0o600))", lock)
    else:
        flock_as(procs, mallory, lock)   # held until the test ends (procs)
    held = holder("-b", LANE, "-s", "alices", command=SEATED,
                  launcher=as_user(launcher_script, alice))
    for user in (alice, mallory):
        for wait in ((), ("--wait", "0.3")):
            done = run_cmd(as_user(launcher_script, user, "run", "-b", LANE, *wait, "--",
                                   "echo", "ran"))
            deflected_in_one_line(done, lock, "remove it")
    status = json.loads(lanelock("status", "-b", LANE, "--json").stdout)["lanes"][0]
    assert status["state"] == "held" and lock in status["message"], status
    assert lanelock("seats", "-b", LANE, "2").returncode == 0   # root makes seat 2 again
    second = holder("-b", LANE, "-s", "seconds", command=SEATED,
                    launcher=as_user(launcher_script, mallory))
    assert second.ready_line.split()[2] == "2"
    assert second.release() == 0
    assert held.release() == 0


def test_a_users_own_kept_values_are_not_believed(two_users, root_owned, lanelock, run_cmd,
                                                  holder, launcher_script):
    """mallory writes her own kept.json (5 seats) in the shared root: her turns take the lane as
    one seat, as everyone's do (before: two of hers held it at once)."""
    mallory, _ = two_users
    as_shell(run_cmd, mallory, "fd = os.open(p, os.O_CREAT | os.O_WRONLY, 0o644)\n"
             f"os.write(fd, json.dumps({{'seats/{LANE}': 5}}).encode())",
             os.path.join(root_owned, "kept.json"))
    held = holder("-b", LANE, command=SEATED, launcher=as_user(launcher_script, mallory))
    done = run_cmd(as_user(launcher_script, mallory, "run", "-b", LANE, "--", "echo", "ran"))
    assert (done.returncode, done.stdout) == (75, ""), done
    assert "kept.json" in done.stderr, done.stderr
    assert held.release() == 0


def test_a_flocked_seat_file_in_a_folder_of_her_own_keeps_no_one_off_a_one_seat_lane(
        two_users, root_owned, lanelock, run_cmd, procs, launcher_script):
    """mallory makes the seats folder of a one-seat lane, a seat 7 in it she holds a flock on,
    and a kept.json of {}: alice's turns take the free lane (before: every turn deflected)."""
    mallory, alice = two_users
    as_shell(run_cmd, mallory, "os.close(os.open(p, os.O_CREAT | os.O_WRONLY, 0o644))\n"
             "open(p, 'w').write('{}')", os.path.join(root_owned, "kept.json"))
    folder = seats_folder(root_owned)
    flock_as(procs, mallory, os.path.join(folder, "7.lock"), make_folder=True)
    done = run_cmd(as_user(launcher_script, alice, "run", "-b", LANE, "--", "echo", "ran"))
    assert (done.returncode, done.stdout) == (0, "ran\n"), done


def test_a_file_that_took_a_removed_seat_files_inode_number_is_not_its_holder(
        root_owned, lanelock, holder, procs):
    """Seat 2's lock file removed while nobody holds it; the next file made on the filesystem
    in its folder takes its inode number (ext4 hands a freed number out again at once), and another program
    holds a flock on that file. That program is not seat 2's holder: status says seat 2 is
    missing, never split, and setting the count again makes it (before: refused, naming the
    other program as the seat's holder -- the kernel's lock table names inodes only)."""
    assert lanelock("seats", "-b", LANE, "2").returncode == 0
    first = holder("-b", LANE, "-s", "roots", command=SEATED)
    lock = os.path.join(seats_folder(root_owned), "2.lock")
    inode = os.stat(lock).st_ino
    for name in (lock, lock[:-len(".lock")] + ".json"):
        os.unlink(name)
    other = os.path.join(seats_folder(root_owned), "another-program.lock")   # the same block group
    flock_as(procs, "root", other)
    if os.stat(other).st_ino != inode:
        pytest.skip("this filesystem gave the new file a new inode number")
    lane = json.loads(lanelock("status", "-b", LANE, "--json").stdout)["lanes"][0]
    assert "split" not in lane["message"] and "missing" in lane["message"], lane
    again = lanelock("seats", "-b", LANE, "2")
    assert again.returncode == 0, again
    second = holder("-b", LANE, "-s", "seconds", command=SEATED)
    assert second.ready_line.split()[2] == "2"
    assert second.release() == 0
    assert first.release() == 0


def test_a_seat_file_moved_aside_under_its_holder_is_found_and_said_split(
        two_users, root_owned, lanelock, run_cmd, holder, launcher_script):
    """Root holds seat 1, alice seat 2; the folder's owner (root) moves seat 2's lock file and
    record aside. No third turn takes seat 2 (before: mallory's did, three on a lane of two);
    root's status says the lane is split and names alice's turn, never "1 free"; setting the
    count again is refused while she holds the moved file, and works once she has let go."""
    mallory, alice = two_users
    assert lanelock("seats", "-b", LANE, "2").returncode == 0
    first = holder("-b", LANE, "-s", "roots", command=SEATED)
    second = holder("-b", LANE, "-s", "alices", command=SEATED,
                    launcher=as_user(launcher_script, alice))
    assert [first.ready_line.split()[2], second.ready_line.split()[2]] == ["1", "2"]
    folder = seats_folder(root_owned)
    for name in ("2.lock", "2.json"):
        os.rename(os.path.join(folder, name), os.path.join(folder, f"aside-{name}"))
    for user in (mallory, alice):
        done = run_cmd(as_user(launcher_script, user, "run", "-b", LANE, "--", "echo", "ran"))
        deflected_in_one_line(done, os.path.join(folder, "2.lock"))
    lane = json.loads(lanelock("status", "-b", LANE, "--json").stdout)["lanes"][0]
    assert (lane["state"], lane["held_seats"]) == ("held", 2), lane
    assert "split" in lane["message"] and f"pid {second.pid}" in lane["message"], lane
    assert "free" not in lane["message"], lane
    again = lanelock("seats", "-b", LANE, "2")
    assert again.returncode != 0 and f"pid {second.pid}" in again.stderr, again
    assert second.release() == 0
    assert lanelock("seats", "-b", LANE, "2").returncode == 0
    third = holder("-b", LANE, "-s", "mallorys", command=SEATED,
                   launcher=as_user(launcher_script, mallory))
    assert third.ready_line.split()[2] == "2"
    assert third.release() == 0
    assert first.release() == 0
