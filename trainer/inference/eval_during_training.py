"""``[eval]``: lm-eval tasks scored on the live model between training steps.

:func:`attach` (called by trainer/lifecycle/rank.py after the Trainer is built, because the loop
may not import trainer/inference/) reads lm-eval's task index once (an unknown task, a task
file that does not parse, or a layout the inference session refuses (pp, cp) stops the run
before its first step: one line, exit code 2) and sets
``trainer.downstream`` to a :class:`DownstreamEval`. The loop calls :meth:`DownstreamEval.due`
and :meth:`DownstreamEval.run` after a step's checkpoint and validation, every
``eval.interval`` steps and after the run's last step.

A run scores what ``scripts/eval.py`` scores on that step's checkpoint: the same
:class:`~trainer.inference.lm_eval_model.MeshLM` over an :class:`InferenceSession` (here
``from_live``: the trainer's own model parts, no copy) and the same ``lm_eval.simple_evaluate``
(trainer/inference/lm_eval_run.py). The scores go to metrics.jsonl as one record of their own
(``eval/<task>/<metric>``, trainer/reporting/metrics.py ``log_event``: also TensorBoard and
W&B), and rank 0 prints one line.

What training sees of it: nothing. The session leaves each module's train/eval mode, the MoE
buffers and the torch RNG as found around every forward; lm-eval seeds Python's ``random``,
NumPy and torch (CPU and CUDA) itself, so the evaluation runs inside :func:`rng_preserved`, which
puts all four back. It reads no training data (the loader's position is untouched), computes no
gradient, and its time is left out of the step times (``metrics.exclude``). The step watchdog
(trainer/runtime/comm_watchdog.py) is re-armed with its long-phase limit before each batch of
requests, so a benchmark may take longer than ``comm.init_timeout_seconds`` and a hung
collective is still cut off.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["DownstreamEval", "attach", "rng_preserved"]


@contextlib.contextmanager
def rng_preserved() -> Iterator[None]:
    """Python's, NumPy's and torch's (CPU, every CUDA device) global RNG states, put back."""
    import numpy as np

    py, npy, cpu = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


class DownstreamEval:
    """The [eval] section's tasks on a live training run (module docstring)."""

    def __init__(self, trainer: Any, log=print) -> None:
        from trainer.inference.lm_eval_run import task_manager

        ev = trainer.cfg.eval
        _check_layout(trainer.plan.parallel_dims)
        self.cfg, self.trainer, self.log = ev, trainer, log
        self.tasks = list(ev.tasks)
        self.manager = task_manager(self.tasks, ev.include_path, option="eval.include_path")
        self.rank = int(getattr(trainer, "rank", 0))
        self._quiet()

    def _quiet(self) -> None:
        """lm-eval's and datasets' progress bars and notes off in the training log (warnings
        and errors stay)."""
        import logging
        import os

        level = "WARNING" if self.rank == 0 else "ERROR"
        os.environ.setdefault("LMEVAL_LOG_LEVEL", level)  # what simple_evaluate sets its logger to
        logging.getLogger("datasets").setLevel(level)
        with contextlib.suppress(ImportError):
            from datasets.utils.logging import disable_progress_bar

            disable_progress_bar()

    def due(self, step: int, end: bool) -> bool:
        return step % self.cfg.interval == 0 or end

    def scores(self, heartbeat=None) -> dict[str, float] | None:
        """The tasks' scores now (rank 0; None on the other ranks), the training state untouched;
        ``heartbeat`` before each batch of requests (MeshLM)."""
        from trainer.inference.lm_eval_model import MeshLM
        from trainer.inference.lm_eval_run import evaluate, scores
        from trainer.inference.session import InferenceSession

        t = self.trainer
        session = InferenceSession.from_live(t.model_parts, t.tokenizer, t.plan, t.device, cfg=t.cfg)
        lm = MeshLM(session, batch_size=self.cfg.batch_size, max_gen_toks=self.cfg.max_gen_toks, heartbeat=heartbeat)
        ev = self.cfg
        with rng_preserved():
            results = evaluate(
                lm,
                self.manager,
                self.tasks,
                num_fewshot=None if ev.num_fewshot < 0 else ev.num_fewshot,
                limit=ev.limit or None,
                bootstrap_iters=0,  # scores only: no bootstrap standard errors
            )
        return None if results is None else scores(results)

    def run(self, step: int, metrics: Any) -> dict[str, float] | None:
        """Score the tasks after ``step``; rank 0 logs ``eval/<task>/<metric>`` and prints a line."""
        t0 = time.perf_counter()
        watchdog = getattr(self.trainer, "watchdog", None)
        phase = f"evaluation after step {step}"
        # the step watchdog's long-phase limit (comm.init_timeout_seconds) per batch of requests
        values = self.scores(None if watchdog is None else lambda: watchdog.long_phase(phase))
        seconds = time.perf_counter() - t0
        metrics.exclude(seconds)  # not step time
        if values is None:
            return None
        record = {f"eval/{k}": v for k, v in values.items()}
        metrics.log_event(step, {**record, "eval_s": seconds})
        shown = "  ".join(f"{k} {v:.4f}" for k, v in values.items())
        self.log(f"eval at step {step}: {shown} ({seconds:.1f}s)")
        return record


def _check_layout(pd: Any) -> None:
    """The layouts the inference session refuses (pp, cp), refused before the first step."""
    from trainer.config import ConfigError
    from trainer.inference.loading import refuse_layout

    try:
        refuse_layout(pd)
    except ConfigError as exc:
        raise ConfigError(
            f"eval.tasks: the evaluation between steps cannot run on this layout ({exc}); or train without [eval] "
            "and score the run's checkpoints with scripts/eval.py on a layout without pp and cp"
        ) from None


def attach(trainer: Any, log=print) -> None:
    """``trainer.downstream`` for a config with ``[eval] tasks`` (else left None)."""
    if trainer.cfg.eval.tasks:
        trainer.downstream = DownstreamEval(trainer, log)
