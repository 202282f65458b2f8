"""Bad steps: what a step with a non-finite loss or gradient norm (or a loss spike) does,
``training.on_nonfinite`` (docs/long_runs.md).

``stop`` (the default): the run stops before the optimizer applies the step (trainer/step.py
``TrainingDiverged``, one line, exit 1).

``skip``: the update is not applied, on any rank: every rank reads the same reduced loss and
gradient norm (the step's one host read), so every rank decides alike with no extra collective.
Where the fused AdamW kernel skips on the device (``found_inf``) it does so (weights, moments and
step counts untouched); elsewhere the optimizer step is not called. The step counts as a step of
the run (its batch is consumed, the learning-rate schedule moves on), and as ``skipped_steps`` in
the metrics. ``training.max_consecutive_skips`` bad steps in a row stop the run with one line.

``rollback``: the newest complete checkpoint is loaded (weights, optimizer, schedule, data
position, RNG) and the run goes on from there, except that the bad step's global samples
``[start, end)`` are added to the loader's skipped ranges (``training.skip_samples``): the step
that reaches ``start`` reads on from ``end``. So the run after a rollback is exactly a run started
with ``--training.skip_samples start:end``. The range is named in the log and in a
metrics.jsonl row (``rollback_to``, ``skipped_samples``); the steps between the checkpoint and
the bad step are trained again and logged again (their later rows are the ones that count).

The loss-spike rule (``training.loss_spike_factor`` > 0): a step whose loss is above the factor
times the median of the last ``loss_spike_window`` good steps' losses is a bad step too. The
threshold is known before the step (it depends on earlier steps only), so the fused kernel's
device-side skip can include it without another host read.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

import torch

from trainer.step import TrainingDiverged

__all__ = ["BadSteps"]

_SPIKE_MIN = 10  # good steps before the loss-spike rule judges


class BadSteps:
    """The policy of one run; ``log`` prints a line for the user (rank 0)."""

    def __init__(self, cfg, log=print):
        t = cfg.training
        self.policy = t.on_nonfinite
        self.max_in_row = t.max_consecutive_skips
        self.spike_factor = t.loss_spike_factor
        self.losses: deque[float] = deque(maxlen=t.loss_spike_window)
        self.log = log
        self.skipped = 0  # steps not applied (skip), or undone (rollback)
        self.in_row = 0
        self.rollbacks = 0

    @property
    def stops(self) -> bool:
        return self.policy == "stop"

    def device_skip_ok(self, moes: list) -> bool:
        """Whether the step may decide on the device (fused AdamW's ``found_inf``): with MoE
        layers a skipped step must not move the experts' bias either, which is updated before
        the host read there, so those read first."""
        return self.stops or not moes

    def spike_threshold(self) -> float:
        """The loss above which this step is a spike (inf while the rule is off or still filling)."""
        if self.spike_factor <= 0 or len(self.losses) < min(_SPIKE_MIN, self.losses.maxlen):
            return math.inf
        return self.spike_factor * statistics.median(self.losses)

    def no_step(self, scalars: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor:
        """The device-side skip flag (float32 scalar, 1.0 = skip): a non-finite value, a step
        without any target, or a loss spike."""
        bad = ~torch.isfinite(scalars).all() | (scalars[0] > self.spike_threshold())
        if targets is not None:
            bad = bad | (targets.sum() == 0)
        return bad.float()

    def is_bad(self, loss: float, grad_norm: float) -> bool:
        return not (math.isfinite(loss) and math.isfinite(grad_norm)) or loss > self.spike_threshold()

    def why(self, loss: float, grad_norm: float, step: int) -> str:
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            what = "loss" if not math.isfinite(loss) else "gradient norm"
            return f"non-finite {what} at step {step} (loss={loss}, grad_norm={grad_norm})"
        return (
            f"loss spike at step {step}: loss {loss:.4f} above training.loss_spike_factor = {self.spike_factor} x "
            f"the median {statistics.median(self.losses):.4f} of the last {len(self.losses)} steps"
        )

    def judge(self, loss: float, grad_norm: float, step: int) -> bool:
        """After the step's host read: whether the step is a bad one to skip or roll back (under
        ``stop`` a non-finite step raised already; a loss spike raises here)."""
        if self.stops:
            self._check_spike_stop(loss, grad_norm, step)
            return False
        return self.is_bad(loss, grad_norm)

    def _check_spike_stop(self, loss: float, grad_norm: float, step: int) -> None:
        """``stop``: a loss spike stops the run as a non-finite step does (the step is not applied)."""
        if math.isfinite(loss) and loss > self.spike_threshold():
            raise TrainingDiverged(
                f"{self.why(loss, grad_norm, step)}; the run is stopped before the optimizer applies it. "
                "Lower optimizer.lr or check the data, or set training.on_nonfinite = 'skip' or 'rollback'"
            )

    def good(self, loss: float) -> None:
        """A step that was applied."""
        self.in_row = 0
        if self.spike_factor > 0:
            self.losses.append(loss)

    def bad(self, step: int, loss: float, grad_norm: float) -> str:
        """A bad step under skip or rollback: counted; too many in a row stop the run. Returns
        the words for its line."""
        self.in_row += 1
        self.skipped += 1
        why = self.why(loss, grad_norm, step)
        if self.in_row > self.max_in_row:
            raise TrainingDiverged(
                f"{why}: {self.in_row} bad steps in a row (training.max_consecutive_skips = {self.max_in_row}); "
                f"the run is stopped (on_nonfinite = {self.policy} cannot get past them). Lower optimizer.lr or "
                "check the data, then resume from the last checkpoint"
            )
        return why

    def after_step(self, step: int, result, data, ckpt, metrics, phase) -> int | None:
        """The training loop, after ``step`` (every rank alike: they read the same values):
        a good step feeds the loss-spike median; a bad one is counted and skipped (its line) or
        rolled back (under ``phase(what)``, the trainer's long phase). Returns the step the run
        goes on after a rollback, else None."""
        if not result.bad:
            self.good(result.loss)
            return None
        why = self.bad(step, result.loss, result.grad_norm)
        if self.policy == "skip":
            self.log(
                f"skipped step {step}: {why}; its update was not applied on any rank (skipped_steps {self.skipped}; "
                f"{self.in_row} in a row, at most training.max_consecutive_skips = {self.max_in_row})"
            )
            return None
        with phase(f"rollback after step {step}"):
            return self.rollback(step, why, data, ckpt, metrics)

    def metrics(self) -> dict[str, int]:
        return {} if self.stops else {"skipped_steps": self.skipped}

    def rollback(self, step: int, why: str, data, ckpt, metrics) -> int:
        """Undo bad step ``step``: reload the newest complete checkpoint and mark the step's
        samples skipped in the loader. Returns the step the run goes on after."""
        end = int(data.state_dict()["sample_index"])  # the position after the bad step
        start = end - data.global_batch_size
        back = ckpt.reload_newest()
        if back is None:
            raise TrainingDiverged(
                f"{why}: training.on_nonfinite = rollback, but the run has no complete checkpoint yet to roll back "
                f"to (checkpoint.interval = {ckpt.config.interval}); lower checkpoint.interval or resume from the "
                f"start with training.skip_samples = ['{start}:{end}']"
            )
        data.add_skip(start, end)  # after the load: the loader's prefetch was dropped by it
        self.rollbacks += 1
        self.log(
            f"rollback: {why}; reloaded checkpoint step-{back}, global samples {start}:{end} of step {step} are "
            f"skipped (rollback {self.rollbacks}; bad steps in a row: {self.in_row})"
        )
        metrics.log_event(step, {"rollback_to": back, "skipped_samples": f"{start}:{end}", **self.metrics()})
        return back
