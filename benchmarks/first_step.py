"""`make bench` section `first_step`: what DTensor's sharding pricing of AdamW's foreach ops costs
at the first optimizer step, with and without the per-element memo (trainer/optim/foreach_strategy.py),
as the number of blocks grows (also `python -m benchmarks.run --only first_step --out
bench_results/first_step.json`).

One process, rank 0 of a 4-rank tp=2 x fsdp=2 job on torch's fake backend (the parameters laid
out exactly as on 4 real ranks; the optimizer's arithmetic is local and real): the llama3 debug
model (dim 256) with ``N_LAYERS`` blocks built from the trainer's job plan, random gradients laid
out like the parameters, the trainer's AdamW (foreach, the CPU default). Each measurement starts
from empty DTensor caches (and an empty memo) and takes the process's CPU time of the first
``step()`` and of the second (the same work with every cache warm): the difference is the
pricing. The two arms alternate, median of ``REPS``. On a GPU the pricing is the same host work,
paid by every rank at its first step.
"""

from __future__ import annotations

import statistics
import sys
import time

REPS = 3
N_LAYERS = (2, 8, 32)


def _model_and_grads(n_layers: int):
    from benchmarks.optimizer import model_with_random_grads
    from trainer.config import load_config

    argv = ["--config", "llama3.toml", "--training.seq_len", "64", "--training.global_batch_size", "2"]
    argv += ["--training.local_batch_size", "1", "--parallelism.tp", "2", "--model.n_layers", str(n_layers)]
    cfg = load_config(argv)
    return model_with_random_grads(cfg, 4), cfg


def _first_and_second_step(model, cfg, memo: bool) -> tuple[float, float]:
    from tools.planner.measure import forget_sharding_caches
    from trainer.optim import foreach_strategy
    from trainer.optim.optimizers import build_optimizer

    foreach_strategy.uninstall()
    forget_sharding_caches()
    opt = build_optimizer([model], cfg)  # installs the memo
    if not memo:
        foreach_strategy.uninstall()
    times = []
    for _ in range(2):
        t0 = time.process_time()
        opt.step()
        times.append(time.process_time() - t0)
    foreach_strategy.uninstall()
    return times[0], times[1]


def run(reps: int = REPS) -> dict:
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from tools.planner.measure import forget_sharding_caches

    torch.set_num_threads(1)
    rows = []
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        for n_layers in N_LAYERS:
            print(f"first_step: {n_layers} blocks, memo off/on alternating, {reps} each", file=sys.stderr)
            model, cfg = _model_and_grads(n_layers)
            got: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
            for _ in range(reps):
                for memo in (False, True):
                    got[memo].append(_first_and_second_step(model, cfg, memo))
            first = {m: statistics.median(f for f, _ in v) for m, v in got.items()}
            second = {m: statistics.median(s for _, s in v) for m, v in got.items()}
            pricing = {m: max(first[m] - second[m], 0.0) for m in got}
            rows.append(
                {
                    "n_layers": n_layers,
                    "params": sum(1 for _ in model.parameters()),
                    "first_step_cpu_s_without_memo": round(first[False], 3),
                    "first_step_cpu_s_with_memo": round(first[True], 3),
                    "later_step_cpu_s": round(statistics.median([second[False], second[True]]), 3),
                    "pricing_with_over_without": round(pricing[True] / pricing[False], 2) if pricing[False] else None,
                }
            )
            del model
            forget_sharding_caches()
    finally:
        dist.destroy_process_group()
    return {
        "summary": "AdamW's first optimizer step on CPU, rank 0 of a tp=2 x fsdp=2 fake-backend job, llama3 "
        "debugmodel (dim 256) with 2-32 blocks: process CPU seconds of the first step (DTensor prices every "
        "foreach op) without and with the per-element memo, of a later step (every cache warm), and the "
        "ratio of the pricing (first minus later) with the memo to without it.",
        "rows": rows,
        "reps": reps,
    }
