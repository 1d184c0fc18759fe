"""`python -m lanelock` and the `lanelock` console script."""

import sys


def entry() -> None:
    from .cli import main

    sys.exit(main())


if __name__ == "__main__":
    entry()
