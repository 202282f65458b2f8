"""A job plan (trainer/plan.py) shown to a person: one rank's sharding dry-run on the fake
backend (:func:`dry_run`: what the rank holds, no weights, no communication) and the plan as
text (:func:`format_plan`), which ``python -m parallel_dims --config X.toml`` prints."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from parallel_dims import ParallelDims

if TYPE_CHECKING:
    from trainer.plan import JobPlan

__all__ = ["dry_run", "format_plan"]


def dry_run(plan: JobPlan, rank: int = 0) -> dict[str, Any]:
    """Shard the meta-device model for ``rank`` exactly as training does, on the fake backend
    (one process, no weights, no communication), and count what the rank holds: parameters
    (local shards, FSDP padding included), gradients of the same size and dtype, and AdamW's
    two fp32 states. Initializes and destroys a fake default process group."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from models.parallel.pipeline import split_model
    from parallel_dims.process_groups import register_fake_backend

    if dist.is_initialized():
        raise RuntimeError("dry_run needs a process without a process group")
    register_fake_backend()
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=plan.world_size)
    try:
        pd = ParallelDims(**plan.parallel_dims.degrees.as_dict())
        pd.build_mesh("cpu")
        spec = plan.model
        with torch.device("meta"):
            model = spec.model_cls(spec.args)
        total = sum(p.numel() for p in model.parameters())
        parts = list(split_model(model, plan.stages, pd).modules) if plan.stages is not None else [model]
        local = trainable = param_bytes = 0
        for part in parts:
            spec.parallelize_fn(part, pd, plan.parallelize)
            for param in part.parameters():
                shard = param._local_tensor if isinstance(param, DTensor) else param
                local += shard.numel()
                param_bytes += shard.numel() * shard.element_size()  # masters; bf16 compute copies are transient
                trainable += shard.numel() if param.requires_grad else 0  # LoRA: the adapters only
        grads = 4 * trainable
        return {
            "rank": rank,
            "model_params": total,
            "local_params": local,
            "memory_gib": {
                "params": param_bytes / 2**30,
                "grads": grads / 2**30,
                "optimizer": 2 * grads / 2**30,
                "total": (param_bytes + 3 * grads) / 2**30,
            },
        }
    finally:
        dist.destroy_process_group()


def format_plan(plan: JobPlan, dry: dict[str, Any] | None = None) -> str:
    d = plan.parallel_dims.degrees
    b = plan.batch
    a = plan.model_args
    lines = [
        f"job plan: {plan.config.model.name}/{plan.config.model.flavor} on world_size={plan.world_size}",
        "degrees: " + ", ".join(f"{k}={v}" for k, v in d.as_dict().items() if k != "world_size") + f", efsdp={d.efsdp}",
        f"model: {a.n_layers} layers, dim {a.dim}, {a.n_heads} heads, vocab {a.vocab_size}"
        + (f", {a.num_experts} experts" if a.has_experts else ""),
        f"batch: global {b.global_batch_size} x {b.seq_len} tokens = {b.tokens_per_step:,} per step; "
        f"{b.batch_degree} batch ranks x {b.grad_accum_steps} micro-batch(es) of {b.local_batch_size}",
        f"parallelize: {dataclasses.asdict(plan.parallelize)}",
    ]
    if plan.parallelize.float8 is not None:
        lines.append(f"float8 (torchao, before parallelization): {plan.parallelize.float8.describe()}")
    if plan.parallelize.lora is not None:
        lines.append(f"lora (frozen base, before parallelization): {plan.parallelize.lora.describe()}")
    if plan.stages is not None:
        s = plan.stages
        ranges = ", ".join(f"{lo}-{hi - 1}" for lo, hi in s.layer_ranges)
        lines.append(
            f"pipeline: {s.schedule}, {s.num_stages} stages ({s.stages_per_rank} per rank), "
            f"layers per stage {ranges}, {s.n_microbatches} micro-batches, "
            f"bubble {s.bubble_fraction:.2f}"
        )
    if dry is not None:
        m = dry["memory_gib"]
        lines.append(
            f"rank {dry['rank']}: {dry['local_params']:,} of {dry['model_params']:,} parameters "
            f"({dry['local_params'] / dry['model_params']:.4f}); fp32 training state "
            f"{m['total']:.2f} GiB = params {m['params']:.2f} + grads {m['grads']:.2f} + "
            f"AdamW {m['optimizer']:.2f} (activations not included)"
        )
    return "\n".join(lines)
