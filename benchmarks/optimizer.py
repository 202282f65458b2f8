"""`make bench` section `optimizer`: the optimizer step of Muon against AdamW's, on CPU, for
fsdp=2 and tp=2 (also `python -m benchmarks.run --only optimizer --out bench_results/optimizer.json`).

Each layout runs on 2 forked gloo ranks (one thread each): the llama3 debug model (6 blocks,
dim 256) built and parallelized from the trainer's job plan, random gradients laid out like the
parameters, then ``Optimizers.step()`` timed for AdamW (foreach, the CPU default) and for Muon
(the hidden matrices; AdamW for embedding, head and norms) under each
``optimizer.muon_distribution`` (trainer/optim/muon.py): ``gather`` (every rank all-gathers every
sharded matrix and orthogonalises it) and ``round_robin`` (one owner rank per matrix
orthogonalises it and sends the shards back, trainer/optim/muon_dist.py), all in the same processes,
alternating, median of ``REPS`` after a warm-up step each. ``muon_over_adamw`` is the ratio of
the medians for the default (round-robin); ``round_robin_over_gather`` compares the two schemes.
"""

from __future__ import annotations

import statistics
import sys
import time

REPS = 5
SCHEMES = ("gather", "round_robin")
LAYOUTS = {"fsdp=2": {"dp_shard": 2}, "tp=2": {"dp_shard": 1, "tp": 2}}


def model_with_random_grads(cfg, world_size: int):
    """The config's model built from the trainer's job plan on this rank (the process group of
    ``world_size`` ranks already up), parallelized, initialized, with random gradients laid out
    like the parameters (also benchmarks/first_step.py)."""
    import torch
    from torch.distributed.tensor import DTensor

    from models.parallelize import parallelize_model
    from trainer.plan import plan_job

    plan = plan_job(cfg, world_size, tokenizer_vocab=2048, tokenizer_eos=0)
    plan.parallel_dims.build_mesh("cpu")
    with torch.device("meta"):
        model = plan.model.model_cls(plan.model.args)
    parallelize_model(model, plan.parallel_dims, plan.parallelize)
    model.to_empty(device="cpu")
    model.init_weights(0)
    torch.manual_seed(1)
    for p in model.parameters():
        if isinstance(p, DTensor):
            local = torch.randn(p.to_local().shape)
            p.grad = DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
        else:
            p.grad = torch.randn(p.shape)
    return model


def _worker(rank: int, world_size: int, degrees: dict, reps: int) -> dict:
    import torch.distributed as dist

    from trainer.config import load_config
    from trainer.optim.optimizers import build_optimizer

    argv = ["--config", "llama3.toml", "--training.seq_len", "64", "--training.global_batch_size", "2"]
    argv += ["--training.local_batch_size", "1"] + [f"--parallelism.{k}={v}" for k, v in degrees.items()]
    cfgs = {"AdamW": load_config(argv)}
    for scheme in SCHEMES:
        cfgs[f"Muon_{scheme}"] = load_config(
            [*argv, "--optimizer.name", "Muon", "--optimizer.muon_distribution", scheme]
        )
    model = model_with_random_grads(cfgs["AdamW"], world_size)
    opts = {name: build_optimizer([model], c) for name, c in cfgs.items()}
    times: dict[str, list[float]] = {name: [] for name in opts}
    for opt in opts.values():
        opt.step()  # warm-up: state allocated, round-robin owners planned
    for _ in range(reps):
        for name, opt in opts.items():
            dist.barrier()
            t0 = time.perf_counter()
            opt.step()
            dist.barrier()
            times[name].append(time.perf_counter() - t0)
    return {f"{name}_step_s": statistics.median(t) for name, t in times.items()}


def run(reps: int = REPS) -> dict:
    from tools.forkserver import run_distributed

    rows = []
    for layout, degrees in LAYOUTS.items():
        print(f"optimizer: {layout} (2 ranks, {reps} steps each)", file=sys.stderr)
        per_rank = run_distributed(_worker, 2, degrees, reps, timeout=600)
        r = {k: max(v[k] for v in per_rank) for k in per_rank[0]}  # the slower rank sets the step
        adamw, gather, rr = (r[f"{k}_step_s"] for k in ("AdamW", "Muon_gather", "Muon_round_robin"))
        row = {
            "layout": layout,
            "adamw_step_ms": round(1e3 * adamw, 2),
            "muon_gather_step_ms": round(1e3 * gather, 2),
            "muon_round_robin_step_ms": round(1e3 * rr, 2),
            "muon_over_adamw": round(rr / adamw, 2),
            "round_robin_over_gather": round(rr / gather, 2),
        }
        rows.append(row)
    return {
        "summary": "Optimizer step on CPU, llama3 debugmodel (6 blocks), 2 gloo ranks with one thread each: "
        "Muon (round_robin, the default) over AdamW (foreach), and Muon's two distributions "
        "(optimizer.muon_distribution gather / round_robin) in the same processes.",
        "rows": rows,
        "reps": reps,
    }
