"""Lane stores: where a lane's lock, holder record and events live.

- base.py      the contract every store implements (LaneStore), its errors and LaneFacts;
- flock.py     flock(2) on a lock file under the lock root, sidecar + journal beside it;
- postgres.py  PostgreSQL advisory locks, for agents on several hosts;
- sidecar.py, journal.py  the flock store's holder record and event log.
"""
