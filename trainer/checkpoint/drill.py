"""Fault-injection points for the checkpoint kill drills (tests/e2e/test_checkpoint_drills.py).

``MESHTRAIN_CHECKPOINT_DRILL=<point>`` (or ``<point>:<rank>``, or ``<point>:<rank>@<step>``)
makes the process announce that it reached ``point`` of a checkpoint save, on stderr, as
``checkpoint drill: <point> step <N> rank <R>``, and then hold there (sleep) until the drill
kills it. Unset (always, outside the drills) it costs one environment lookup per point.

The points, in the order a save passes them:

``staging``  main thread: ``step-N.tmp`` exists, the state has not been copied yet;
``write``    the writer (background thread, or the main thread for a synchronous save): this
             rank's data files are written and fsynced, the ``.metadata`` is not;
``publish``  rank 0, main thread: every rank's files and the metadata are durable, the
             ``step-N.tmp`` -> ``step-N`` rename has not happened.
"""

from __future__ import annotations

import os
import sys
import time

__all__ = ["POINTS", "drill_point"]

POINTS = ("staging", "write", "publish")
_ENV = "MESHTRAIN_CHECKPOINT_DRILL"


def _wanted(spec: str, point: str, step: int, rank: int) -> bool:
    name, _, rest = spec.partition(":")
    if name != point:
        return False
    if not rest:
        return True
    want_rank, _, want_step = rest.partition("@")
    if want_rank and int(want_rank) != rank:
        return False
    return not want_step or int(want_step) == step


def drill_point(point: str, step: int, rank: int) -> None:
    """Hold here (until killed) when the drill asks for ``point`` on this rank and step."""
    spec = os.environ.get(_ENV)
    if not spec or not _wanted(spec, point, step, rank):
        return
    print(f"checkpoint drill: {point} step {step} rank {rank}", file=sys.stderr, flush=True)
    while True:  # the drill SIGKILLs the process; nothing after this point may run
        time.sleep(60)
