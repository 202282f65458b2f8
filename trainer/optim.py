"""AdamW over (possibly several, pipeline-stage) model parts, and the LR schedule.

One ``torch.optim.AdamW`` per model part rather than one over all parts: the DCP
state-dict helpers (``get/set_optimizer_state_dict``) map parameters to FQNs through a
single module, and each pipeline stage is its own module with the original model's FQNs.
``Optimizers`` and ``LRSchedulers`` make the list behave like one optimizer/scheduler.

Weight decay applies to parameters with >= 2 dims (linear weights, embeddings, the
output projection, expert weights); 1-D parameters (norm scales, biases) are not decayed,
because shrinking a norm scale towards 0 fights the normalisation it implements. Embeddings
are decayed like other matrices, as in the Llama recipes.

Parameter groups are further split by tensor layout (plain tensors; DTensors per mesh and
placements) so the multi-tensor kernels apply to every layout: ``optimizer.implementation``
``auto`` runs the fused AdamW kernel on GPUs and the foreach kernels on CPU.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from models.parallel.float8 import plain_state_dict
from models.parallel.pipeline.tied import checkpoint_optim_key, head_only
from trainer.config import JobConfig
from trainer.config import LRScheduler as LRSchedulerConfig
from trainer.config import Optimizer as OptimizerConfig

logger = logging.getLogger(__name__)

_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def _layout_key(p: torch.Tensor) -> Any:
    """Parameters that one multi-tensor (foreach or fused) kernel call can update together:
    plain tensors per device and dtype, DTensors per mesh and placements. DTensor dispatches a
    foreach/fused op over the whole list and rejects lists that mix plain tensors and DTensors
    or DTensors of different meshes (e.g. expert weights on the EP mesh next to dense weights
    on the FSDP mesh), as clipping does (trainer/grad_clip.py)."""
    if isinstance(p, DTensor):
        return ("dtensor", p.device_mesh, p.placements, p.dtype)  # mesh equality is what DTensor checks
    return ("tensor", p.device, p.dtype)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW parameter groups: matrices decayed, 1-D parameters not, and within each, one group
    per tensor layout (see :func:`_layout_key`), so the foreach and fused kernels can batch
    every group whatever mix of meshes the parallelisms produced. Groups keep module order."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for _, p in model.named_parameters():
        if p.requires_grad:
            groups.setdefault((p.ndim >= 2, _layout_key(p)), []).append(p)
    ordered = sorted(groups.items(), key=lambda kv: not kv[0][0])  # decayed groups first (stable)
    return [{"params": params, "weight_decay": weight_decay if decay else 0.0} for (decay, _), params in ordered]


def resolve_implementation(implementation: str, params: Iterable[torch.Tensor]) -> str:
    """``auto`` -> ``fused`` when every parameter is on a GPU (one kernel launch per group
    instead of several per parameter), else ``foreach``."""
    if implementation != "auto":
        return implementation
    return "fused" if all(p.device.type == "cuda" for p in params) else "foreach"


class Optimizers:
    """One AdamW per model part, driven as one optimizer."""

    def __init__(self, model_parts: list[nn.Module], cfg: OptimizerConfig):
        if cfg.name != "AdamW":
            raise ValueError(f"optimizer.name '{cfg.name}' is not supported; use 'AdamW'")
        self.model_parts = list(model_parts)
        self.optimizers: list[torch.optim.Optimizer] = []
        for part in self.model_parts:
            if not any(p.requires_grad for p in part.parameters()):
                raise ValueError(f"model part {type(part).__name__} has no trainable parameters")
        impl = resolve_implementation(cfg.implementation, [p for part in self.model_parts for p in part.parameters()])
        self.implementation = impl
        for part in self.model_parts:
            self.optimizers.append(
                torch.optim.AdamW(
                    param_groups(part, cfg.weight_decay),
                    lr=cfg.lr,
                    betas=tuple(cfg.betas),
                    eps=cfg.eps,
                    weight_decay=cfg.weight_decay,
                    foreach=impl == "foreach",
                    fused=impl == "fused",
                )
            )

    @property
    def skips_on_device(self) -> bool:
        """Whether :meth:`step` can skip a step on the device (``found_inf``): the fused AdamW
        kernel takes it (it leaves parameters, moments and step counts as they were); the
        foreach and for-loop implementations refuse it."""
        return self.implementation == "fused"

    def step(self, found_inf: torch.Tensor | None = None) -> None:
        """One AdamW step of every part. ``found_inf``: a float32 device scalar, 1.0 to skip the
        step on the device without a host sync (only where :attr:`skips_on_device`)."""
        if found_inf is not None and not self.skips_on_device:
            raise ValueError(f"found_inf needs the fused AdamW kernel, not {self.implementation!r}")
        for opt in self.optimizers:
            if found_inf is None:
                opt.step()
                continue
            # torch's Adam/AdamW pass the optimizer's ``found_inf`` attribute to the fused
            # kernel (what torch.amp.GradScaler sets)
            opt.found_inf = found_inf
            try:
                opt.step()
            finally:
                del opt.found_inf

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    def state_dict(self) -> dict[str, Any]:
        """Flat FQN-keyed state (``state.<fqn>.exp_avg``...), mergeable across parts and
        reshardable by DCP to a different layout."""
        merged: dict[str, Any] = {}
        for part, opt in zip(self.model_parts, self.optimizers):
            # a tied head's copy (last pipeline stage) under the embedding's name: one entry in
            # a checkpoint, equal on both stages (models/parallel/pipeline/tied.py)
            state = plain_state_dict(get_optimizer_state_dict(part, opt, options=_FLAT))
            for k, v in state.items():
                merged.setdefault(checkpoint_optim_key(part, k), v)
        return merged

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for part, opt in zip(self.model_parts, self.optimizers):
            sd = state_dict
            if head_only(part):  # its copy of the tied weight reads the embedding's state
                sd = dict(state_dict)
                for k in get_optimizer_state_dict(part, opt, options=_FLAT):
                    if k not in sd:
                        # a copy: where this rank also holds the embedding (a V schedule), the
                        # optimizer would otherwise keep ONE moment tensor for both copies and
                        # update it twice per step
                        v = state_dict[checkpoint_optim_key(part, k)]
                        sd[k] = v.clone() if isinstance(v, torch.Tensor) else v
            set_optimizer_state_dict(part, opt, optim_state_dict=sd, options=_FLAT)


def build_optimizer(model_parts: list[nn.Module], cfg: JobConfig | OptimizerConfig) -> Optimizers:
    if isinstance(model_parts, nn.Module):
        raise TypeError("build_optimizer expects a list of model parts, e.g. [model]")
    return Optimizers(model_parts, cfg.optimizer if isinstance(cfg, JobConfig) else cfg)


# ---------------------------------------------------------------------- LR schedule


def lr_multiplier(step: int, *, warmup_steps: int, total_steps: int, decay_style: str, min_lr_ratio: float) -> float:
    """Factor on the peak lr for the optimizer step that follows ``step`` completed steps.

    Warmup: steps 1..W (step index 0..W-1) ramp linearly to the peak, reached at the last
    warmup step. Decay: from the peak at index max(W-1, 0) to min_lr_ratio at the final
    step (index total_steps-1), so the schedule ends exactly at the floor.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if decay_style == "constant":
        return 1.0
    start = max(warmup_steps - 1, 0)
    span = total_steps - 1 - start
    progress = min(max((step - start) / span, 0.0), 1.0) if span > 0 else 0.0
    if decay_style == "linear":
        shape = 1.0 - progress
    elif decay_style == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"lr_scheduler.decay_style must be cosine, linear or constant, got {decay_style!r}")
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape


class LRSchedulers:
    """One LambdaLR per optimizer, stepped together; they always hold the same position, so
    the checkpoint stores one position and restores it into all (also when the number of
    model parts differs after a layout change)."""

    def __init__(self, optimizers: Optimizers, fn: Callable[[int], float]):
        self.fn = fn
        self.schedulers = [LambdaLR(opt, fn) for opt in optimizers.optimizers]

    def step(self) -> None:
        for s in self.schedulers:
            s.step()

    @property
    def last_step(self) -> int:
        return self.schedulers[0].last_epoch

    def get_last_lr(self) -> float:
        return self.schedulers[0].get_last_lr()[0]

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
    optimizer: Optimizers, cfg: JobConfig | LRSchedulerConfig, total_steps: int | None = None
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
    fn = functools.partial(
        lr_multiplier,
        warmup_steps=warmup,
        total_steps=total_steps,
        decay_style=sched.decay_style,
        min_lr_ratio=sched.min_lr_ratio,
    )
    return LRSchedulers(optimizer, fn)
