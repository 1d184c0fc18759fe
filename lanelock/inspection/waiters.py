"""The queue as people read it while they wait: one row per waiter -- position, class and the
class it counts as now (aging), session, pid, how long it waited, about when the lane comes to
it (status.add_estimates), stopped or not -- as plain lines or a rich table.
"""

from __future__ import annotations

from ..facts import hostname
from ..holder import seconds
from ..say import sanitize

COLUMNS = ("#", "class", "counts as", "session", "pid", "waited", "lane in", "stopped")


def cells(row: dict) -> tuple[str, ...]:
    """One waiter's cells, in COLUMNS' order."""
    host = row.get("host")
    pid = f"{row.get('pid')}" + (f" on {host}" if host and host != hostname() else "")
    return (str(row.get("position")), str(row.get("class")), str(row.get("effective_class")),
            sanitize(str(row.get("session") or "(none given)"), 60), sanitize(pid, 80),
            seconds(row.get("waited")), _lane_in(row),
            {True: "stopped", False: "no"}.get(row.get("stopped"), "cannot tell"))


def line(row: dict) -> str:
    """'1. interactive pid 42 (session chat), waited 3.1s, the lane in about 4s'."""
    position, klass, counts_as, session, pid, waited, lane_in, _ = cells(row)
    if counts_as != klass:
        klass = f"{counts_as} (aged from {klass})"
    text = f"{position}. {klass} pid {pid} (session {session}), waited {waited}, "
    if row.get("stopped"):
        return text + (f"stopped: passed over until continued (kill -CONT {row.get('pid')}) "
                       "or ended")
    if row.get("estimate") is None:
        return text + "no estimate of the lane (no hold in the last hour to go by)"
    return text + "the lane in " + lane_in


def _lane_in(row: dict) -> str:
    if row.get("stopped"):
        return "passed over"
    estimate = row.get("estimate")
    if estimate is None:
        return "unknown (no hold in the last hour)" if "estimate" in row else "not estimated"
    return f"about {estimate}s" if estimate < 60 else f"about {seconds(estimate)}"


def table(lane: str, rows: list[dict]):
    """A rich table of one lane's queue."""
    from rich.markup import escape
    from rich.table import Table

    queue = Table(title=escape(f"queue of {sanitize(lane)}"), title_justify="left",
                  show_header=True, header_style="bold", expand=False)
    for column in COLUMNS:
        queue.add_column(column, overflow="fold")
    for row in rows:
        style = "yellow" if row.get("stopped") else ""
        queue.add_row(*(escape(cell) for cell in cells(row)), style=style)
    return queue
