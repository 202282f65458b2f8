"""Held-out evaluation (``[validation]``): every ``validation.freq`` training steps and after the
last one, ``validation.steps`` forward-only steps over the validation data under the run's own
layout, reporting loss and perplexity.

The loss is computed and reduced exactly like the training loss (docs/design.md section 5): each
rank sums its token losses, divides by the validation step's global token count (every step has
the same one; the steps are then averaged), the pipeline's last stage hands its sum to every pp
rank, and the result is summed over the ``loss`` mesh; so it is the mean over every validation
token, the same number on every layout (up to
float32 summation order). With masked data (chat: labels hold IGNORE_INDEX) the divisor is the
count of target tokens over the whole evaluation: each rank sums its raw token losses, and the
sum over ranks is divided by the global target count (counted from the labels, one reduction
over the ``batch`` mesh), the same ratio the training loss takes per step. Every evaluation starts the validation data from its beginning: it
sees the same samples each time, so successive values are comparable.

Evaluation changes nothing the training depends on: no gradients, the modules' train/eval mode
restored, MoE routing statistics (which feed the expert-bias update) put back as they were, and
the training data loader untouched. With pipeline parallelism it runs a second schedule of the
same class over the same stage modules, built for the validation batch shape, through the
schedule's forward-only path (``schedule.eval``); ZBVZeroBubble has none and the config refuses
it with validation on (trainer/config/validate.py).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from trainer.config import ConfigError, JobConfig
from trainer.data.batching import PackedDataLoader
from trainer.data.loader import build_validation_dataloader, chat_stream
from trainer.data.packing import IGNORE_INDEX
from trainer.forward import LossFn, ModelForward

if TYPE_CHECKING:
    from trainer.plan import JobPlan

__all__ = ["ValidationResult", "Validator", "check_validation_targets", "one_pass_steps"]


@dataclass
class ValidationResult:
    loss: float  # token-weighted mean cross-entropy over the evaluation
    steps: int
    tokens: int  # global validation tokens evaluated
    seconds: float

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss) if math.isfinite(self.loss) and self.loss < 700 else math.inf


def one_pass_steps(cfg: JobConfig, data: PackedDataLoader) -> int:
    """``validation.steps = -1`` (a 'tokens' dataset): the full validation batches in one pass
    over the shards (a partial last batch is left out: every step has the same token count)."""
    v = cfg.validation
    samples = len(data._stream.dataset) // (v.seq_len + 1)
    steps = samples // data.global_batch_size
    if steps < 1:
        raise ConfigError(
            f"validation.dataset_path '{v.dataset_path}' holds {samples} validation samples of "
            f"validation.seq_len + 1 = {v.seq_len + 1} tokens, fewer than one validation batch of "
            f"{data.global_batch_size}; lower validation.global_batch_size (or local_batch_size) or "
            f"validation.seq_len, or use more validation data"
        )
    return steps


def check_validation_targets(cfg: JobConfig, tokenizer, samples: int) -> None:
    """Refuse (one line, at start-up) chat validation data whose evaluation holds no target
    token: its loss would be 0 / 0, reported as 0, a number that looks like a perfect model.
    Every rank reads the whole evaluation's windows (``samples``: validation steps x global
    batch) on the host, so all of them decide alike with no collective; pre-training data has
    every label a target."""
    v = cfg.validation
    if v.dataset != "chat":
        return
    _source, stream = chat_stream(cfg, v.dataset_path, tokenizer, v.seq_len, "validation.dataset_path", False)
    _tokens, targets = stream.take(samples)
    if not bool(targets[:, 1:].any()):
        raise ConfigError(
            f"validation.dataset_path '{v.dataset_path}': the {samples} windows an evaluation reads "
            f"({stream.conversations} conversations) hold no target token (no 'assistant' message, or none left "
            f"within validation.seq_len + 1 = {v.seq_len + 1} tokens), so the validation loss would read 0; point it "
            "at conversations with assistant turns, or raise validation.seq_len"
        )


class Validator:
    """Built once by the trainer (``validation.enable``); ``should_run(step)`` says when,
    ``validate()`` evaluates (a collective: every rank calls it at the same steps). The layout
    (degrees, stage plan, compute dtype) comes from the job plan; the validation batch from
    ``[validation]``."""

    def __init__(
        self,
        cfg: JobConfig,
        tokenizer,
        plan: JobPlan,
        model_parts: list[nn.Module],
        loss_fn: LossFn,
        device: torch.device,
        *,
        loss_parallel: bool,
    ):
        v = cfg.validation
        pd = plan.parallel_dims
        self.cfg, self.pd, self.model_parts, self.device = cfg, pd, model_parts, device
        self.freq, self.last_step = v.freq, cfg.training.steps
        self.data: PackedDataLoader = build_validation_dataloader(
            cfg, tokenizer, batch_rank=pd.coordinate("batch"), batch_degree=plan.batch.batch_degree
        )
        self._start = self.data.state_dict()  # every evaluation starts here
        self.steps = v.steps if v.steps > 0 else one_pass_steps(cfg, self.data)
        check_validation_targets(cfg, tokenizer, self.steps * self.data.global_batch_size)
        self.tokens_per_step = self.data.tokens_per_step
        self.pipeline = None
        if plan.stages is not None:
            from models.parallel.pipeline import build_pipeline_schedule, stage_activation_dtype

            # the training schedule's class, stages and micro-batch count; the validation batch shape
            self.pipeline = build_pipeline_schedule(
                model_parts,
                plan.stages.stages_for_rank(pd.coordinate("pp")),
                pd,
                plan.stages,
                loss_fn,
                local_batch_size=v.local_batch_size,
                seq_len=v.seq_len,
                activation_dtype=stage_activation_dtype(plan.parallelize.param_dtype),
                loss_parallel=loss_parallel,
            )
        self.forward = ModelForward(
            pd, model_parts, loss_fn, device, loss_parallel=loss_parallel, pipeline=self.pipeline
        )

    def should_run(self, step: int) -> bool:
        return step % self.freq == 0 or step == self.last_step

    @torch.no_grad()
    def validate(self) -> ValidationResult:
        start = time.perf_counter()
        self.data.load_state_dict(self._start)
        moes = [moe for part in self.model_parts for moe in part.moe_layers()]
        routing = [moe.tokens_per_expert.clone() for moe in moes]
        modes = [part.training for part in self.model_parts]
        for part in self.model_parts:
            part.eval()
        try:
            loss_sum, targets = self._evaluate()
        finally:
            for part, mode in zip(self.model_parts, modes):
                part.train(mode)
            for moe, counts in zip(moes, routing):
                moe.tokens_per_expert.copy_(counts)
        if self.pipeline is not None:
            from models.parallel.pipeline import sum_loss_over_pp

            loss_sum = sum_loss_over_pp(loss_sum, self.pd.get_optional_mesh("pp"), self.device)
        loss_mesh = self.pd.get_optional_mesh("loss")
        if loss_mesh is not None:
            dist.all_reduce(loss_sum, group=loss_mesh.get_group())
        if targets is None:
            loss = loss_sum.item() / self.steps  # each step's sum is that step's token-weighted mean
            tokens = self.steps * self.tokens_per_step
        else:
            batch_mesh = self.pd.get_optional_mesh("batch")
            if batch_mesh is not None:
                dist.all_reduce(targets, group=batch_mesh.get_group())
            tokens = int(targets.item())
            loss = loss_sum.item() / max(tokens, 1)
        return ValidationResult(loss, self.steps, tokens, time.perf_counter() - start)

    def _evaluate(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This rank's share of the sum over steps of each step's loss (token losses / the
        step's global token count; on pp ranks without the last stage, zero), and None. With
        masked data: this rank's raw sum of token losses and its count of target tokens."""
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        masked = self.data.masked
        targets = torch.zeros((), dtype=torch.int64, device=self.device) if masked else None
        for _ in range(self.steps):
            for inputs, labels in self.data.next_step():
                if masked:
                    targets += (labels.to(self.device) != IGNORE_INDEX).sum()
                part = self.forward(inputs, labels, 1 if masked else self.tokens_per_step, backward=False)
                if part is not None:
                    loss_sum += part
        return loss_sum, targets


def validate_after_step(validator: Validator | None, step: int, end: bool, watchdog, metrics, totals) -> None:
    """The loop's validation after ``step``: every ``validation.freq`` steps and after the last one
    (``end``), under the watchdog's long-phase deadline, logged and counted in the run's totals;
    its time is not the next step's."""
    if validator is None or not (validator.should_run(step) or end):
        return
    watchdog.long_phase(f"validation after step {step}")
    val = validator.validate()
    metrics.log_validation(step, loss=val.loss, steps=val.steps, tokens=val.tokens, seconds=val.seconds)
    metrics.reset_timer()
    totals.validated(step, val.loss)
