"""Fault-injection points for the tests that kill or stop a run at a chosen state (the kill
drills of tests/e2e/test_async_checkpoint.py, the crash and stop tests of tests/e2e/test_train.py,
test_train_launcher.py, test_wandb_train.py, test_lora_train.py).

``MESHTRAIN_CHECKPOINT_DRILL=<point>`` (or ``<point>:<rank>``, or ``<point>:<rank>@<step>``, or
``<point>:@<step>``; several comma-separated, ``write,last``) makes the process announce that
it reached ``point``, on stderr, as ``checkpoint drill: <point> step <N> rank <R>``, and then hold
there (sleep) until the test kills it. Unset (always, outside the tests) a point costs one
environment lookup: per point of a save, once per run for ``last`` and ``exit``.

Such a test waits for a state, never for a time: whatever the load on the machine, the process it
kills or signals is alive and where the test says it is.

The points of a save, in the order a save passes them:

``begin``    every rank, main thread: a save (or the last save's export) is due after step N;
             nothing of it is on disk yet (no ``step-N.tmp``);
``staging``  main thread: ``step-N.tmp`` exists, the state has not been copied yet;
``write``    the writer (background thread, or the main thread for a synchronous save): this
             rank's data files are written and fsynced, the ``.metadata`` is not;
``publish``  rank 0, main thread: every rank's files and the metadata are durable, the
             ``step-N.tmp`` -> ``step-N`` rename has not happened.

The points of the run around them:

``last``     every rank, main thread, at the end of step ``training.steps - 1`` where the ranks
             agree whether to stop (trainer/runtime/stop.py), when no stop was agreed: held until a
             SIGINT or SIGTERM reaches any rank (the ranks agree again every 10 ms, so every
             rank leaves at the same agreement), then the run stops at that step as any stopped
             run does (a checkpoint of it, the one line, 128 + the signal). It never trains its
             last step, so a signal sent at any moment once the loop trains stops it. A gate,
             not a kill point: it takes no ``:<rank>`` nor ``@<step>`` (a rank held alone would
             wait in a collective its peers never join).
``exit``     every rank (or the one named), main thread, after a run that ended normally: the
             last save published, metrics and traces closed; held instead of exiting 0.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

__all__ = ["POINTS", "drill_point", "hold_until_stopped", "stop_gate"]

POINTS = ("begin", "staging", "write", "publish", "last", "exit")
_ENV = "MESHTRAIN_CHECKPOINT_DRILL"
_AGREE_EVERY_S = 0.01  # the ``last`` gate's agreement period


def _wanted_one(spec: str, point: str, step: int, rank: int) -> bool:
    name, _, rest = spec.strip().partition(":")
    if name != point:
        return False
    if not rest:
        return True
    want_rank, _, want_step = rest.partition("@")
    if want_rank and int(want_rank) != rank:
        return False
    return not want_step or int(want_step) == step


def _wanted(spec: str, point: str, step: int, rank: int) -> bool:
    return any(_wanted_one(part, point, step, rank) for part in spec.split(","))


def _announce(point: str, step: int, rank: int) -> None:
    print(f"checkpoint drill: {point} step {step} rank {rank}", file=sys.stderr, flush=True)


def drill_point(point: str, step: int, rank: int) -> None:
    """Hold here (until killed) when the drill asks for ``point`` on this rank and step."""
    spec = os.environ.get(_ENV)
    if not spec or not _wanted(spec, point, step, rank):
        return
    _announce(point, step, rank)
    while True:  # the drill SIGKILLs the process; nothing after this point may run
        time.sleep(60)


def stop_gate() -> bool:
    """Whether the drill asks for the ``last`` gate (read once per run, by every rank)."""
    spec = os.environ.get(_ENV)
    if not spec:
        return False
    parts = [part.strip() for part in spec.split(",")]
    for part in parts:
        if part.partition(":")[0] == "last" and part != "last":
            raise ValueError(f"{_ENV}={spec}: 'last' holds every rank at the same step; it takes no ':<rank>@<step>'")
    return "last" in parts


def hold_until_stopped(agreed: Callable[[], int | None], step: int, rank: int) -> int:
    """The ``last`` gate (collective, every rank): announce it, then agree every 10 ms until a
    stop was requested on some rank; the signal every rank stops for."""
    _announce("last", step, rank)
    while (signum := agreed()) is None:
        time.sleep(_AGREE_EVERY_S)
    return signum
