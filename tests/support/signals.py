"""The signal dispositions the suite was started with, and those the processes it starts begin with.

`nohup pytest` starts the suite with SIGHUP ignored and a shell's background job (`pytest &`) with
SIGINT and SIGQUIT ignored. An ignored signal is inherited across fork and exec, so every process
the tests start -- every `lanelock run` and its command -- would begin with it ignored: a test of
what a hangup or ^C does would test the shell's choice instead of lanelock's (an ignored SIGHUP
kept the commands of the hangup tests running, and the tests failed). A handler, unlike SIG_IGN,
is reset to the default by exec, so the suite takes the signal with a handler and the processes
it starts begin as from a terminal. Tests that want a signal ignored set it for their own process.
"""

from __future__ import annotations

import os
import signal

# SIGHUP and SIGQUIT: the suite goes on through a hangup as it was asked to (a handler that does
# nothing). xdist's workers are started from the suite with the default and are told by the
# environment to do the same.
KEPT_ON = (signal.SIGHUP, signal.SIGQUIT)
MARK = "PYTEST_LANELOCK_KEEPS_ON_"


def take_ignored() -> None:
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:   # ^C ends the suite, as pytest's
        signal.signal(signal.SIGINT, signal.default_int_handler)
    for signo in KEPT_ON:
        mark = MARK + signo.name
        if signal.getsignal(signo) is signal.SIG_IGN or os.environ.get(mark):
            os.environ[mark] = "1"
            signal.signal(signo, _nothing)


def give_back() -> None:
    for signo in KEPT_ON:
        if signal.getsignal(signo) is _nothing:
            signal.signal(signo, signal.SIG_IGN)


def _nothing(signo, frame) -> None:
    pass
