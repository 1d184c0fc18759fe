"""What other users plant in the shared lock root costs a turn and a listing a bounded amount:
files planted in a lane's seats folder (1777: anyone may add to it) are never listed by a turn
or by `status` -- they look only at the seats the count's setter made; `status --all` and
`metrics --all` judge at most the lanes whose records changed last and say in one line how many
more there are. Real files throughout; what they cost in seconds is bench/planted.py's.
"""

from __future__ import annotations

import os
import shutil

import pytest

from support.cli import LANE, LANELOCK, STEM

ALL_LANES = 100   # inspection/status.py's bound, as docs/lanes.md states it


def plant(folder, names) -> None:
    for name in names:
        os.close(os.open(os.path.join(folder, name), os.O_CREAT | os.O_WRONLY, 0o644))


def listings(run_cmd, trace, argv: list, folder: str) -> list[str]:
    """The getdents64 calls on folder of argv run under strace (it ran cleanly)."""
    traced = run_cmd(["strace", "-f", "-y", "-qq", "-e", "trace=getdents64", "-o", str(trace),
                      *argv])
    assert traced.returncode == 0, traced
    return [line for line in trace.read_text().splitlines() if f"{folder}>" in line]


@pytest.fixture
def planted_seats(lanelock, lock_dir):
    """A lane of two seats whose seats folder holds 2,000 planted files and a lock file for every
    seat number a count could have."""
    assert lanelock("seats", "2").returncode == 0
    plant(lock_dir / f"{STEM}.seats", [f"{number}.lock" for number in range(3, 259)]
          + [f"planted-{number}" for number in range(2_000)])
    return f"{STEM}.seats"


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")
def test_a_turn_never_lists_a_seats_folder_full_of_planted_files(planted_seats, run_cmd,
                                                                 lock_dir):
    assert listings(run_cmd, lock_dir.parent / "trace", [*LANELOCK, "run", "--", "true"],
                    planted_seats) == []


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")
def test_status_never_lists_a_seats_folder_full_of_planted_files(planted_seats, run_cmd,
                                                                 lock_dir):
    for args in (["status"], ["status", "--all"]):
        assert listings(run_cmd, lock_dir.parent / "trace", [*LANELOCK, *args],
                        planted_seats) == [], args


@pytest.mark.slow   # a hundred lanes judged twice (about 3 s)
def test_status_and_metrics_all_judge_the_lanes_changed_last_and_say_how_many_more(
        lanelock, lock_dir):
    os.makedirs(lock_dir, exist_ok=True)
    plant(lock_dir, [f"planted-{number}.{kind}" for number in range(ALL_LANES + 20)
                     for kind in ("lock", "json")])
    assert lanelock("run", "--", "true").returncode == 0   # the lane in use: changed last
    listed = lanelock("status", "--all")
    assert listed.returncode == 0, listed
    assert LANE in listed.stdout
    assert listed.stdout.count("planted") == ALL_LANES - 1
    notes = [line for line in listed.stderr.splitlines() if "not listed" in line]
    assert len(notes) == 1 and notes[0].startswith("lanelock: ") and "21 more lanes" in notes[0]
    scraped = lanelock("metrics", "--all")
    assert scraped.returncode == 0, scraped
    assert f'lanelock_lane_held{{lane="{LANE}"}}' in scraped.stdout
    assert [line for line in scraped.stderr.splitlines() if "not listed" in line] == notes


@pytest.mark.slow   # a hundred lanes judged twice on a real server
def test_status_and_metrics_all_on_postgresql_judge_the_lanes_changed_last(lanelock, postgres,
                                                                            lock_roots):
    """Anyone with the server's password can make rows: the PostgreSQL store chooses the lanes
    changed last in one query too, and says how many more there are."""
    psycopg = pytest.importorskip("psycopg")
    lock_roots.watch_store(postgres.dsn)
    store = {"LANELOCK_STORE": postgres.dsn}
    assert lanelock("run", "--", "true", env=store).returncode == 0   # the schema, and our lane
    with psycopg.connect(postgres.dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO lanelock_holders (key2, lane, record, backend_pid, updated_at) "
                     "SELECT -1000000 - n, '0-planted-' || n, '{}', 0, now() - interval '1 hour' "
                     "FROM generate_series(1, %s) AS n ON CONFLICT DO NOTHING", (ALL_LANES + 20,))
        known = conn.execute("SELECT count(DISTINCT lane) FROM lanelock_holders").fetchone()[0]
    assert lanelock("run", "--", "true", env=store).returncode == 0   # our lane changed last
    listed = lanelock("status", "--all", env=store)
    assert listed.returncode == 0, listed
    assert LANE in listed.stdout
    notes = [line for line in listed.stderr.splitlines() if "not listed" in line]
    assert len(notes) == 1 and notes[0].startswith("lanelock: "), listed.stderr
    assert f"{known - ALL_LANES} more lanes" in notes[0]
    scraped = lanelock("metrics", "--all", env=store)
    assert scraped.returncode == 0, scraped
    assert f'lane="{LANE}' in scraped.stdout   # (a PostgreSQL lane's name says its host too)
    assert len({line.split('lane="')[1].split('"')[0] for line in scraped.stdout.splitlines()
                if line.startswith("lanelock_lane_held{")}) == ALL_LANES
    assert [line for line in scraped.stderr.splitlines() if "not listed" in line] == notes
