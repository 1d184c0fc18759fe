"""`python -m lanelock` and the `lanelock` console script."""

import sys


def entry() -> None:
    args = sys.argv[1:]
    # `run` sits in front of every turn: its common forms skip click's import (runargs.py).
    if args[:1] == ["run"]:
        from .run.args import parse

        request = parse(args[1:])
        if request is not None:
            _leave(_run(request))
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


def _leave(code: int) -> None:
    """A turn's end: its output flushed, then out at once. The interpreter's own teardown
    (every module freed, psycopg's included) costs a PostgreSQL turn about 30 ms of CPU after its
    lane is let go -- on a 2-core machine, taken from the next turns' hand-off while they run
    back to back -- and delays the exit status by as much. Nothing is left to it: the lane is
    let go and its writes are done (unbuffered, or files closed), the store's session closed,
    and every thread of a turn is a daemon."""
    import os

    from .guard import flush_quietly

    flush_quietly()
    os._exit(code)


if __name__ == "__main__":
    entry()
