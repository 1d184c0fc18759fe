"""`python -m lanelock` and the `lanelock` console script."""

import sys


def entry() -> None:
    args = sys.argv[1:]
    # `run` sits in front of every turn: its common forms skip click's import (runargs.py).
    if args[:1] == ["run"]:
        from .run.args import parse

        request = parse(args[1:])
        if request is not None:
            sys.exit(_run(request))
    from .cli import main

    sys.exit(main())


def _run(request) -> int:
    from . import guard
    from .errors import UsageProblem
    from .run.wrapper import start

    def turn() -> int:
        try:
            return start(request)
        except UsageProblem as error:
            return guard.usage(str(error), "lanelock run")
        except KeyboardInterrupt:
            sys.stderr.write("\n")   # as click does, so both paths print the same
            raise

    return guard.guarded(turn)


if __name__ == "__main__":
    entry()
