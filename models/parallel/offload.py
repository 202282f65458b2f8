"""CPU offload (``training.cpu_offload = true``) through FSDP2's own ``CPUOffloadPolicy``.

What FSDP2 does with it (torch/distributed/fsdp/_fully_shard/_fsdp_param.py and
_fsdp_collectives.py, torch 2.13): each unit's sharded parameters live in host memory (pinned
where the device is an accelerator); before the all-gather the shard is copied to the device,
and after the reduce-scatter the gradient shard is copied back to host memory, so the
optimizer, whose state is created like its parameters, steps on the host copy. The device keeps
only what a step gathers: the unsharded parameters of the units in use, the gradients being
reduced and the activations.

So that every parameter is offloaded, FSDP2 wraps every layout when it is on (the size-1 mesh
where nothing is sharded: one GPU, pure TP, PP or EP without data parallelism;
models/parallelize.py). The parameters are created on the host (FSDP2 refuses a unit whose
parameters are on the device) and the buffers (RoPE table, MoE routing counts) on the device:
:func:`materialize`.

:func:`cpu_offload_bytes` is the device-memory saving per rank (sharded parameters, their
gradients and the optimizer state), from the parallelized model's local shards: it works on a
meta-device model as well (the planner's way).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = [
    "OPTIMIZER_STATE_BYTES",
    "cpu_offload_bytes",
    "materialize",
    "memory_options_line",
]

# bytes of optimizer state per float32 trainable element: AdamW's two moments; Muon keeps one
# momentum for its matrices (and AdamW's two for the rest): the larger figure is the bound
OPTIMIZER_STATE_BYTES = {"AdamW": 8, "Muon": 8}


def _local(p: torch.Tensor) -> torch.Tensor:
    return p._local_tensor if hasattr(p, "_local_tensor") else p


def _shard_bytes(p: torch.Tensor) -> int:
    """Bytes of a parameter's shard as FSDP2 stores it: dim 0 padded to a multiple of the shard
    group (every rank holds ``ceil(dim0 / ranks)`` rows), read off the DTensor's global shape."""
    local = _local(p)
    if not hasattr(p, "device_mesh"):
        return local.numel() * local.element_size()
    rows = p.shape[0] if p.dim() else 1
    shards = 1
    for placement, size in zip(p.placements, p.device_mesh.shape, strict=True):
        if getattr(placement, "dim", None) == 0:  # Shard or (FSDP over TP) _StridedShard
            shards *= size
    rest = local.numel() // max(local.shape[0], 1) if local.dim() else 1
    if local.dim() and local.shape[0] == 0:  # an empty shard: the rest from the global shape
        rest = p.numel() // max(rows, 1)
        for placement, size in zip(p.placements, p.device_mesh.shape, strict=True):
            if getattr(placement, "dim", 0) != 0:
                rest //= size
    return -(-rows // shards) * rest * local.element_size()


def cpu_offload_bytes(model_parts: list[nn.Module], optimizer="AdamW") -> dict[str, int]:
    """Device memory per rank that CPU offload moves to the host: the sharded parameters (FSDP2's
    padded shards), the gradients of the trainable ones (same dtype; FSDP2's padded
    reduce-scatter output) and the optimizer state per element of each trainable local shard,
    unpadded: with ``optimizer`` a name, :data:`OPTIMIZER_STATE_BYTES` (for Muon a bound); or a
    function ``(fqn, parameter) -> bytes per element``, exact with the trainer's
    (trainer/optim/low_precision.py ``state_bytes_fn``: the optimizer each parameter's group
    routes it to and ``optimizer.state_dtype``). Works on meta-device models."""
    per_param = _state_bytes_fn(optimizer)
    params = grads = state = 0
    seen: set[int] = set()
    for part in model_parts:
        for name, p in part.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            nbytes = _shard_bytes(p)
            params += nbytes
            if p.requires_grad:
                grads += nbytes
                # the moments are created like the (unpadded) local shard
                state += _local(p).numel() * per_param(name, p)
    return {"params": params, "grads": grads, "optimizer": state, "total": params + grads + state}


def _state_bytes_fn(optimizer):
    if isinstance(optimizer, str):
        return lambda name, p: OPTIMIZER_STATE_BYTES.get(optimizer, 8)
    return optimizer


def materialize(part: nn.Module, device: torch.device, seed: int, cpu_offload: bool) -> None:
    """``part`` (parallelized, on the meta device) materialized and FQN-seeded: on ``device``,
    or with CPU offload on an accelerator, its parameters in host memory and its buffers on
    ``device``."""
    host = cpu_offload and device.type != "cpu"
    part.to_empty(device="cpu" if host else device)
    with torch.no_grad():
        part.init_weights(seed)
    if host:
        for module in part.modules():
            for name, buf in module.named_buffers(recurse=False):
                module._buffers[name] = buf.to(device)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def memory_options_line(model_parts: list[nn.Module], plan, optimizer) -> str | None:
    """The start-up line of the memory options ``plan`` (trainer/plan.py ``JobPlan``) chose: what
    CPU offload keeps on the host per rank (:func:`cpu_offload_bytes` of ``optimizer``, a name or
    a per-parameter state-bytes function) and so the range of what it takes off the step's peak
    (the parameters and state at least, the gradients too where the peak comes after the backward
    made them: the planner's phases), and what activation
    offload moves per micro-batch (under full AC the blocks' inputs,
    models/parallel/activation_offload.py ``block_input_bytes``; otherwise what the blocks save
    for backward, the planner's activation model)."""
    from models.parallel.activation_offload import attention_input_bytes, block_input_bytes

    opts, said = plan.parallelize, []
    if opts.cpu_offload:
        b = cpu_offload_bytes(model_parts, optimizer)
        # the step's phases (tools/planner/phases.py): the parameter shards and the state are
        # on the device in every phase, the gradient shards only from the backward on
        said.append(
            f"cpu_offload saves {_mib(b['params'] + b['optimizer'])} to {_mib(b['total'])} of the device's peak per "
            f"rank: it keeps the parameters ({_mib(b['params'])}), gradients ({_mib(b['grads'])}) and optimizer "
            f"state ({_mib(b['optimizer'])}) on the host, and the gradients count where the peak comes after the "
            "backward made them"
        )
    if opts.ac_offload:
        what = "what the blocks save for backward"
        pd = plan.parallel_dims
        if opts.ac_mode == "full" and plan.stages is None:
            n = sum(len(part.blocks()) for part in model_parts)
            size = 2 if opts.param_dtype != "float32" else 4
            args = plan.model.args
            b, seq = plan.batch.local_batch_size, plan.batch.seq_len
            inputs = block_input_bytes(n, b, seq, args.dim, cp=pd.cp, tp=pd.tp, sp=opts.sequence_parallel, a=size)
            rows = tuple(model_parts[0].rope.table.shape[1:])
            inputs += attention_input_bytes(rows, b, seq, cp=pd.cp) * (b if args.document_positions else 1)
            what = f"{_mib(inputs)} (the blocks' inputs and RoPE rows)"
        said.append(f"activation offload saves {what} per micro-batch while they are on the host")
    return "memory: " + "; ".join(said) if said else None
