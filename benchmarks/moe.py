"""MoE expert kernels: forward+backward time of ``GroupedExperts`` against the number of experts
E, at a fixed number of routed rows and fixed expert dims, for

* ``grouped``: the ``torch._grouped_mm`` path (the reference every ratio divides by);
* ``loop``: the per-expert loop, weights ``unbind``-ed once (O(E) backward);
* ``old_loop``: the previous loop, implemented here, which indexed the stacked weights per
  expert (``w1[e]``): autograd then writes a full-size zero gradient per expert, O(E^2).

Routing is uniform at random (seeded) over the experts, so groups are ragged. All paths run in
this process on one intra-op thread (two threads on a shared 2-core machine made single steps
vary 20x), interleaved in rotating order, one warm-up each; the figure per path is the best
of ``REPS`` timed steps (the medians are recorded too), and the ratios divide figures measured
in the same run. The
section also records the largest difference of the loop's and the old loop's outputs and
gradients to the grouped path's: different GEMM calls, equal up to rounding
(``tests/unit/test_moe_kernels.py`` bounds the grouped-vs-loop difference per element).
"""

from __future__ import annotations

import json
import statistics
import sys
import time

ROWS, DIM, HIDDEN = 4096, 256, 128
EXPERTS = (8, 16, 32, 64, 128)
REPS = 5
THREADS = 1
PATHS = ("grouped", "loop", "old_loop")


def _old_loop(experts, x, counts):
    """The loop as it was before (per-expert indexing of the stacked weights)."""
    import torch
    import torch.nn.functional as F

    w1, w2, w3 = experts.w1, experts.w2, experts.w3
    outs = []
    for e, x_e in enumerate(torch.split(x, counts.tolist())):
        h = F.silu(x_e @ w1[e].transpose(0, 1)) * (x_e @ w3[e].transpose(0, 1))
        outs.append(h @ w2[e].transpose(0, 1))
    return torch.cat(outs)


def _step(experts, path, x, counts, grad_out):
    """One timed forward+backward; returns (seconds, [out, x.grad, w1/w2/w3 grads])."""
    experts.zero_grad(set_to_none=True)
    xg = x.detach().requires_grad_()
    start = time.perf_counter()
    if path == "old_loop":
        out = _old_loop(experts, xg, counts)
    else:
        experts.use_grouped_mm = path == "grouped"
        out = experts(xg, counts)
    out.backward(grad_out)
    seconds = time.perf_counter() - start
    return seconds, [out.detach(), xg.grad, experts.w1.grad, experts.w2.grad, experts.w3.grad]


def _measure(num_experts: int) -> dict:
    import torch

    from models.common.experts import GroupedExperts

    g = torch.Generator().manual_seed(num_experts)
    counts = torch.bincount(torch.randint(0, num_experts, (ROWS,), generator=g), minlength=num_experts)
    x = torch.randn(ROWS, DIM, generator=g)
    grad_out = torch.randn(ROWS, DIM, generator=g)
    experts = GroupedExperts(DIM, HIDDEN, num_experts)
    with torch.no_grad():
        for w in experts.parameters():
            w.copy_(torch.randn(w.shape, generator=g) * DIM**-0.5)

    times: dict[str, list[float]] = {p: [] for p in PATHS}
    results = {}
    for rep in range(REPS + 1):  # rep 0 is the warm-up
        order = PATHS[rep % len(PATHS) :] + PATHS[: rep % len(PATHS)]
        for path in order:
            seconds, results[path] = _step(experts, path, x, counts, grad_out)
            if rep > 0:
                times[path].append(seconds)

    best = {p: min(t) for p, t in times.items()}
    loop_diff = max((a - b).abs().max().item() for a, b in zip(results["grouped"], results["loop"]))
    old_diff = max((a - b).abs().max().item() for a, b in zip(results["grouped"], results["old_loop"]))
    return {
        "experts": num_experts,
        "rows": ROWS,
        "min_group": int(counts.min()),
        "max_group": int(counts.max()),
        "seconds": {p: round(best[p], 5) for p in PATHS},
        "seconds_median": {p: round(statistics.median(times[p]), 5) for p in PATHS},
        "old_loop_over_grouped": round(best["old_loop"] / best["grouped"], 3),
        "loop_over_grouped": round(best["loop"] / best["grouped"], 3),
        "old_loop_over_loop": round(best["old_loop"] / best["loop"], 3),
        "max_abs_diff_grouped_vs_loop": loop_diff,
        "max_abs_diff_grouped_vs_old_loop": old_diff,
    }


def run() -> dict:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        rows = [_measure(e) for e in EXPERTS]
    finally:
        torch.set_num_threads(threads)
    for row in rows:
        e = row["experts"]
        s = row["seconds"]
        print(
            f"moe E={e:4d}: grouped {s['grouped']:.4f}s  loop {s['loop']:.4f}s  "
            f"old_loop {s['old_loop']:.4f}s  old/grouped {row['old_loop_over_grouped']:.2f}  "
            f"loop/grouped {row['loop_over_grouped']:.2f}  "
            f"max|grouped - loop|={row['max_abs_diff_grouped_vs_loop']:.1e}",
            file=sys.stderr,
        )
    return {
        "config": {
            "rows": ROWS,
            "dim": DIM,
            "hidden": HIDDEN,
            "dtype": "float32",
            "device": "cpu",
            "threads": THREADS,
            "reps": REPS,
            "statistic": "min",
        },
        "rows": rows,
    }


if __name__ == "__main__":
    print(json.dumps(run(), indent=1))
