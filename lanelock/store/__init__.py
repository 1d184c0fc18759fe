"""Lane stores: where a lane's lock, holder record and events live.

- base.py       the contract every store implements (LaneStore), and LaneFacts for `status`;
- flock.py      flock(2) on a lock file under the lock root (waiting.py: the timed wait;
                flock_survey.py: what `status` sees); sidecar.py and journal.py beside the lock;
- postgres.py   PostgreSQL advisory locks, for agents on several hosts.
"""


def for_settings(settings, root):
    """The store the settings name: PostgreSQL for a store URL, else flock under root."""
    dsn = settings.get("store")
    if dsn:
        from .postgres import PgStore

        return PgStore(dsn, float(settings.get("priority_aging")))
    from .flock import FlockStore

    return FlockStore(root, settings.get("journal_max_bytes"),
                      float(settings.get("priority_aging")))
