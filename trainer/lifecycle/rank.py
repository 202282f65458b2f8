"""One rank of the job: config -> exit code.

:func:`run_rank` is what ``train.py`` runs on every rank (trainer/lifecycle/main.py): it reads
the config, builds the :class:`~trainer.trainer.Trainer` (or writes the seed checkpoint,
trainer/lifecycle/seed.py) and trains, and it turns every
way a run ends into its exit code and at most one line per cause (bad input: exit 2, said once;
a diverged run or a failed save: exit 1; a stop signal: 128 + the signal; a collective timeout:
the watchdog's line), with no traceback from deep inside torch.
"""

from __future__ import annotations

import os
import signal
import sys

import torch.distributed as dist

from parallel_dims.torch_compat import host_side
from trainer.checkpoint.async_save import CheckpointWriteFailed
from trainer.checkpoint.drill import drill_point
from trainer.config import load_config
from trainer.faults import before_joining
from trainer.inference.eval_during_training import attach as attach_eval
from trainer.lifecycle.elastic_fit import MemoryEstimator
from trainer.lifecycle.seed import create_seed_checkpoint
from trainer.lifecycle.torchrun_range import check_torchrun_range
from trainer.runtime.cli_errors import EXIT_BAD_INPUT, error_line, user_error
from trainer.runtime.comm_watchdog import EXIT_COMM_TIMEOUT
from trainer.runtime.console import say_once
from trainer.runtime.distributed_init import (
    EXIT_PEER_GONE,
    GroupNotFormed,
    is_collective_timeout,
    is_peer_gone,
    report_collective_timeout,
)
from trainer.runtime.stop import exit_code
from trainer.simulation.run_mode import RunMode
from trainer.step import TrainingDiverged
from trainer.trainer import Trainer

__all__ = ["run_rank"]


def _rank() -> int:
    """This process's rank for what it prints (a fake-backend or local_tensor run is one
    process: rank 0)."""
    if not dist.is_initialized() or RunMode.simulating():
        return int(os.environ.get("RANK", "0")) if not dist.is_initialized() else 0
    with host_side():
        return dist.get_rank()


def run_rank(argv: list[str] | None = None, memory_estimator: MemoryEstimator | None = None) -> int:
    """This process as one rank of the job (``argv``: the config arguments, default
    ``sys.argv[1:]``): the seed checkpoint or the training run; the exit code. Under plain
    torchrun with a node range the launcher's checks come first (trainer/lifecycle/torchrun_range.py,
    ``memory_estimator``: train.py's planner pricing)."""
    try:
        cfg = load_config(argv)
        check_torchrun_range(cfg, estimator=memory_estimator)
    except ValueError as exc:  # every rank reads the same config: said once (under torchrun RANK is set already)
        say_once(error_line(exc), int(os.environ.get("RANK", "0")))
        return EXIT_BAD_INPUT
    trainer = None  # read by the collective-timeout message (the step that was running)
    try:
        if cfg.checkpoint.create_seed_checkpoint:
            create_seed_checkpoint(cfg)
            return 0
        # a drill's restarted rank that never joins its group (hang@0:restart=N, trainer/faults.py)
        before_joining(cfg.debug.fault, int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")))
        trainer = Trainer(cfg)
        attach_eval(trainer)  # [eval] tasks between steps (the loop may not import trainer/inference/)
        if trainer.rank == 0 and cfg.job.print_config:
            print("resolved config:\n" + cfg.to_toml(), flush=True)
        trainer.train()
        if trainer.stopped_by is not None:
            return exit_code(trainer.stopped_by)
        drill_point("exit", trainer.step, trainer.rank)  # tests only: held, not exiting (trainer/checkpoint/drill.py)
        return 0
    except GroupNotFormed as exc:  # a rank of the start never joined: one line, restartable
        if exc.speaks:
            print(str(exc), file=sys.stderr, flush=True)
        return EXIT_COMM_TIMEOUT
    except KeyboardInterrupt:  # Ctrl-C before the training loop (which stops at a step instead)
        if _rank() == 0:  # every rank got it (the launcher sends it to each): one speaks
            print("interrupted (SIGINT) before training began: nothing to save", file=sys.stderr, flush=True)
        return exit_code(signal.SIGINT)
    except TrainingDiverged as exc:  # every rank has the same reduced loss and norm
        say_once(f"error: {exc}", _rank())
        return 1
    except CheckpointWriteFailed as exc:  # a save failed mid-run: not bad input, the run stops
        if not dist.is_initialized() or dist.get_rank() == 0:
            message = trainer.ckpt.stopped_message(exc) if trainer is not None else str(exc)
            print(f"error: {message}", file=sys.stderr, flush=True)
        return 1
    except BaseException as exc:  # torch.distributed.checkpoint's CheckpointException is a BaseException
        signum = getattr(getattr(trainer, "stop_signals", None), "signum", None)
        if isinstance(exc, Exception) and is_peer_gone(exc):
            # a peer rank ended first (a user error only it met, e.g. a bad row of its own
            # stripe; a crash; a kill) and this rank's collective failed on it: the peer's line
            # (or the launcher's, for a crash) is the one the user needs; nothing from this rank
            return exit_code(signum) if signum is not None else EXIT_PEER_GONE
        if signum is not None and isinstance(exc, Exception):
            # a signal came first: the job is being taken down (torchrun and the launcher send
            # SIGTERM to the ranks left after one failed), and this rank's step failed on a peer
            # that is gone; no checkpoint of this step, no traceback
            print(
                f"rank {_rank()}: stopped by {signal.Signals(signum).name} during step {trainer.step + 1}, without "
                f"a checkpoint of it ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                f"the newest complete checkpoint is {trainer.ckpt.newest()}",
                file=sys.stderr,
                flush=True,
            )
            return exit_code(signum)
        # bad input (config, degrees vs world size, model vs layout, a checkpoint, also when
        # DCP wraps it): a clear message from rank 0, no traceback
        err = user_error(exc)
        if err is not None:
            say_once(error_line(err), _rank())
            return EXIT_BAD_INPUT
        if not isinstance(exc, Exception) or not is_collective_timeout(exc):
            raise
        # gloo (the exception path; on NCCL the step watchdog speaks first): the same one line
        phase = getattr(getattr(trainer, "watchdog", None), "phase", "")
        return report_collective_timeout(cfg.comm, cfg.job.dump_folder, exc, phase)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
