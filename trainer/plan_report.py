"""A job plan (trainer/plan.py) shown to a person: one rank's sharding dry-run on the fake
backend (:func:`dry_run`: what the rank holds, no weights, no communication), the plan as text
(:func:`format_plan`) or as JSON (:func:`plan_info`), and the command that prints them:

    python -m trainer.plan_report --config llama3_70b.toml --world-size 64 [--tp 8 ...] \
        [--rank 9] [--json]

Degree flags (``--tp 8``; one per axis of parallel_dims/axes.py) override the config's
``[parallelism]``. Bad input (a config the plan refuses, a rank outside the world) is one
``error:`` message on stderr and exit code 2. The old spelling
``python -m parallel_dims --config ...`` still works: it prints a note and runs this command.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import TYPE_CHECKING, Any

from parallel_dims import ParallelDims
from parallel_dims.axes import AXES

if TYPE_CHECKING:
    from trainer.plan import JobPlan

__all__ = ["dry_run", "format_plan", "main", "plan_info"]


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


def plan_info(plan: JobPlan, dry: dict[str, Any], config: str | None = None) -> dict[str, Any]:
    """The plan and one rank's dry run as the JSON object ``--json`` prints."""
    d = plan.parallel_dims.degrees
    return {
        "config": config,
        "world_size": plan.world_size,
        "degrees": d.as_dict() | {"efsdp": d.efsdp},
        "model": {"name": plan.config.model.name, "flavor": plan.config.model.flavor,
                  "n_layers": plan.model_args.n_layers, "params": dry["model_params"]},
        "batch": {"global_batch_size": plan.batch.global_batch_size, "local_batch_size": plan.batch.local_batch_size,
                  "batch_degree": plan.batch.batch_degree, "grad_accum_steps": plan.batch.grad_accum_steps,
                  "seq_len": plan.batch.seq_len},
        "pipeline": None if plan.stages is None else {
            "schedule": plan.stages.schedule, "num_stages": plan.stages.num_stages,
            "layer_ranges": [list(r) for r in plan.stages.layer_ranges],
            "n_microbatches": plan.stages.n_microbatches, "bubble_fraction": plan.stages.bubble_fraction,
        },
        "rank": dry["rank"],
        "local_params": dry["local_params"],
        "memory_gib": dry["memory_gib"],
    }  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m trainer.plan_report",
        description="Print a training config's job plan for a world size (degrees, model, batch, pipeline "
        "stages) and one rank's parameters and training-state memory, from a dry run on the fake backend "
        "(no GPU, no weights).",
    )
    p.add_argument("--config", required=True, help="a training config, e.g. llama3_70b.toml")
    p.add_argument("--world-size", type=int, required=True)
    for axis in AXES:
        p.add_argument(axis.cli_flag, type=int, default=None, help=f"{axis.help} (overrides the config's)")
    p.add_argument("--rank", type=int, default=0, help="the rank whose share is counted (default 0)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    return p


def report(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """The job plan of ``args.config`` on ``args.world_size`` and rank ``args.rank``'s dry run:
    (:func:`plan_info`, :func:`format_plan`). Bad input raises a ValueError."""
    from trainer.config import load_config
    from trainer.plan import plan_job

    overrides = [
        arg
        for axis in AXES
        if getattr(args, axis.name) is not None
        for arg in (f"--parallelism.{axis.name}", str(getattr(args, axis.name)))
    ]
    plan = plan_job(load_config(["--config", args.config, *overrides]), args.world_size)
    if not 0 <= args.rank < args.world_size:
        raise ValueError(f"--rank {args.rank} is outside world_size={args.world_size}")
    dry = dry_run(plan, args.rank)
    return plan_info(plan, dry, args.config), format_plan(plan, dry)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        info, text = report(args)
    except ValueError as exc:  # ConfigError included: the message names the fix
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(info, indent=1) if args.json else text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
