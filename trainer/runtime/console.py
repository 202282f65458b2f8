"""What a training process prints besides its own lines: every message once.

Every rank of a job runs the same code, so every warning would otherwise be printed once per
rank, interleaved (``lr_scheduler.warmup_steps (5) > training steps (3)`` four times on four
ranks; torch's own ``UserWarning`` s the same). :func:`configure_console` makes rank 0 the one
that speaks: its log records of level WARNING and up, and Python warnings (routed through
logging, each shown once per place as Python's default filter does), go to stderr as plain
lines. Every other rank prints only records of level ERROR and up, prefixed with its rank, for
what only that rank knows. The trainer's own lines (``trainer.runtime.distributed_init.log``) are
rank 0's already; a rank-specific line is printed by that rank with its rank in it.
"""

from __future__ import annotations

import logging
import sys
import time

__all__ = ["RANK_ZERO_GRACE_S", "configure_console", "say_once"]

# how long a rank other than 0 holds an error line that rank 0 may be printing too
RANK_ZERO_GRACE_S = 10.0

_HANDLER_NAME = "meshtrain-console"


def configure_console(rank: int) -> None:
    """Route this process's log records and warnings to stderr as described above (``rank``:
    this process's rank; a one-process run, fake backend or local_tensor, is rank 0)."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if handler.get_name() == _HANDLER_NAME:  # configured before (a second Trainer in one process)
            root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(logging.Formatter("%(message)s" if rank == 0 else f"[rank {rank}] %(message)s"))
    handler.setLevel(logging.WARNING if rank == 0 else logging.ERROR)
    root.addHandler(handler)
    if root.level == logging.NOTSET or root.level > logging.WARNING:
        root.setLevel(logging.WARNING)
    logging.captureWarnings(True)


def say_once(line: str, rank: int) -> None:
    """An ``error:`` line that every rank may meet (a config error, a bad checkpoint, a diverged
    loss), printed once. Rank 0 prints it at once. Another rank waits :data:`RANK_ZERO_GRACE_S`
    first: rank 0's exit ends the job (torchrun, trainer/lifecycle/launch.py and tools/forkserver.py stop
    the other ranks when one fails), so when rank 0 met the error too this rank never prints,
    and when only this rank met it (rank 0 still running), it prints it with its rank. Without
    the wait a rank that exits first can have rank 0 stopped before its line is out."""
    if rank != 0:
        time.sleep(RANK_ZERO_GRACE_S)
        line = line.replace("error: ", f"error: rank {rank}: ", 1)
    print(line, file=sys.stderr, flush=True)
