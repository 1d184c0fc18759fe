"""Several users on one lane. The root is shared by every user (as it must be);
whichever user took the lane first, every other user's turn must record its holder facts where
`status` and deflections find them, with no warning. Real processes under two non-root users and
root, in every order.
"""

from __future__ import annotations

import itertools
import json

import pytest

from support.other_users import USERS, as_user, launcher, shared_root, users  # noqa: F401 - fixtures


def test_the_turns_really_run_as_those_users(users, shared_root, run_cmd):
    for user in USERS:
        done = run_cmd(as_user(user, "run", "-b", "localhost:7041", "--", "id", "-un"))
        assert (done.returncode, done.stdout) == (0, f"{user}\n"), done


# One order in the default tier (a non-root user first, then root); every order in the slow tier.
QUICK_ORDERS = {("nobody", "daemon", "root")}


@pytest.mark.parametrize("order", [
    order if order in QUICK_ORDERS else pytest.param(order, marks=pytest.mark.slow)
    for order in itertools.permutations(USERS)], ids=lambda order: "-".join(order))
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


def test_other_users_turns_run_from_a_checkout_they_cannot_reach(users, shared_root, run_cmd,
                                                               tmp_path):
    """A checkout under a 0700 home (root's, many users'): the launcher imports lanelock as root,
    then becomes the user, who can no longer read a module lanelock imports later."""
    import shutil
    from pathlib import Path

    import lanelock

    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    shutil.copytree(Path(lanelock.__file__).parent, private / "lanelock",
                    ignore=shutil.ignore_patterns("__pycache__"))
    env = {"PYTHONPATH": str(private)}
    for user in ("nobody", "daemon"):
        held = run_cmd(as_user(user, "run", "-b", "localhost:7044", "--", "id", "-un"), env=env)
        assert (held.returncode, held.stdout, held.stderr) == (0, f"{user}\n", ""), held
        shown = run_cmd(as_user(user, "status", "-b", "localhost:7044"), env=env)
        assert shown.returncode == 0 and "Traceback" not in shown.stderr, shown
