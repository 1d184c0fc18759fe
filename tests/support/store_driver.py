"""A process taking turns through one store, for tests/test_store_contract.py:

    store_driver.py KIND WHERE BACKEND hold SESSION     hold the lane; print "held PID", then
                                                        let go at a line on stdin (or EOF)
    store_driver.py KIND WHERE BACKEND turn SESSION WAIT    one turn; print its facts as JSON
    store_driver.py KIND WHERE BACKEND handover SESSION     hold, then print the JSON of a child
                                                        given turn.env and of one that was not
    store_driver.py KIND WHERE BACKEND command SESSION  hold, run `sleep 600` as the turn's command
                                                        (a session of its own), print "held PID
                                                        COMMAND-PID", then wait to be killed

KIND: flock (WHERE: the lock root), postgresql (WHERE: the store URL), contract or
contract-ordered (WHERE: the directory of tests/support/contract_store.py's store, without or with
a queue).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/

from lanelock import Gate  # noqa: E402


def gate(kind: str, where: str, backend: str) -> Gate:
    if kind == "contract":
        from support.contract_store import ContractStore

        return Gate(backend, lane_store=ContractStore(where))
    if kind == "contract-ordered":
        from support.contract_store import OrderedContractStore

        return Gate(backend, lane_store=OrderedContractStore(where))
    if kind == "postgresql":
        return Gate(backend, store=where)
    return Gate(backend, lock_dir=where)


def facts(turn) -> dict:
    return {"state": turn.state, "reason": turn.reason, "holder": turn.holder,
            "waited": turn.waited, "nested": turn.nested, "pid": os.getpid()}


def main(kind: str, where: str, backend: str, action: str, session: str, *rest: str) -> int:
    lane = gate(kind, where, backend)
    if action == "turn":
        wait = None if rest[0] == "forever" else float(rest[0])
        with lane.turn(session=session, wait=wait) as turn:
            print(json.dumps(facts(turn)), flush=True)
        return 0
    with lane.turn(session=session, wait=None) as turn:
        assert turn.held, turn.state
        if action == "hold":
            print(f"held {os.getpid()}", flush=True)
            sys.stdin.readline()
            return 0
        if action == "command":
            command = subprocess.Popen(["sleep", "600"], env={**os.environ, **turn.env},
                                       start_new_session=True)
            turn.command_started(command.pid)
            print(f"held {os.getpid()} {command.pid}", flush=True)
            sys.stdin.readline()
            return 0
        ask = [sys.executable, __file__, kind, where, backend, "turn", f"{session}-child", "0"]
        handed = subprocess.run(ask, env={**os.environ, **turn.env}, capture_output=True,
                                text=True, check=True)
        plain = subprocess.run(ask, capture_output=True, text=True, check=True)
        print(json.dumps({"handed": json.loads(handed.stdout), "plain": json.loads(plain.stdout)}),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
