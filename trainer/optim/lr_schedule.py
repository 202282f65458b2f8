"""The learning-rate schedule: warmup, then a decay shape (cosine, linear, constant, or
warmup-stable-decay), as a multiplier on each parameter group's peak lr, and
:class:`LRSchedulers`, one ``LambdaLR`` per optimizer stepped together.

Only the schedule's position is checkpoint state: the peak lrs and the shape come from the
config on resume. That is what makes a WSD run extendable: resuming with more
``training.steps`` moves the decay window to the new end, so every step already taken in the
stable phase kept the rate it ran at, and the stable phase simply lasts longer.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from typing import Any

from torch.optim.lr_scheduler import LambdaLR

from trainer.config import JobConfig
from trainer.config import LRScheduler as LRSchedulerConfig

logger = logging.getLogger(__name__)

DECAY_SHAPES = ("linear", "cosine", "1-sqrt")


def decay_shape(progress: float, shape: str) -> float:
    """1 at progress 0, 0 at progress 1: ``linear`` 1-p, ``cosine`` (1+cos(pi p))/2,
    ``1-sqrt`` 1-sqrt(p) (Hagele et al. 2024, "Scaling Laws and Compute-Optimal Training
    Beyond Fixed Training Durations", arXiv:2405.18392, the shape they found best for WSD)."""
    if shape == "linear":
        return 1.0 - progress
    if shape == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    if shape == "1-sqrt":
        return 1.0 - math.sqrt(progress)
    raise ValueError(f"decay shape must be one of {DECAY_SHAPES}, got {shape!r}")


def wsd_decay_steps(total_steps: int, warmup_steps: int, decay_ratio: float) -> int:
    """Steps of the WSD decay: round(decay_ratio x total_steps), at most what warmup leaves."""
    return max(0, min(round(decay_ratio * total_steps), total_steps - warmup_steps))


def lr_multiplier(
    step: int,
    *,
    warmup_steps: int,
    total_steps: int,
    decay_style: str,
    min_lr_ratio: float,
    decay_ratio: float = 0.1,
    decay_shape_name: str = "linear",
) -> float:
    """Factor on the peak lr for the optimizer step that follows ``step`` completed steps.

    Warmup: steps 1..W (step index 0..W-1) ramp linearly to the peak, reached at the last
    warmup step. cosine/linear: from the peak at index max(W-1, 0) to min_lr_ratio at the
    final step (index total_steps-1), so the schedule ends exactly at the floor. wsd: the
    peak up to index total_steps-1-D (the stable phase), then D = round(decay_ratio x
    total_steps) decay steps from the peak to min_lr_ratio at the final step (index
    total_steps-1) in ``decay_shape_name``.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if decay_style == "constant":
        return 1.0
    if decay_style == "wsd":
        decay = wsd_decay_steps(total_steps, warmup_steps, decay_ratio)
        last_stable = total_steps - 1 - decay
        if step <= last_stable or decay == 0:
            return 1.0
        progress = min((step - last_stable) / decay, 1.0)
        return min_lr_ratio + (1.0 - min_lr_ratio) * decay_shape(progress, decay_shape_name)
    start = max(warmup_steps - 1, 0)
    span = total_steps - 1 - start
    progress = min(max((step - start) / span, 0.0), 1.0) if span > 0 else 0.0
    if decay_style not in ("linear", "cosine"):
        raise ValueError(f"lr_scheduler.decay_style must be cosine, linear, constant or wsd, got {decay_style!r}")
    return min_lr_ratio + (1.0 - min_lr_ratio) * decay_shape(progress, decay_style)


class LRSchedulers:
    """One LambdaLR per optimizer, stepped together; they always hold the same position, so
    the checkpoint stores one position and restores it into all (also when the number of
    model parts differs after a layout change). Each parameter group's peak is its own
    ``initial_lr`` (optimizer.lr x the group's lr multiplier)."""

    def __init__(self, optimizers: Any, fn: Callable[[int], float]):
        self.fn = fn
        self.peak_lr: float = optimizers.peak_lr  # optimizer.lr: the rate of a group without lr_mult
        self.schedulers = [LambdaLR(opt, fn) for opt in optimizers.optimizers]

    def step(self) -> None:
        for s in self.schedulers:
            s.step()

    @property
    def last_step(self) -> int:
        return self.schedulers[0].last_epoch

    def get_last_lr(self) -> float:
        """The rate of a group without an lr multiplier: optimizer.lr x the schedule."""
        return self.peak_lr * self.fn(self.schedulers[0].last_epoch)

    def state_dict(self) -> dict[str, Any]:
        # base lrs and the schedule shape come from the current config on resume, so a
        # run can be resumed with a changed lr/schedule; only the position is state.
        return {"last_epoch": self.schedulers[0].last_epoch, "_step_count": self.schedulers[0]._step_count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for s in self.schedulers:
            s.last_epoch = int(state["last_epoch"])
            s._step_count = int(state["_step_count"])
            lrs = [base * self.fn(s.last_epoch) for base in s.base_lrs]
            for group, lr in zip(s.optimizer.param_groups, lrs):
                group["lr"] = lr
            s._last_lr = lrs


def build_lr_scheduler(
    optimizer: Any, cfg: JobConfig | LRSchedulerConfig, total_steps: int | None = None
) -> LRSchedulers:
    """``total_steps`` defaults to training.steps when a JobConfig is given."""
    sched = cfg.lr_scheduler if isinstance(cfg, JobConfig) else cfg
    if total_steps is None:
        if not isinstance(cfg, JobConfig):
            raise TypeError("build_lr_scheduler needs total_steps when given an LRScheduler section")
        total_steps = cfg.training.steps
    if total_steps <= 0:
        raise ValueError(f"total_steps must be > 0, got {total_steps}")
    warmup = sched.warmup_steps
    if warmup > total_steps:
        logger.warning(
            "lr_scheduler.warmup_steps (%d) > training steps (%d); warming up over all %d steps",
            warmup,
            total_steps,
            total_steps,
        )
        warmup = total_steps
    if sched.decay_style == "wsd":
        wanted = round(sched.decay_ratio * total_steps)
        if wanted > total_steps - warmup:
            logger.warning(
                "lr_scheduler.decay_ratio x training steps (%d) > steps after warmup (%d); decaying over those %d",
                wanted,
                total_steps - warmup,
                total_steps - warmup,
            )
    fn = functools.partial(
        lr_multiplier,
        warmup_steps=warmup,
        total_steps=total_steps,
        decay_style=sched.decay_style,
        min_lr_ratio=sched.min_lr_ratio,
        decay_ratio=sched.decay_ratio,
        decay_shape_name=sched.decay_shape,
    )
    return LRSchedulers(optimizer, fn)
