"""No lane left held: every lock root and lane store a test used, checked at teardown -- in a
shared root (the default one) only the lanes this test holds."""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

import psutil

from support.cli import TEST_MARK
from support.kernel_locks import flock_entries, lane_held
from support.processes import wait_for


class LockRoots:
    """Every lock root (and lane store) a test used, checked at teardown: no lane may be held.

    Watched without asking: every *.lock under the test's tmp_path (its LANELOCK_DIR, any root it
    pointed LANELOCK_DIR or --lock-dir at there, tmpfs mounts there), and the LANELOCK_DIR and
    LANELOCK_STORE in force when the test ends. A root elsewhere is registered with watch(); the
    default root with watch_new() (its lanes made during the test: other turns on this machine may
    hold theirs); a PostgreSQL store given on the command line with watch_store(). after() runs
    clean-ups (unmount, remove) once the check is done, so they cannot hide a held lane."""

    def __init__(self, tmp_path: Path):
        self.tmp_path = tmp_path
        self.roots: list[Path] = []
        self.existing: dict[Path, set[Path]] = {}   # watch_new(): the lanes that were there before
        self.stores: list[str] = []
        self.cleanups: list = []

    def watch(self, root) -> Path:
        self.roots.append(Path(root))
        return Path(root)

    def watch_new(self, root) -> Path:
        root = Path(root)
        self.existing[root] = set(root.glob("*.lock")) if root.is_dir() else set()
        return root

    def watch_store(self, dsn: str) -> str:
        self.stores.append(dsn)
        return dsn

    def after(self, cleanup) -> None:
        self.cleanups.append(cleanup)

    def locks(self) -> list[Path]:
        found = set(self.tmp_path.rglob("*.lock"))
        roots = list(self.roots)
        if os.environ.get("LANELOCK_DIR"):
            roots.append(Path(os.environ["LANELOCK_DIR"]))
        for root in roots:
            found |= set(root.glob("*.lock")) if root.is_dir() else set()
        for root, before in self.existing.items():
            found |= (set(root.glob("*.lock")) if root.is_dir() else set()) - before
        return sorted(found)

    def held(self) -> list[str]:
        """What is left held: one line per lane. In a shared root (the default one) a lane counts
        only when this test holds it: a duel, another user's turn or another checkout's tests
        there meanwhile are no test's error."""
        shared = set(self.existing)
        held = []
        for lock in self.locks():
            if not lane_held(lock):
                continue
            if lock.parent in shared and not _this_tests(lock):
                continue
            held.append(f"{lock} (held by pid {flock_entries(lock)[0] or '?'})")
        stores = set(self.stores)
        if os.environ.get("LANELOCK_STORE", "").startswith("postgres"):
            stores.add(os.environ["LANELOCK_STORE"])
        for dsn in sorted(stores):
            pids = store_holders(dsn)
            if pids:
                held.append(f"{dsn}: advisory lane locks held by server pids {pids}")
        return held

    def check(self) -> None:
        try:
            held = self.held()
            assert not held, f"lanes left held at teardown: {held}"
        finally:
            for cleanup in reversed(self.cleanups):
                cleanup()


def _this_tests(lock: Path) -> bool:
    """Is a lane of a shared root held by this test? By this process (a leaked API turn), by one
    of its descendants, or by a process that carries this test's mark in its environment (one
    that left the tree: a daemon, an orphan). Another worker's or another suite's holder carries
    another mark or none. A holder let go between the lock attempt and this look is nobody's."""
    holders = flock_entries(lock)[0]
    if not holders:
        return lane_held(lock)
    for pid in holders:
        if pid == os.getpid():
            return True
        try:
            process = psutil.Process(pid)
            if os.getpid() in {parent.pid for parent in process.parents()}:
                return True
            if process.environ().get(TEST_MARK) == os.environ.get(TEST_MARK):
                return True
        except psutil.Error:
            continue
    return False


def store_holders(dsn: str) -> list[int]:
    """The server pids still holding a lane's advisory lock in this database. A session's locks go
    when the server notices its client is gone (killed at teardown a moment ago): given a few
    seconds, as no process can tell us when."""
    import psycopg

    query = ("SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 2 "
             "AND classid = %s AND database = (SELECT oid FROM pg_database "
             "WHERE datname = current_database())")
    namespace = 0x4C4E4C4B   # lanelock's advisory key namespace ("LNLK"), key1 of every lane

    def holding() -> list[int]:
        with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as conn:
            return [row[0] for row in conn.execute(query, (namespace,)).fetchall()]

    try:
        wait_for(lambda: not holding(), what="the store to let go", timeout=10.0)
    except AssertionError:
        return holding()
    return []


def remove_lane_files(lock_path) -> None:
    """A throwaway lane's files (lock, holder record, journal, counts, and its seats folder), for
    a test that made one in a shared root such as the default one."""
    stem = Path(str(lock_path)[: -len(".lock")])
    for path in stem.parent.glob(f"{stem.name}.*"):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                path.unlink()
