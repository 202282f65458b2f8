"""Ctrl-C while a process starts: one line, never a traceback.

A train.py process spends its first seconds importing torch and the trainer. A SIGINT then
(a terminal's Ctrl-C to the launcher, which the launcher's agent sends on to the workers) used
to surface as a ``KeyboardInterrupt`` traceback from whatever module was importing, once per
process, interleaved: 16-80 lines. Now:

* :func:`quiet_start` is the first thing train.py runs: until :func:`hand_over`, a SIGINT ends
  the process at once with exit code 130 and one line, ``interrupted (SIGINT) while starting:
  nothing to save``, printed only by rank 0 (``RANK`` unset or 0: every rank of a job gets the
  signal, one speaks). Nothing has been written yet, so there is nothing to save or clean up.
* :func:`hand_over`: from where the code handles ``KeyboardInterrupt`` itself (the launcher's
  pre-start check, the trainer's start, trainer/lifecycle/rank.py), it does so again, each with its one
  line; the training loop stops at a step (trainer/runtime/stop.py).
* :func:`workers_start_blocked` closes the window before a worker's first line (the
  interpreter's own start, where Python prints a fatal-error traceback of the site import): the
  launcher starts its workers with SIGINT and SIGTERM blocked, so a signal sent on to a worker
  that is still starting waits, pending, until :func:`quiet_start` unblocks it and it is handled
  there. The launcher itself keeps receiving both signals through a thread of its own.

Before train.py's first line the launcher process itself is Python's: a Ctrl-C in its first
~0.05 s (the interpreter's start and ``site``, longer with editable installs) ends it as Python
does. This module imports only the standard library, so train.py runs it before anything else.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator

__all__ = ["STARTING_LINE", "hand_over", "quiet_start", "speaks", "workers_start_blocked"]

STARTING_LINE = "interrupted (SIGINT) while starting: nothing to save"
_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def speaks() -> bool:
    """Whether this process prints a stop line every rank meets: rank 0, or a lone process."""
    return os.environ.get("RANK", "0") == "0"


def _interrupted(signum: int, _frame) -> None:
    if speaks():
        try:
            os.write(sys.stderr.fileno(), (STARTING_LINE + "\n").encode())
        except (OSError, ValueError):
            pass
    os._exit(128 + signum)


def quiet_start() -> None:
    """SIGINT ends the process with one line until :func:`hand_over`; a signal held back by
    the launcher (:func:`workers_start_blocked`) is delivered now."""
    signal.signal(signal.SIGINT, _interrupted)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _SIGNALS)


def hand_over() -> None:
    """SIGINT raises ``KeyboardInterrupt`` again, for code that ends it with its own line."""
    signal.signal(signal.SIGINT, signal.default_int_handler)


@contextlib.contextmanager
def workers_start_blocked() -> Iterator[None]:
    """Processes started by this thread inside the block start with SIGINT and SIGTERM
    blocked (the signal mask is inherited through fork and exec); train.py unblocks them at its
    first line. This process still gets both: a thread started before the block keeps them
    unblocked, the kernel delivers them to it, and Python runs the handlers in the main thread
    as always (at its next bytecode: within the agent's 0.1 s monitor interval)."""
    receiver = threading.Thread(target=threading.Event().wait, name="meshtrain-signals", daemon=True)
    receiver.start()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
