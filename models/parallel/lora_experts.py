"""LoRA on the routed experts' grouped weights (``lora.experts = true``): one adapter pair per
expert on each of ``w1``/``w3`` ``[E, hidden, dim]`` and ``w2`` ``[E, dim, hidden]``:
``w1_lora_a`` ``[E, rank, dim]``, ``w1_lora_b`` ``[E, hidden, rank]`` (``w3`` alike),
``w2_lora_a`` ``[E, rank, hidden]``, ``w2_lora_b`` ``[E, dim, rank]``.

The experts compute with ``w + scale * B @ A`` per expert (one batched matmul per weight, in the
compute dtype, before the grouped GEMMs), which is the adapter's output exactly (no dropout on
expert adapters) and works unchanged with the grouped-GEMM, loop and float8 expert paths. Cost:
``2 * E * rows * cols * rank`` FLOPs per weight and a merged copy of each local expert weight
kept for backward (the size of the experts' gathered weights again) -- about what FSDP already
holds while the layer runs; for a large MoE with a small token count per expert that is the
price of exactness on every path.

Expert parallelism shards the adapters along the expert dimension like their weights
(``Shard(0)`` on the expert mesh); expert tensor parallelism (etp > 1) would split ``hidden``
and leave the other factor's gradient partial over etp, and is refused by the plan.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

__all__ = [
    "EXPERT_WEIGHTS",
    "add_expert_adapters",
    "expert_adapter_shapes",
    "new_param",
    "redistribute_param",
    "shard_expert_adapters",
]

EXPERT_WEIGHTS = ("w1", "w2", "w3")


def expert_adapter_shapes(w_shape: tuple[int, int, int], rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(A, B) shapes for an expert weight ``[E, out, in]``."""
    e, out, inp = w_shape
    return (e, rank, inp), (e, out, rank)


def new_param(shape: tuple[int, ...], like: torch.Tensor) -> nn.Parameter:
    """An empty parameter of ``shape`` on ``like``'s device (meta included) and dtype."""
    t = like.to_local() if isinstance(like, DTensor) else like
    return nn.Parameter(torch.empty(shape, dtype=t.dtype, device=t.device))


def redistribute_param(mod: nn.Module, name: str, mesh, placements) -> None:
    """Re-create the parameter ``mod.<name>`` as a DTensor on ``mesh`` with ``placements``, from
    its full value (every rank keeps its own slice; meta stays meta)."""
    p = getattr(mod, name)
    if isinstance(p, DTensor) and p.device_mesh == mesh and tuple(p.placements) == tuple(placements):
        return
    if p.device.type == "meta":
        full = torch.empty(p.shape, dtype=p.dtype, device="meta")
    else:
        full = p.detach().full_tensor() if isinstance(p, DTensor) else p.detach()
    setattr(mod, name, nn.Parameter(distribute_tensor(full, mesh, placements, src_data_rank=None)))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _with_deltas(mod: nn.Module, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor):
    out = []
    for name, w in zip(EXPERT_WEIGHTS, (w1, w2, w3)):
        a = _local(getattr(mod, f"{name}_lora_a")).to(w.dtype)
        b = _local(getattr(mod, f"{name}_lora_b")).to(w.dtype)
        out.append(w + torch.bmm(b, a) * mod.lora_scale)
    return tuple(out)


def expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    from models.deepseek_v3.experts import GroupedExperts

    return [(n, m) for n, m in model.named_modules() if isinstance(m, GroupedExperts)]


def add_expert_adapters(model: nn.Module, opts) -> list[str]:
    names = []
    for fqn, mod in expert_modules(model):
        for w in EXPERT_WEIGHTS:
            weight = getattr(mod, w)
            a_shape, b_shape = expert_adapter_shapes(tuple(weight.shape), opts.rank)
            setattr(mod, f"{w}_lora_a", new_param(a_shape, weight))
            setattr(mod, f"{w}_lora_b", new_param(b_shape, weight))
        mod.lora_scale = opts.scale
        mod.lora_delta = _with_deltas
        names.append(fqn)
    return names  # empty for a pipeline stage without MoE layers (check_lora checks the whole model)


def shard_expert_adapters(model: nn.Module) -> None:
    """After expert parallelism: each adapter on its weight's mesh, split along the expert dim."""
    for fqn, mod in expert_modules(model):
        for w in EXPERT_WEIGHTS:
            weight = getattr(mod, w)
            if not isinstance(weight, DTensor):
                continue
            if any(not (isinstance(p, Shard) and p.dim == 0) for p in weight.placements):
                raise ValueError(
                    f"lora.experts with {fqn}.{w} placed {weight.placements}: expert adapters support expert "
                    "parallelism (ep) but not expert tensor parallelism; use etp = 1 or lora.experts = false"
                )
            for suffix in ("lora_a", "lora_b"):
                redistribute_param(mod, f"{w}_{suffix}", weight.device_mesh, list(weight.placements))
