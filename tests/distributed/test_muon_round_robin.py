"""Muon's round-robin distribution (trainer/optim/muon_dist.py) against the gather scheme, on real
gloo ranks, through the trainer's optimizer (``build_optimizer`` with ``optimizer.name = "Muon"``
on models parallelized from the trainer's job plan).

For each layout, two Muon steps (the second reads carried momentum) from the same weights and
the same random gradients, once with ``muon_distribution = "gather"`` and once with
``"round_robin"``:

- the updated weights (every rank's local shards, Muon's and AdamW's parameters) are BITWISE
  equal: both schemes run Newton-Schulz on the same whole matrix with the same kernels, so any
  difference is a wrong assembly or a shard sent to the wrong rank (a wrong row order in the
  strided FSDP-over-TP shards, a swapped member);
- each sharded matrix is orthogonalised by exactly one rank of its sharding group: the
  Newton-Schulz calls counted on each rank during the round-robin step (the module's
  ``newton_schulz``, patched) are the matrices its plans say it owns, and the owners of each
  parameter over the ranks of one group are one rank; under gather every rank orthogonalises
  every sharded matrix;
- the owners are balanced: per group the largest rank's Newton-Schulz FLOPs are at most the
  mean plus the largest single matrix's (the longest-processing-time bound).

Negative control: the same comparison with the owner's result sent back to the wrong member
(the group's members rotated by one in round 2) is reported unequal (asserted on fsdp=4).

Layouts (one 4-rank launch): Llama 3 fsdp=4 (groups of 4, matrices fewer per shape than ranks),
tp=2 x fsdp=2 (2-D groups, FSDP's strided shards over TP), dp_replicate=2 x fsdp=2 (two groups),
DeepSeek-V3 fsdp=2 x tp=2 x ep=2 x etp=2 (experts over etp, dense over fsdp x tp).
"""

from __future__ import annotations

import torch

from tests.distributed.parallel_harness import build_layout_model, harness_plan
from tools.forkserver import run_distributed

LAYOUTS = [
    ("llama3", {"dp_shard": 4}),
    ("llama3", {"dp_shard": 2, "tp": 2}),
    ("llama3", {"dp_replicate": 2, "dp_shard": 2}),
    ("deepseek_v3", {"dp_shard": 2, "tp": 2, "ep": 2, "etp": 2}),
]


def _steps(model, grads, distribution, rotate_back=False):
    """Two Muon steps with the given gradients; (local weights after, NS calls, plans)."""
    from unittest import mock

    import trainer.optim.muon as muon
    import trainer.optim.muon_dist as muon_dist
    from trainer.config import load_config
    from trainer.optim.optimizers import build_optimizer

    cfg = load_config(["--optimizer.name", "Muon", "--optimizer.muon_distribution", distribution])
    opt = build_optimizer([model], cfg)
    calls = []
    real_ns, real_exchange = muon.newton_schulz, muon_dist._exchange
    rounds = [0]

    def counting_ns(u, steps, coef):
        calls.append(tuple(u.shape))
        return real_ns(u, steps, coef)

    def rotated_exchange(sends, recv_sizes, device):  # negative control: results to the wrong member
        rounds[0] += 1
        if rounds[0] % 2 == 0 and sends:
            keys = sorted(sends)
            sends = {keys[(i + 1) % len(keys)]: sends[k] for i, k in enumerate(keys)}
        return real_exchange(sends, recv_sizes, device)

    patches = [mock.patch.object(muon, "newton_schulz", counting_ns)]
    if rotate_back:
        patches.append(mock.patch.object(muon_dist, "_exchange", rotated_exchange))
    for step in range(2):
        for p, g in zip(model.parameters(), grads[step]):
            p.grad = g
        if step == 1:
            calls.clear()
            for patch in patches:
                patch.start()
        try:
            opt.step()
        finally:
            if step == 1:
                for patch in patches:
                    patch.stop()
    weights = [p.to_local().clone() if hasattr(p, "to_local") else p.detach().clone() for p in model.parameters()]
    muon_opt = next(o for o in opt.optimizers if isinstance(o, muon.Muon))
    return weights, calls, muon_opt


def _worker(rank, world_size, layouts):
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from trainer.optim.muon_dist import matrix_mesh_dims, ns_flops

    out = []
    for model_name, degrees in layouts:
        plan = harness_plan(model_name, degrees, 4, 32)
        plan.parallel_dims.build_mesh("cpu")
        model = build_layout_model(plan)
        names = [n for n, _ in model.named_parameters()]
        initial = [p.detach().clone() for p in model.parameters()]
        gen = torch.Generator().manual_seed(100 + rank)
        grads = []
        for _ in range(2):
            step = []
            for p in model.parameters():
                if isinstance(p, DTensor):
                    local = torch.randn(p.to_local().shape, generator=gen)
                    step.append(
                        DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
                    )
                else:
                    step.append(torch.randn(p.shape, generator=gen))
            grads.append(step)
        results = {}
        for key, dist_name, rotate in (
            ("gather", "gather", False),
            ("rr", "round_robin", False),
            ("bad", "round_robin", True),
        ):
            with torch.no_grad():
                for p, w in zip(model.parameters(), initial):
                    p.copy_(w)
            if key == "bad" and degrees != {"dp_shard": 4}:
                continue
            results[key] = _steps(model, grads, dist_name, rotate)
        weights = {k: r[0] for k, r in results.items()}
        muon_opt = results["rr"][2]
        sharded = [
            (n, p) for n, p in zip(names, model.parameters()) if isinstance(p, DTensor) and p.ndim >= 2
            and p in muon_opt._round_robin._plans and matrix_mesh_dims(p)
        ]  # fmt: skip
        plans = {n: muon_opt._round_robin._plans[p] for n, p in sharded}
        out.append(
            {
                "layout": f"{model_name} {degrees}",
                "equal": all(torch.equal(a, b) for a, b in zip(weights["gather"], weights["rr"])),
                "bad_equal": (
                    all(torch.equal(a, b) for a, b in zip(weights["gather"], weights["bad"]))
                    if "bad" in weights
                    else None
                ),
                "rr_calls": len(results["rr"][1]),
                "gather_calls": len(results["gather"][1]),
                "owned": sorted(n for n, pl in plans.items() if pl.owned),
                "groups": {n: tuple(pl.members) for n, pl in plans.items()},
                "flops": {n: ns_flops(pl.whole_shape, 5) for n, pl in plans.items()},
                "local_only": sum(1 for p in muon_opt._round_robin._plans) == 0,
                "n_muon": sum(len(g["params"]) for g in muon_opt.param_groups),
            }
        )
        dist.barrier()
    return out


def test_round_robin_is_bitwise_the_gather_scheme_with_one_owner_per_matrix():
    per_rank = run_distributed(_worker, 4, LAYOUTS, timeout=600)
    for i, (_, degrees) in enumerate(LAYOUTS):
        rows = [r[i] for r in per_rank]
        layout = rows[0]["layout"]
        assert all(r["equal"] for r in rows), f"{layout}: round-robin differs from gather"
        n_sharded = len(rows[0]["groups"])
        assert n_sharded > 0, layout
        for rank, r in enumerate(rows):
            # gather: every sharded matrix (and every local one) on every rank; round-robin: the
            # local ones and only the owned sharded ones
            local_ones = r["n_muon"] - len(r["groups"])
            assert r["gather_calls"] == r["n_muon"], (layout, rank, r["gather_calls"], r["n_muon"])
            assert r["rr_calls"] == local_ones + len(r["owned"]), (layout, rank, r)
        # exactly one owner per parameter and group
        owners: dict[tuple, list[int]] = {}
        for rank, r in enumerate(rows):
            for name in r["groups"]:
                owners.setdefault((name, r["groups"][name]), [])
                if name in r["owned"]:
                    owners[(name, r["groups"][name])].append(rank)
        for (name, members), who in owners.items():
            assert len(who) == 1 and who[0] in members, (layout, name, members, who)
        # balance: per group, the busiest member within one matrix of the mean
        groups = {members for _, members in owners}
        for members in groups:
            load = {m: 0 for m in members}
            biggest = 0
            for (name, mem), who in owners.items():
                if mem == members:
                    f = rows[who[0]]["flops"][name]
                    load[who[0]] += f
                    biggest = max(biggest, f)
            mean = sum(load.values()) / len(load)
            assert max(load.values()) <= mean + biggest, (layout, members, load)
        if degrees == {"dp_shard": 4}:
            assert not any(r["bad_equal"] for r in rows), f"{layout}: the negative control went undetected"
