"""lanelock: one turn at a time on a local model; everyone else takes the fallback."""

__version__ = "0.1.0"

from .errors import GateUnavailable, LanelockError, UsageProblem  # noqa: E402
from .gate import BUSY_WORDS, REASON_BUSY, Gate, Turn  # noqa: E402
from .lanes import BackendError  # noqa: E402

__all__ = ["Gate", "Turn", "REASON_BUSY", "BUSY_WORDS", "BackendError", "UsageProblem",
           "GateUnavailable", "LanelockError", "__version__"]
