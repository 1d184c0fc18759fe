"""The self-tests that run as real processes: the duel (`lanelock duel`), the process each duel turn
runs (duelist), and the contention-detecting stand-in model server with its client
(`python -m lanelock.testing serve|client`)."""

from .standin import Counter, ask, complete, main, make_server, stats  # noqa: F401
