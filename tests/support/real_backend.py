"""The real llama.cpp servers of the real tier (pytest -m real): scripts/real-backend starts them
from its cache; without a build the tests skip, and fail under LANELOCK_REQUIRE_REAL=1 (CI sets it
after building). Import the fixture by name:
`from support.real_backend import servers  # noqa: F401`.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from support.ports import free_port

TOP = Path(__file__).resolve().parents[2]
SCRIPT = [sys.executable, str(TOP / "scripts" / "real-backend")]
CLIENT = [sys.executable, "-m", "lanelock.testing", "client"]


@pytest.fixture(scope="module")
def servers():
    paths = json.loads(subprocess.run(SCRIPT + ["paths"], capture_output=True, text=True,
                                      check=True).stdout)
    if not (paths["server_ready"] and paths["model_ready"]):
        if os.environ.get("LANELOCK_REQUIRE_REAL"):
            pytest.fail(f"real backend missing: {paths}")
        pytest.skip("no real backend built: run scripts/real-backend build && scripts/real-backend model")
    started = {}
    try:
        for name, parallel in (("local", 2), ("cloud", 1)):
            port = free_port()
            pid = subprocess.run(SCRIPT + ["start", "--port", str(port), "--parallel", str(parallel),
                                           "--threads", "1"],
                                 capture_output=True, text=True, check=True).stdout.strip()
            started[name] = (port, int(pid))
        yield {name: f"http://127.0.0.1:{port}" for name, (port, _) in started.items()}
    finally:
        for port, pid in started.values():
            subprocess.run(SCRIPT + ["stop", str(pid)], capture_output=True)


def slots_busy(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url + "/slots", timeout=2) as response:
            slots = json.load(response)
    except OSError:
        return None
    return sum(1 for slot in slots if slot.get("is_processing"))


def require_built() -> None:
    """Skip (or fail under LANELOCK_REQUIRE_REAL=1) when scripts/real-backend has no build."""
    paths = json.loads(subprocess.run(SCRIPT + ["paths"], capture_output=True, text=True,
                                      check=True).stdout)
    if not (paths["server_ready"] and paths["model_ready"]):
        if os.environ.get("LANELOCK_REQUIRE_REAL"):
            pytest.fail(f"real backend missing: {paths}")
        pytest.skip("no real backend built: run scripts/real-backend build && scripts/real-backend model")


@contextlib.contextmanager
def llama_server(parallel: int = 2, *, threads: int = 1, metrics: bool = False,
                 cache_ram: int | None = None, ctx: int = 4096):
    """A real llama-server with --parallel N slots (each of ctx / N tokens) on a free loopback
    port, healthy: yields its URL, and stops it after. metrics: --metrics (GET /metrics);
    cache_ram: --cache-ram MiB (None: llama-server's default, 8 GiB; 0: off)."""
    require_built()
    port = free_port()
    argv = SCRIPT + ["start", "--port", str(port), "--parallel", str(parallel),
                     "--threads", str(threads), "--ctx", str(ctx)]
    if metrics:
        argv.append("--metrics")
    if cache_ram is not None:
        argv += ["--cache-ram", str(cache_ram)]
    pid = int(subprocess.run(argv, capture_output=True, text=True, check=True).stdout)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        subprocess.run(SCRIPT + ["stop", str(pid)], capture_output=True)


@pytest.fixture(scope="module")
def two_slots():
    """One real llama-server --parallel 2 --metrics for a test module: its URL."""
    with llama_server(2, metrics=True) as url:
        yield url
