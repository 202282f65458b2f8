"""What one training step needs beside the forward (trainer/forward.py): its result, the
divergence check, and the reductions over the meshes of ranks that hold different tokens."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from parallel_dims import ParallelDims

__all__ = [
    "NoTargets",
    "StepResult",
    "TrainingDiverged",
    "check_finite",
    "check_targets",
    "checked_step_values",
    "global_target_count",
    "moe_layers",
    "read_step_scalars",
    "reduce_loss",
    "update_expert_bias",
]


class TrainingDiverged(RuntimeError):
    """A non-finite loss or gradient norm: stopping beats silently training on garbage."""


class NoTargets(ValueError):
    """A step whose whole global batch holds no target token (bad input: one line, exit 2)."""


def check_targets(count: float, step: int, data: str) -> None:
    """Stop the run at a step whose global batch has no target token at all (``count``: the
    step's global target count, read with its loss): its loss would be 0 and its gradient 0,
    and the optimizer would still move the weights (weight decay, momentum). Called before the
    optimizer applies the step (or after a device-side skip of it). A micro-batch, a rank's
    slice or a cp chunk without targets is normal; only the whole step's count matters."""
    if count == 0:
        raise NoTargets(
            f"step {step}: the whole global batch holds no target token (data: {data}); its conversations have "
            "no 'assistant' message (or the chat template renders none), so the loss is 0 and only weight decay "
            "would move the weights; stopped before the optimizer step. Train on conversations with assistant "
            "turns (the loss is on their tokens)"
        )


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    lr: float
    mtp_loss: float | None = None  # DeepSeek-V3 MTP: the depths' mean cross-entropy (trainer/mtp.py)
    targets: list[int] | None = None  # masked data: the step's global target tokens (one per mixture source)
    bad: bool = (
        False  # not applied: non-finite or a loss spike under on_nonfinite = skip / rollback (trainer/bad_steps.py)
    )

    dpo: dict[str, float] | None = None  # training.objective = dpo: TRL's rewards/* and logps/* (trainer/objectives/)

    def extra(self) -> dict[str, float]:
        """The optional per-step metrics of this result, for the metrics record."""
        return ({} if self.mtp_loss is None else {"mtp_loss": self.mtp_loss}) | (self.dpo or {})


def read_step_scalars(scalars: torch.Tensor) -> list[float]:
    """The step's one host sync: the values of the step's device scalars (loss, gradient norm).
    Its own function so that tests can see when in the step it runs."""
    return scalars.tolist()


def check_finite(loss: float, grad_norm: float, step: int) -> None:
    """Raise :class:`TrainingDiverged` for a non-finite loss or gradient norm of ``step``."""
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        raise TrainingDiverged(
            f"non-finite {'loss' if not math.isfinite(loss) else 'gradient norm'} at step "
            f"{step} (loss={loss}, grad_norm={grad_norm}); the run is "
            f"stopped before the optimizer applies it. Lower optimizer.lr, raise "
            f"lr_scheduler.warmup_steps or check the data, then resume from the last checkpoint."
        )


def checked_step_values(
    values: list[float], step: int, check: bool, targets: int, data: str, finite: bool = True
) -> tuple[list[float], list[int]]:
    """The step's values read on the host: (loss, gradient norm, MTP loss) and, the last
    ``targets`` values (masked data: the global target count, one per source of a mixture),
    those counts; with ``check``: a step without any target (:func:`check_targets`) or, with
    ``finite`` (``training.on_nonfinite = stop``), a non-finite loss or norm (:func:`check_finite`)
    raises."""
    counts = [int(c) for c in values[len(values) - targets :]] if targets else []
    del values[len(values) - targets :]
    if check:
        if targets:
            check_targets(sum(counts), step, data)
        if finite:
            check_finite(values[0], values[1], step)
    return values, counts


def reduce_loss(loss_sum: torch.Tensor, pd: ParallelDims) -> torch.Tensor:
    """Sum of the per-rank partial losses over every rank that holds different tokens."""
    total = loss_sum.clone()
    loss_mesh = pd.get_optional_mesh("loss")
    if loss_mesh is not None:
        dist.all_reduce(total, group=loss_mesh.get_group())
    return total


def global_target_count(
    labels: list[torch.Tensor],
    pd: ParallelDims,
    device: torch.device,
    ignore_index: int = -100,
    *,
    at_least_one: bool = True,
    sources: torch.Tensor | None = None,
    n_sources: int = 1,
) -> torch.Tensor:
    """The step's loss denominator for masked data: the number of target tokens (labels !=
    ``ignore_index``) in the whole global batch, as an int64 device scalar, the same on every
    rank; at least 1 (a step without any target has loss 0 and no gradient, not 0/0) unless
    ``at_least_one`` is False (the trainer's :func:`check_targets` reads the raw count).

    Counted before the forward from the labels every rank holds: each rank's micro-batches are
    its batch slice's full rows (cp, tp and pp ranks of one batch coordinate hold the same rows,
    so pp stages without the labels' loss still know the count), summed on the device and
    all-reduced once over the ``batch`` mesh (dp_replicate x dp_shard).

    ``sources`` (a mixture: the source index of each of this rank's samples, in micro-batch
    order): the count per source instead, an int64 vector of ``n_sources`` entries summed by the
    same one all-reduce (its sum is the step's count), never clamped."""
    if sources is not None:
        per_sample = torch.cat([(y.to(device, non_blocking=True) != ignore_index).sum(dim=1) for y in labels])
        which = sources.to(device, non_blocking=True)[:, None] == torch.arange(n_sources, device=device)
        count = (per_sample[:, None] * which).sum(dim=0)
    else:
        count = torch.stack([(y.to(device, non_blocking=True) != ignore_index).sum() for y in labels]).sum()
    batch_mesh = pd.get_optional_mesh("batch")
    if batch_mesh is not None:
        dist.all_reduce(count, group=batch_mesh.get_group())
    return count.clamp_min(1) if at_least_one and sources is None else count


def moe_layers(model_parts: list[nn.Module]) -> list[nn.Module]:
    """The MoE modules of this rank's model parts (the model contract's ``moe_layers``)."""
    return [moe for part in model_parts for moe in part.moe_layers()]


def update_expert_bias(moes: list[nn.Module], pd: ParallelDims) -> None:
    """Load statistics are summed over the ranks that route different tokens: the loss
    mesh, and tp (sequence parallel gives each tp rank its own tokens)."""
    counts = torch.stack([m.tokens_per_expert for m in moes])
    for name in ("loss", "tp"):
        mesh = pd.get_optional_mesh(name)
        if mesh is not None:
            dist.all_reduce(counts, group=mesh.get_group())
    for moe, c in zip(moes, counts):
        moe.update_expert_bias(c)
