"""`python -m lanelock.testing serve|client`: the stand-in model server and its client."""

import sys

from .standin import main

sys.exit(main())
