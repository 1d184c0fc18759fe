"""The Prometheus tools the metrics tests run (promtool, prometheus, node_exporter): found on PATH,
or the test skips -- and fails instead under LANELOCK_REQUIRE_PROM, as CI sets it."""

from __future__ import annotations

import os
import shutil

import pytest

# Read at import: the autouse isolation fixture may clear LANELOCK_* before a test's fixtures run.
REQUIRE_PROM = bool(os.environ.get("LANELOCK_REQUIRE_PROM"))


def tool(*names: str) -> str:
    """The first of these programs on PATH; skips (fails under LANELOCK_REQUIRE_PROM) without."""
    for name in names:
        found = shutil.which(name)
        if found:
            return found
    why = f"{' or '.join(names)} not found (apt-get install prometheus prometheus-node-exporter)"
    if REQUIRE_PROM:
        pytest.fail(why)
    pytest.skip(why)
