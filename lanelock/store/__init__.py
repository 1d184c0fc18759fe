"""Lane stores: where a lane's lock, holder record and events live.

Shared by every store:
- base.py       the contract every store implements (LaneStore), and LaneFacts for `status`;
- order.py      who goes next: every rule of the order, and the waiting walk; a store gives it
                a medium (a Line, and answers about its entries);
- seating.py    the seats, the same way: every rule once, a walk each store's medium answers;
- record_facts.py  what a holder record says of its turn (alive, ending, stopped), once;
- counts.py     the cumulative counts' shape (and their file, for stores that keep files);
- outlived.py   a killed turn's command that still runs; availability.py: an ungated root.
Each store, in a directory of its own:
- flock/        flock(2) on a lock file under the lock root: the machine's one gate;
- pg/           PostgreSQL advisory locks, for agents on several hosts.
"""


def for_settings(settings, root):
    """The store the settings name: PostgreSQL for a store URL, else flock under root."""
    dsn = settings.get("store")
    if dsn:
        from .pg.store import PgStore

        return PgStore(dsn, float(settings.get("priority_aging")), root)
    from .flock.store import FlockStore

    return FlockStore(root, settings.get("journal_max_bytes"),
                      float(settings.get("priority_aging")))
