"""``python train.py ...``: the way in, read top to bottom.

The root ``train.py`` (the user's entry) calls :func:`main` with its arguments, and ``main`` says
which of two processes this one is:

* **launcher flags -> launch.** torchrun's flags (``--nproc_per_node``, ``--nnodes``, ...;
  :func:`~trainer.lifecycle.launch.launcher_argv` tells them from the config's ``--section.key``
  arguments): this process is the launcher (trainer/lifecycle/launch.py). It checks the job,
  starts ``train.py`` workers with the config arguments only, and ends as the job ended.
  ``memory_estimator`` (train.py's: the layout planner's memory model, which the trainer does
  not import) prices a node range's every node count against one device's memory
  (trainer/lifecycle/elastic_fit.py).
* **else run this rank.** Plain ``python train.py``, a torchrun worker, a worker of the
  launcher: this process is one rank of the job (trainer/lifecycle/rank.py): it writes the seed
  checkpoint or trains, and ends through trainer/lifecycle/shutdown.py. A worker of plain
  torchrun with a node range makes the launcher's range checks itself, ``memory_estimator``
  included (trainer/lifecycle/torchrun_range.py).
"""

from __future__ import annotations

import sys
from typing import NoReturn

from trainer.lifecycle.elastic_fit import MemoryEstimator
from trainer.lifecycle.launch import launcher_argv
from trainer.lifecycle.launch import main as launch
from trainer.lifecycle.rank import run_rank
from trainer.lifecycle.shutdown import run_and_exit
from trainer.lifecycle.start_signals import hand_over

__all__ = ["main"]


def main(argv: list[str], memory_estimator: MemoryEstimator | None = None) -> NoReturn:
    if launcher_argv(argv) is not None:  # launcher flags -> launch the workers
        sys.exit(launch(argv, memory_estimator))
    # else run this rank. Not sys.exit: torch's communication threads can outlive the process
    # groups and call into a finalizing interpreter (a finished run would abort at exit)
    hand_over()  # from here a Ctrl-C is run_rank's (one line; at a step in the loop)
    run_and_exit(lambda: run_rank(argv, memory_estimator))
