"""A lane's holder row on the PostgreSQL store: the upsert that writes a turn's record, with and
without the fence (the row's generation: one more whenever another turn writes it), and its
parameters. Shared by the store's own writes and the hand-off's one-query release (handoff.py)."""

from __future__ import annotations

import json

# The row's next generation in an upsert (write_holder): one more when another turn writes it.
_NEXT = ("CASE WHEN held.record->>'turn' IS NOT DISTINCT FROM EXCLUDED.record->>'turn' "
         "THEN held.generation ELSE held.generation + 1 END")
WRITE_FENCED = (
    "INSERT INTO lanelock_holders AS held (key2, lane, record, backend_pid, updated_at, generation) "
    "VALUES (%(key)s, %(lane)s, %(record)s::jsonb || '{\"fence\": 1}', %(backend)s, now(), 1) "
    "ON CONFLICT (key2) DO UPDATE SET lane = EXCLUDED.lane, "
    f"record = EXCLUDED.record || jsonb_build_object('fence', {_NEXT}), "
    f"backend_pid = EXCLUDED.backend_pid, updated_at = now(), generation = {_NEXT} "
    "RETURNING generation")
WRITE_UNFENCED = (
    "INSERT INTO lanelock_holders (key2, lane, record, backend_pid, updated_at) "
    "VALUES (%(key)s, %(lane)s, %(record)s, %(backend)s, now()) ON CONFLICT (key2) DO UPDATE SET "
    "lane = EXCLUDED.lane, record = EXCLUDED.record, backend_pid = EXCLUDED.backend_pid, "
    "updated_at = now()")


def holder_params(handle, record: dict) -> dict:
    """The parameters of WRITE_FENCED / WRITE_UNFENCED for the handle's turn's record."""
    record = dict(record, store_key=list(handle.key), backend_pid=handle.backend_pid)
    record.pop("fence", None)   # the server's count, never the caller's
    if getattr(handle, "lease", None):   # a watched holder's row stays leased (lease.py)
        record["lease"] = handle.lease
    return {"key": handle.key[1], "lane": handle.lane, "record": json.dumps(record),
            "backend": handle.backend_pid}
