"""bf16 optimizer state on sharded parameters (trainer/optim/low_precision.py): the stochastic
rounding bits are a hash of each element's index in the WHOLE tensor, so an optimizer over
DTensor shards stores bitwise the moments (and makes bitwise the weights) of the same optimizer
over the whole tensor in one process: AdamW and Muon on 2 gloo ranks, Shard(0) with an uneven
split (25 rows) and Shard(1) (TP's column split), 4 steps.

Negative control: hashing each rank's local index instead (the easy wrong version) stores other
moments: the comparison sees it (measured: 24.6% of the moment elements differ, all on rank 1's
rows, whose local indices are not their global ones; the test asks for > 10%)."""

from __future__ import annotations

import pytest
import torch

from tools.forkserver import run_distributed

pytestmark = pytest.mark.distributed

STEPS = 4


def _run(sharded: bool, placement, kind: str, mesh) -> tuple[torch.Tensor, torch.Tensor]:
    import torch.nn as nn
    from torch.distributed.tensor import distribute_tensor

    from trainer.optim.low_precision import AdamWLowPrecision
    from trainer.optim.muon import Muon

    gen = torch.Generator().manual_seed(0)
    w0 = torch.randn(25, 20, generator=gen)
    grads = [torch.randn(25, 20, generator=gen) for _ in range(STEPS)]
    place = (lambda t: distribute_tensor(t, mesh, [placement])) if sharded else (lambda t: t)
    p = nn.Parameter(place(w0))
    if kind == "AdamW":
        opt = AdamWLowPrecision([p], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
        key = "exp_avg_sq"
    else:
        opt = Muon([p], lr=1e-2, weight_decay=0.1, state_dtype=torch.bfloat16)
        key = "momentum_buffer"
    for g in grads:
        p.grad = place(g)
        opt.step()
    full = (lambda t: t.full_tensor()) if sharded else (lambda t: t)
    return full(p.detach()), full(opt.state[p][key])


def _local_index(p):
    from torch.distributed.tensor import DTensor

    local = p.to_local() if isinstance(p, DTensor) else p
    return torch.arange(local.numel()).view(local.shape)


def _all(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    import trainer.optim.low_precision as lp

    mesh = init_device_mesh("cpu", (world_size,))
    out = {}
    for kind in ("AdamW", "Muon"):
        for dim in (0, 1):
            ref = _run(False, None, kind, mesh)
            got = _run(True, Shard(dim), kind, mesh)
            out[(kind, dim)] = [torch.equal(a, b) for a, b in zip(ref, got)] + [ref[1].dtype, got[1].dtype]
    real = lp.global_index
    lp.global_index = _local_index  # the control: rank-local indices
    try:
        ref, got = _run(False, None, "AdamW", mesh), _run(True, Shard(0), "AdamW", mesh)
    finally:
        lp.global_index = real
    out["control"] = (ref[1] != got[1]).double().mean().item()
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_all, 2)


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("kind", ["AdamW", "Muon"])
def test_sharded_bf16_state_is_bitwise_the_whole_tensors(results, kind, dim):
    for r in results:
        weights_equal, state_equal, ref_dtype, got_dtype = r[(kind, dim)]
        assert ref_dtype == got_dtype == torch.bfloat16
        assert weights_equal and state_equal, r[(kind, dim)]


def test_negative_control_rank_local_rounding_bits_differ(results):
    for r in results:
        assert r["control"] > 0.1, r["control"]
