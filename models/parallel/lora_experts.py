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
(``Shard(0)`` on the expert mesh). Expert tensor parallelism (etp > 1) splits ``hidden``: of
``w1``/``w3`` (``[E, hidden, dim]``, ``Shard(1)`` over etp) ``B`` is split the same way and ``A``
replicated; of ``w2`` (``[E, dim, hidden]``, ``Shard(2)``) ``A`` is split along its columns and
``B`` replicated. Each etp rank's local ``B @ A`` is then exactly its slice of the delta (no
communication), and the replicated factor's local gradient is a partial sum over the hidden
slices: it is taken with ``to_local(grad_placements=Partial)`` behind a ``redistribute`` to its
own placements, whose backward all-reduces it over etp (DTensor's Partial -> Replicate).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

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


def _factor(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of an adapter factor; one replicated over a mesh dim where its expert
    weight is split (etp) gets its gradient summed over that dim (see the module docstring)."""
    if not isinstance(t, DTensor):
        return t
    if not any(isinstance(p, Replicate) for p in t.placements):
        return t.to_local()
    grads = [Partial() if isinstance(p, Replicate) else p for p in t.placements]
    return t.redistribute(t.device_mesh, t.placements).to_local(grad_placements=grads)


def _with_deltas(mod: nn.Module, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor):
    out = []
    for name, w in zip(EXPERT_WEIGHTS, (w1, w2, w3)):
        a = _factor(getattr(mod, f"{name}_lora_a")).to(w.dtype)
        b = _factor(getattr(mod, f"{name}_lora_b")).to(w.dtype)
        out.append(w + torch.bmm(b, a) * mod.lora_scale)
    return tuple(out)


def expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    from models.common.experts import GroupedExperts

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
    """After expert parallelism: each adapter on its weight's mesh, split along the expert dim
    with it, and over etp as the module docstring says."""
    for fqn, mod in expert_modules(model):
        for w in EXPERT_WEIGHTS:
            weight = getattr(mod, w)
            if not isinstance(weight, DTensor):
                continue
            a, b = [], []
            for p in weight.placements:
                if not isinstance(p, Shard):
                    raise ValueError(f"lora.experts: {fqn}.{w} placed {weight.placements}, expected Shard placements")
                # the expert dim: both; the output rows (w1/w3 hidden): B; the input columns (w2 hidden): A
                a.append(p if p.dim in (0, 2) else Replicate())
                b.append(p if p.dim in (0, 1) else Replicate())
            redistribute_param(mod, f"{w}_lora_a", weight.device_mesh, a)
            redistribute_param(mod, f"{w}_lora_b", weight.device_mesh, b)
