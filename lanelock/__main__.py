"""`python -m lanelock` and the `lanelock` console script."""

import sys


def entry() -> None:
    args = sys.argv[1:]
    # `run` sits in front of every turn: its common forms skip click's import (runargs.py).
    if args[:1] == ["run"]:
        from .run.args import parse

        params = parse(args[1:])
        if params is not None:
            sys.exit(_run(params))
    from .cli import main

    sys.exit(main())


def _run(params: dict) -> int:
    from . import guard
    from .run.wrapper import UsageProblem, start

    def turn() -> int:
        try:
            return start(params)
        except UsageProblem as error:
            return guard.usage(str(error), "lanelock run")
        except KeyboardInterrupt:
            sys.stderr.write("\n")   # as click does, so both paths print the same
            raise

    return guard.guarded(turn)


if __name__ == "__main__":
    entry()
