"""FSDP2 for dense and expert parameters, and mixed precision wherever FSDP2 wraps.

Gradients are SUMMED across data-parallel ranks, never averaged: the trainer's loss on each rank
is its tokens' loss summed and divided by the *global* token count, so the sum over ranks is the
exact global-batch gradient whatever the layout (dp, cp, micro-batches, expert meshes alike).

Mixed precision comes from FSDP2's ``MixedPrecisionPolicy`` wherever FSDP2 wraps: with data
parallelism, and on layouts without it that have a pipeline or experts on their own mesh
(PP-only, EP without data parallelism), where the caller passes the size-1 shard mesh
(:meth:`ParallelDims.fsdp_mesh_for` with ``allow_trivial``), on which FSDP2 never communicates and
only casts parameters to ``param_dtype`` for compute and gradients back to the fp32 master
weights. One GPU and pure TP use compute copies instead (models/parallel/mixed_precision.py: the
same values, fewer copies). So a bf16 run computes the same way (bf16 parameters and
activations, fp32 master weights, gradients and optimizer state) whatever the degrees, and bf16
loss curves stay comparable across layouts; ``torch.autocast`` instead would keep the residual
stream in fp32 on some layouts and not on others.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

__all__ = ["apply_fsdp", "reshard_policy"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def reshard_policy(policy: str, pp_enabled: bool, mesh_size: int) -> bool:
    """``default`` frees unsharded params after forward unless pipelining (where every
    micro-batch would re-gather them) or the shard mesh has one rank (nothing to gather:
    resharding would only drop the compute-dtype copy and cast it again in backward);
    ``always`` / ``never`` force it."""
    if policy == "default":
        return not pp_enabled and mesh_size > 1
    if policy in ("always", "never"):
        return policy == "always"
    raise ValueError(f"fsdp_reshard_after_forward={policy!r}; legal values: default, always, never")


def _offload_policy(cpu_offload: bool, mesh: DeviceMesh | None) -> OffloadPolicy:
    """FSDP2's CPU offload where asked. Pinned host memory (asynchronous copies) only where the
    mesh's device is an accelerator: torch cannot pin memory on a host without one ("Cannot
    access accelerator device"), and with a CPU compute device FSDP2's host copies are the
    tensors themselves."""
    if not cpu_offload:
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=mesh is not None and mesh.device_type != "cpu")


def _dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"mixed precision dtype {name!r}; legal values: {', '.join(_DTYPES)}")
    return _DTYPES[name]


def apply_fsdp(
    model: nn.Module,
    dense_mesh: DeviceMesh | None,
    expert_mesh: DeviceMesh | None,
    *,
    param_dtype: str = "float32",
    reduce_dtype: str = "float32",
    reshard_after_forward: str = "default",
    pp_enabled: bool = False,
    separate_experts: bool = False,
    cpu_offload: bool = False,
) -> None:
    """Wrap each block (and, when ``separate_experts``, each block's routed experts on
    ``expert_mesh``), then the embeddings, the norm+output head and the root, in place. With
    tied embeddings the embeddings, norm and head stay in the root unit (one unit per
    parameter). ``cpu_offload``: every unit under FSDP2's ``CPUOffloadPolicy`` (its sharded
    parameters and their gradients, and so the optimizer state, in host memory; the optimizer
    steps there: models/parallel/offload.py)."""
    mp = MixedPrecisionPolicy(param_dtype=_dtype(param_dtype), reduce_dtype=_dtype(reduce_dtype))
    offload = _offload_policy(cpu_offload, dense_mesh if dense_mesh is not None else expert_mesh)
    reshard_policy(reshard_after_forward, pp_enabled, 2)  # a bad policy fails even if nothing is wrapped
    wrapped: list[tuple[FSDPModule, int]] = []  # with the number of ranks of its mesh

    def wrap(module: nn.Module, mesh: DeviceMesh, reshard_flag: bool) -> None:
        reshard_flag = reshard_flag and reshard_policy(reshard_after_forward, pp_enabled, mesh.size())
        wrapped.append(
            (
                fully_shard(
                    module, mesh=mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=reshard_flag
                ),
                mesh.size(),
            )
        )

    blocks = model.blocks()
    for i, block in enumerate(blocks):
        if block.moe_enabled and separate_experts and expert_mesh is not None:
            wrap(block.moe.experts, expert_mesh, True)
        if dense_mesh is not None:
            # the last block's params are needed right away in backward: keep them gathered
            wrap(block, dense_mesh, i < len(blocks) - 1)
    # Tied embeddings (one Parameter for tok_embeddings and output): a parameter may belong to
    # one FSDP unit only, and its gradient is complete only after the embedding's backward, the
    # last of the step. The root unit is that one: it stays gathered from the first forward to
    # the end of backward and reduce-scatters in FSDP's final backward callback.
    tied = (
        model.tok_embeddings is not None
        and model.output is not None
        and model.output.weight is model.tok_embeddings.weight
    )
    if dense_mesh is not None and not tied:
        if model.tok_embeddings is not None:
            wrap(model.tok_embeddings, dense_mesh, True)
        if model.output is not None:
            head = [m for m in (model.norm, model.output) if m is not None]
            # norm + output form one FSDP group (one all-gather); the returned handle is the list
            fully_shard(head, mesh=dense_mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=False)
            wrapped.append((head[0], dense_mesh.size()))
    if dense_mesh is not None:
        wrap(model, dense_mesh, True)
    for module, ranks in wrapped:
        if ranks == 1:
            # nothing to reduce: FSDP2 copies the gradient from its reduce buffer to the output
            # as it is, and a divide factor would add a division (``copy_(grad / factor)``:
            # 8 more bytes per parameter per step)
            continue
        # exact sums across ranks (see module docstring); SUM is also the one op every backend
        # supports (gloo has no PREMUL_SUM)
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)
