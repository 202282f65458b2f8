"""The optimizer over (possibly several, pipeline-stage) model parts: AdamW, or Muon for the
hidden matrices beside AdamW for the rest, with parameter groups (trainer/optim/groups.py).
The LR schedule is trainer/optim/lr_schedule.py (re-exported here).

One optimizer per model part and kind rather than one over all parts: the DCP state-dict
helpers (``get/set_optimizer_state_dict``) map parameters to FQNs through a single module, and
each pipeline stage is its own module with the original model's FQNs. ``Optimizers`` and
``LRSchedulers`` make the list behave like one optimizer/scheduler.

Weight decay (default groups) applies to parameters with >= 2 dims (linear weights,
embeddings, the output projection, expert weights); 1-D parameters (norm scales, biases) are
not decayed, because shrinking a norm scale towards 0 fights the normalisation it implements.
Embeddings are decayed like other matrices, as in the Llama recipes.

AdamW's parameter groups are further split by tensor layout (plain tensors; DTensors per mesh
and placements) so the multi-tensor kernels apply to every layout: ``optimizer.implementation``
``auto`` runs the fused AdamW kernel on GPUs and the foreach kernels on CPU.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from models.common.init import canonical_fqn
from models.parallel.float8 import plain_state_dict
from models.parallel.pipeline.tied import checkpoint_optim_key, head_only
from trainer.config import JobConfig
from trainer.config import Optimizer as OptimizerConfig
from trainer.optim import foreach_strategy
from trainer.optim.groups import GROUPING_KEY, check_grouping, check_patterns, choose, grouping_signature, summary_lines
from trainer.optim.low_precision import STATE_DTYPES, AdamWLowPrecision
from trainer.optim.lr_schedule import LRSchedulers, build_lr_scheduler, lr_multiplier
from trainer.optim.muon import Muon
from trainer.simulation.run_mode import RunMode

logger = logging.getLogger(__name__)

__all__ = ["LRSchedulers", "Optimizers", "build_lr_scheduler", "build_optimizer", "lr_multiplier", "param_groups"]

_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def _layout_key(p: torch.Tensor) -> Any:
    """Parameters that one multi-tensor (foreach or fused) kernel call can update together:
    plain tensors per device and dtype, DTensors per mesh and placements. DTensor dispatches a
    foreach/fused op over the whole list and rejects lists that mix plain tensors and DTensors
    or DTensors of different meshes (e.g. expert weights on the EP mesh next to dense weights
    on the FSDP mesh), as clipping does (trainer/optim/grad_clip.py)."""
    if isinstance(p, DTensor):
        return ("dtensor", p.device_mesh, p.placements, p.dtype)  # mesh equality is what DTensor checks
    return ("tensor", p.device, p.dtype)


def optimizer_groups(model: nn.Module, cfg: OptimizerConfig) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The (AdamW, Muon) torch parameter groups of one model part: one per (table, weight decay,
    tensor layout), tables in config order first, then the default groups, decayed first;
    module order inside each (see trainer/optim/groups.py for who gets what)."""
    groups: dict[tuple, tuple[Any, list[torch.Tensor]]] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            c = choose(canonical_fqn(name), p.ndim, cfg)
            key = (c.index < 0, c.index, c.weight_decay == 0.0, c.optimizer, c.weight_decay, _layout_key(p))
            groups.setdefault(key, (c, []))[1].append(p)
    adamw, muon = [], []
    for key in sorted(groups, key=lambda k: k[:3]):  # stable: layouts keep module order
        c, params = groups[key]
        group = {"params": params, "lr": cfg.lr * c.lr_mult, "weight_decay": c.weight_decay}
        if c.optimizer == "Muon":
            muon.append(group)
        else:
            adamw.append({**group, "betas": c.betas, "eps": c.eps})
    return adamw, muon


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
    """One AdamW (and with ``optimizer.name = "Muon"`` one Muon) per model part, driven as one
    optimizer. ``all_params``: (FQN, shape) of every trainable parameter of the whole model
    (every pipeline stage, after the converters: with LoRA the adapters), for the check that
    each parameter group gets a parameter and for the start-up summary (:attr:`summary`);
    ``frozen_params`` the others (named in both). Both default to the given parts'."""

    def __init__(
        self,
        model_parts: list[nn.Module],
        cfg: OptimizerConfig,
        all_params: list[tuple[str, tuple[int, ...]]] | None = None,
        frozen_params: list[tuple[str, tuple[int, ...]]] | None = None,
    ):
        if cfg.name not in ("AdamW", "Muon"):
            raise ValueError(f"optimizer.name '{cfg.name}' is not supported; use 'AdamW' or 'Muon'")
        self.model_parts = list(model_parts)
        self.peak_lr = cfg.lr
        self.optimizers: list[torch.optim.Optimizer] = []
        self._parts: list[nn.Module] = []  # the model part of each optimizer
        for part in self.model_parts:
            if not any(p.requires_grad for p in part.parameters()):
                raise ValueError(f"model part {type(part).__name__} has no trainable parameters")
        if all_params is None:
            named = [(canonical_fqn(n), p) for part in self.model_parts for n, p in part.named_parameters()]
            all_params = [(n, tuple(p.shape)) for n, p in named if p.requires_grad]
            frozen_params = [(n, tuple(p.shape)) for n, p in named if not p.requires_grad]
        frozen_params = frozen_params or []
        check_patterns([n for n, _ in all_params], cfg, frozen=[n for n, _ in frozen_params])
        self.summary = summary_lines(all_params, cfg, frozen=frozen_params)
        self.signature = grouping_signature(cfg)
        impl = resolve_implementation(cfg.implementation, [p for part in self.model_parts for p in part.parameters()])
        self.state_dtype = cfg.state_dtype
        low = STATE_DTYPES[cfg.state_dtype] if cfg.state_dtype != "float32" else None
        if low is not None:
            # torch's kernels keep moments in the parameter's dtype: bf16 moments run meshtrain's
            # own per-parameter kernel (stochastic rounding, trainer/optim/low_precision.py)
            impl = "for-loop"
            self.summary.append(
                f"optimizer.state_dtype = {cfg.state_dtype}: moments stored in {cfg.state_dtype} with "
                "stochastic rounding (half the state bytes); AdamW runs meshtrain's per-parameter kernel"
            )
        self.implementation = impl
        self.has_muon = False
        for part in self.model_parts:
            adamw_groups, muon_groups = optimizer_groups(part, cfg)
            if adamw_groups:
                self._add(
                    part,
                    AdamWLowPrecision(
                        adamw_groups,
                        lr=cfg.lr,
                        betas=tuple(cfg.betas),
                        eps=cfg.eps,
                        weight_decay=cfg.weight_decay,
                        state_dtype=low,
                    )
                    if low is not None
                    else torch.optim.AdamW(
                        adamw_groups,
                        lr=cfg.lr,
                        betas=tuple(cfg.betas),
                        eps=cfg.eps,
                        weight_decay=cfg.weight_decay,
                        foreach=impl == "foreach",
                        fused=impl == "fused",
                    ),
                )
            if muon_groups:
                self.has_muon = True
                self._add(
                    part,
                    Muon(
                        muon_groups,
                        lr=cfg.lr,
                        weight_decay=cfg.weight_decay,
                        momentum=cfg.muon_momentum,
                        nesterov=cfg.muon_nesterov,
                        ns_steps=cfg.muon_ns_steps,
                        ns_coefficients=cfg.muon_ns_coefficients,
                        update_rms=cfg.muon_update_rms,
                        distribution=cfg.muon_distribution,
                        state_dtype=STATE_DTYPES[cfg.state_dtype],
                    ),
                )
        # the config's hyperparameters of every group, re-applied after a checkpoint load (as
        # the lr is: the schedule recomputes it from the config)
        self._configured = [
            [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] for opt in self.optimizers
        ]

    def _add(self, part: nn.Module, opt: torch.optim.Optimizer) -> None:
        self._parts.append(part)
        self.optimizers.append(opt)

    @property
    def skips_on_device(self) -> bool:
        """Whether :meth:`step` can skip a step on the device (``found_inf``): the fused AdamW
        kernel takes it (it leaves parameters, moments and step counts as they were); the
        foreach and for-loop implementations, and Muon, refuse it."""
        return self.implementation == "fused" and not self.has_muon

    def step(self, found_inf: torch.Tensor | None = None) -> None:
        """One step of every optimizer. ``found_inf``: a float32 device scalar, 1.0 to skip the
        step on the device without a host sync (only where :attr:`skips_on_device`)."""
        if found_inf is not None and not self.skips_on_device:
            raise ValueError(f"found_inf needs the fused AdamW kernel (and no Muon), not {self.implementation!r}")
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
        reshardable by DCP to a different layout, and the grouping (:data:`GROUPING_KEY`)."""
        merged: dict[str, Any] = {}
        for part, opt in zip(self._parts, self.optimizers):
            # a tied head's copy (last pipeline stage) under the embedding's name: one entry in
            # a checkpoint, equal on both stages (models/parallel/pipeline/tied.py)
            state = plain_state_dict(get_optimizer_state_dict(part, opt, options=_FLAT))
            for k, v in state.items():
                merged.setdefault(checkpoint_optim_key(part, k), v)
        merged[GROUPING_KEY] = self.signature
        return merged

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore every group's state; a checkpoint saved under another grouping is refused
        (one line; ``checkpoint.exclude_from_loading = ["optimizer"]`` starts fresh instead)."""
        state_dict = dict(state_dict)
        check_grouping(state_dict.pop(GROUPING_KEY, None), self.signature)
        for part, opt, configured in zip(self._parts, self.optimizers, self._configured):
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
            if isinstance(opt, Muon) and opt.state_dtype != torch.float32:
                sd = _with_step_counts(part, opt, sd)
            set_optimizer_state_dict(part, opt, optim_state_dict=sd, options=_FLAT)
            for group, values in zip(opt.param_groups, configured):
                group.update(values)


def _with_step_counts(part: nn.Module, opt: Muon, sd: dict[str, Any]) -> dict[str, Any]:
    """A float32-state checkpoint has no Muon step counts (only bf16 momentum keeps one, to salt
    its stochastic rounding): loaded into bf16 state, each count restarts at 0."""
    missing = [k for k in get_optimizer_state_dict(part, opt, options=_FLAT) if k.endswith(".step") and k not in sd]
    return {**sd, **{k: torch.tensor(0.0) for k in missing}} if missing else sd


def build_optimizer(
    model_parts: list[nn.Module],
    cfg: JobConfig | OptimizerConfig,
    all_params: list[tuple[str, tuple[int, ...]]] | None = None,
    frozen_params: list[tuple[str, tuple[int, ...]]] | None = None,
) -> Optimizers:
    if isinstance(model_parts, nn.Module):
        raise TypeError("build_optimizer expects a list of model parts, e.g. [model]")
    foreach_strategy.install()  # DTensor prices a foreach op once per kind of parameter
    opt_cfg = cfg.optimizer if isinstance(cfg, JobConfig) else cfg
    local = isinstance(cfg, JobConfig) and RunMode.from_config(cfg).local
    if local and opt_cfg.name == "Muon" and opt_cfg.muon_distribution == "round_robin":
        # one process runs every rank: round_robin's point-to-point exchange cannot be simulated,
        # while gather's all-gathers can, and the two give the same update bitwise
        # (tests/distributed/test_muon_round_robin.py)
        opts = Optimizers(
            model_parts, dataclasses.replace(opt_cfg, muon_distribution="gather"), all_params, frozen_params
        )
        opts.summary.append(
            "Muon: comm.mode = local_tensor simulates the ranks in one process, where round_robin's "
            "point-to-point exchange cannot run: muon_distribution = gather (the same update, bitwise)"
        )
        return opts
    return Optimizers(model_parts, opt_cfg, all_params, frozen_params)
