"""What a holder record says of its turn, derived once for every store: alive, reused, ending (a
killed turn's command still running) and stopped. The store reads the record and says what it
alone knows -- whether the record's process is of this machine, whether its lock names it as
holder (facts.held, facts.matches), and whether a running command is really the turn's."""

from __future__ import annotations

from .. import proc
from ..holder import field, stopped
from .outlived import running_command


def read_record(facts, record: dict, here: bool, believed=None) -> None:
    """Set facts.alive, reused, ending (with ending_pgid, ending_pids) and stopped from record.
    here: the record's process is of this machine (its /proc can be read); another machine's
    turn is not alive here (its session, its lock, is how the store knows it). believed(command):
    is a running command the turn's (default: yes)."""
    pid = field(record, "pid", int)
    if here and pid is not None:
        ticks, now_ticks = field(record, "start_ticks", int), proc.start_ticks(pid)
        facts.alive = now_ticks is not None and now_ticks == ticks
        facts.reused = now_ticks is not None and ticks is not None and now_ticks != ticks
    else:
        facts.alive = False
    if not facts.alive:   # free, or held by the next turn while it waits for the command
        command = running_command(record)
        if command is not None and (believed is None or believed(command)):
            facts.ending, facts.ending_pgid = command.named, command.pgid
            facts.ending_pids = command.members
    if facts.held and facts.matches and here and pid is not None:
        facts.stopped = stopped(pid, record)
