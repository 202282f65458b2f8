"""`make bench` section `optimizer`: the optimizer step of Muon against AdamW's, on CPU, for
fsdp=2 and tp=2 (also `python -m benchmarks.run --only optimizer --out bench_results/optimizer.json`).

Each layout runs on 2 forked gloo ranks (one thread each): the llama3 debug model (6 blocks,
dim 256) built and parallelized from the trainer's job plan, random gradients laid out like the
parameters, then ``Optimizers.step()`` timed for AdamW (foreach, the CPU default) and for Muon
(the hidden matrices; AdamW for embedding, head and norms) in the same processes, alternating,
median of ``REPS`` after a warm-up step each. ``muon_over_adamw`` is the ratio of the medians.

Rows ``gather`` and ``round_robin`` (fsdp=2 only) time the two ways to give Newton-Schulz whole
matrices under FSDP, on the same matrices: ``gather`` is what trainer/muon.py does (all-gather
every matrix over the FSDP group, every rank orthogonalises every matrix, keeps its shard);
``round_robin`` assigns matrix i to rank i mod 2, gathers its shards to that rank
(``dist.gather``), orthogonalises there and scatters the shards back (``dist.scatter``): half the
Newton-Schulz FLOPs per rank, two rooted collectives per matrix instead of one all-gather.
"""

from __future__ import annotations

import statistics
import sys
import time

REPS = 5
LAYOUTS = {"fsdp=2": {"dp_shard": 2}, "tp=2": {"dp_shard": 1, "tp": 2}}


def _worker(rank: int, world_size: int, degrees: dict, reps: int) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from models.parallelize import parallelize_model
    from trainer.config import load_config
    from trainer.muon import newton_schulz, orthogonalized_update
    from trainer.optim import build_optimizer
    from trainer.plan import plan_job

    argv = ["--config", "llama3.toml", "--training.seq_len", "64", "--training.global_batch_size", "2"]
    argv += ["--training.local_batch_size", "1"] + [f"--parallelism.{k}={v}" for k, v in degrees.items()]
    cfgs = {name: load_config([*argv, "--optimizer.name", name]) for name in ("AdamW", "Muon")}
    plan = plan_job(cfgs["AdamW"], world_size, tokenizer_vocab=2048, tokenizer_eos=0)
    plan.parallel_dims.build_mesh("cpu")
    with torch.device("meta"):
        model = plan.model.model_cls(plan.model.args)
    parallelize_model(model, plan.parallel_dims, plan.parallelize)
    model.to_empty(device="cpu")
    model.init_weights(0)
    torch.manual_seed(1)
    for p in model.parameters():  # random gradients laid out like the parameters
        if isinstance(p, DTensor):
            local = torch.randn(p.to_local().shape)
            p.grad = DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
        else:
            p.grad = torch.randn(p.shape)
    opts = {name: build_optimizer([model], c) for name, c in cfgs.items()}
    times: dict[str, list[float]] = {name: [] for name in opts}
    for opt in opts.values():
        opt.step()  # warm-up: state allocated
    for _ in range(reps):
        for name, opt in opts.items():
            dist.barrier()
            t0 = time.perf_counter()
            opt.step()
            dist.barrier()
            times[name].append(time.perf_counter() - t0)
    out = {f"{name}_step_s": statistics.median(t) for name, t in times.items()}
    if degrees.get("tp", 1) == 1:  # the two FSDP schemes, on Muon's matrices
        mats = [p for g in opts["Muon"].param_groups if "momentum" in g for p in g["params"]]
        out.update(_schemes(mats, reps, rank, world_size, newton_schulz, orthogonalized_update))
    return out


def _schemes(mats, reps, rank, world_size, newton_schulz, orthogonalized_update) -> dict:
    import torch
    import torch.distributed as dist

    def gather_all():
        for p in mats:
            orthogonalized_update(p, p.grad.to_local(), 5, (3.4445, -4.775, 2.0315))

    def round_robin():
        for i, p in enumerate(mats):
            owner, local = i % world_size, p.grad.to_local()
            rows = -(-p.shape[0] // world_size)  # FSDP's dim-0 chunk, the last one padded
            send = torch.zeros(rows, *p.shape[1:])
            send[: local.shape[0]] = local
            bufs = [torch.empty_like(send) for _ in range(world_size)] if rank == owner else None
            dist.gather(send, bufs, dst=owner)
            pieces = None
            if rank == owner:
                o = newton_schulz(torch.cat(bufs)[: p.shape[0]], 5)
                pieces = [torch.zeros_like(send) for _ in range(world_size)]
                for r, chunk in enumerate(torch.split(o, rows)):
                    pieces[r][: chunk.shape[0]] = chunk
            out = torch.empty_like(send)
            dist.scatter(out, pieces, src=owner)

    res = {}
    for name, fn in (("gather", gather_all), ("round_robin", round_robin)):
        fn()
        ts = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            dist.barrier()
            ts.append(time.perf_counter() - t0)
        res[f"{name}_s"] = statistics.median(ts)
    return res


def run(reps: int = REPS) -> dict:
    from tools.launcher import run_distributed

    rows = []
    for layout, degrees in LAYOUTS.items():
        print(f"optimizer: {layout} (2 ranks, {reps} steps each)", file=sys.stderr)
        per_rank = run_distributed(_worker, 2, degrees, reps, timeout=600)
        r = {k: max(v[k] for v in per_rank) for k in per_rank[0]}  # the slower rank sets the step
        row = {
            "layout": layout,
            "adamw_step_ms": round(1e3 * r["AdamW_step_s"], 2),
            "muon_step_ms": round(1e3 * r["Muon_step_s"], 2),
            "muon_over_adamw": round(r["Muon_step_s"] / r["AdamW_step_s"], 2),
        }
        if "gather_s" in r:
            row["ns_gather_ms"] = round(1e3 * r["gather_s"], 2)
            row["ns_round_robin_ms"] = round(1e3 * r["round_robin_s"], 2)
        rows.append(row)
    return {
        "summary": "Optimizer step on CPU, llama3 debugmodel (6 blocks), 2 gloo ranks with one thread each: "
        "Muon over AdamW (foreach), and under fsdp=2 the orthogonalisation alone by the gather scheme "
        "(trainer/muon.py) against round-robin owners (benchmarks/optimizer.py).",
        "rows": rows,
        "reps": reps,
    }
