"""A holder record made in another pid namespace (a container sharing the lock root): its pids
are that namespace's, so a turn outside it maps them to its own through /proc/PID/status's NSpid,
NSpgid and NSsid lines before it judges them -- else a killed turn's command still running in
the container would look gone, and the next turn would run beside it.

A record names its namespace ("pidns": the inode of /proc/self/ns/pid) only when it is not the
machine's first one, so a record made outside any container is as it always was. A process
counts as the record's only when /proc/PID/ns/pid is that namespace: the same pid numbers exist
in every namespace.
"""

from __future__ import annotations

import os

INIT = 0xEFFFFFFC   # PROC_PID_INIT_INO: the initial pid namespace's inode
FIELDS = (("pid", "NSpid"), ("command_pid", "NSpid"), ("command_pgid", "NSpgid"),
          ("command_sid", "NSsid"))
_own: list = []


def own() -> int | None:
    """This process's pid namespace (None: cannot tell)."""
    if not _own:
        try:
            _own.append(os.stat("/proc/self/ns/pid").st_ino)
        except OSError:
            _own.append(None)
    return _own[0]


def mark() -> dict:
    """What a record says of its namespace: {} in the machine's first one."""
    mine = own()
    return {} if mine in (None, INIT) else {"pidns": mine}


def translated(record: dict) -> dict:
    """record with its pids as this process sees them, when it was made in another namespace;
    a pid of a process that cannot be found here (gone, or not to be seen) is left out, so it is
    judged as a process that ended -- the kernel's lock, not the record, says who holds."""
    theirs = record.get("pidns")
    if not isinstance(theirs, int) or isinstance(theirs, bool) or theirs == own():
        return record
    wanted = {key: record[key] for key, _ in FIELDS
              if isinstance(record.get(key), int) and not isinstance(record.get(key), bool)}
    found = _map(theirs, wanted)
    if wanted.get("command_pid") == wanted.get("command_pgid") and "command_pgid" in found:
        # the command leads its group: its pid here is the group's id here, even once it has
        # ended and only the rest of its group runs on (found through their NSpgid)
        found["command_pid"] = found["command_pgid"]
    out = {key: value for key, value in record.items() if key not in wanted}
    out.update(found)
    return out


def _map(namespace: int, wanted: dict) -> dict:
    """{field: this namespace's number} for each field whose number a process of namespace has
    (as its pid, group or session, by the field's NS line)."""
    lines = dict(FIELDS)
    found: dict = {}
    try:
        pids = [entry for entry in os.listdir("/proc") if entry.isdigit()]
    except OSError:
        return found
    for pid in pids:
        if len(found) == len(wanted):
            break
        try:
            if os.stat(f"/proc/{pid}/ns/pid").st_ino != namespace:
                continue
            with open(f"/proc/{pid}/status", "rb") as handle:
                status = handle.read().decode("ascii", "replace")
        except OSError:
            continue
        numbers = {}
        for line in status.splitlines():
            name, _, rest = line.partition(":")
            if name in ("NSpid", "NSpgid", "NSsid"):
                numbers[name] = rest.split()
        for key, value in wanted.items():
            seen = numbers.get(lines[key])
            if key not in found and seen and seen[-1] == str(value):
                found[key] = int(seen[0])
    return found
