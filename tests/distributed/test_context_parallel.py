"""Context-parallel causal attention must reproduce full causal attention exactly.

Every rank builds the same global q/k/v (same seed), runs the CP core on its load-balanced
shard and compares outputs and q/k/v gradients with ``F.scaled_dot_product_attention`` on the
full tensors. Tolerance is fp32 round-off: CP and the reference sum softmax terms over different
key-block shapes, so results agree to ~1e-7, far below any masking or ordering error (those are
O(1e-1) on random inputs).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from models.common.attention import AttentionCore
from models.common.sequence import (
    load_balanced_positions,
    load_balanced_shard,
    load_balanced_unshard,
)
from models.parallel.context_parallel import (
    ContextParallelAttentionCore,
    apply_context_parallel,
    load_balanced_causal_attention,
    shard_batch_for_cp,
)
from tools.forkserver import run_distributed

ATOL = 5e-6  # fp32; measured max abs error: out 4.8e-7, grads 1.5e-6 (dv), cp=2 and 4

# (global seq, d_qk, d_v, scale): MHA-style d_v == d_qk, MLA-style d_v != d_qk, custom scale.
CONFIGS = [
    (32, 16, 8, None),
    (32, 16, 16, None),
    (64, 16, 8, 0.3),
    (64, 16, 16, 0.125),
]


def _make_inputs(seq: int, d_qk: int, d_v: int, bs: int = 2, heads: int = 4):
    """Tensors laid out as the model makes them: [bs, seq, h, d] transposed to [bs, h, seq, d],
    so q/k/v reaching the core are non-contiguous."""
    g = torch.Generator().manual_seed(1234 + seq + d_v)
    q = torch.randn(bs, seq, heads, d_qk, generator=g)
    k = torch.randn(bs, seq, heads, d_qk, generator=g)
    v = torch.randn(bs, seq, heads, d_v, generator=g)
    w = torch.randn(bs, heads, seq, d_v, generator=g)
    return q, k, v, w


def _reference(q, k, v, w, scale):
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale
    )
    (out * w).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _cp_matches_full(rank: int, world_size: int) -> list[dict]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    core = ContextParallelAttentionCore(mesh)
    report = []
    for seq, d_qk, d_v, scale in CONFIGS:
        q, k, v, w = _make_inputs(seq, d_qk, d_v)
        ref_out, ref_dq, ref_dk, ref_dv = _reference(q, k, v, w, scale)

        def shard(t, dim):
            return shard_batch_for_cp(t, dim, mesh)

        ql, kl, vl = (shard(t, 1).requires_grad_(True) for t in (q, k, v))
        out = core(ql.transpose(1, 2), kl.transpose(1, 2), vl.transpose(1, 2), scale=scale)
        (out * shard(w, 2)).sum().backward()
        report.append(
            {
                "config": (seq, d_qk, d_v, scale),
                "shape": tuple(out.shape),
                "out": (out.detach() - shard(ref_out, 2)).abs().max().item(),
                "dq": (ql.grad - shard(ref_dq, 1)).abs().max().item(),
                "dk": (kl.grad - shard(ref_dk, 1)).abs().max().item(),
                "dv": (vl.grad - shard(ref_dv, 1)).abs().max().item(),
            }
        )
    return report


@pytest.mark.parametrize("world_size", [2, 4])
def test_cp_attention_matches_full_causal_attention(world_size):
    results = run_distributed(_cp_matches_full, world_size)
    worst = 0.0
    for rank, report in enumerate(results):
        for entry in report:
            seq, _, d_v, _ = entry["config"]
            assert entry["shape"] == (2, 4, seq // world_size, d_v)
            for key in ("out", "dq", "dk", "dv"):
                worst = max(worst, entry[key])
                assert entry[key] < ATOL, f"rank {rank} {entry}"
    print(f"cp={world_size}: max abs error {worst:.3e}")


def _bad_inputs(rank: int, world_size: int) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    core = ContextParallelAttentionCore(mesh)
    messages = []
    # Global seq 6 with cp=2 splits into 3 tokens per rank: not 2*cp chunks.
    with pytest.raises(ValueError, match="divisible by 2\\*cp=4") as err:
        core(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8))
    messages.append(str(err.value))
    with pytest.raises(ValueError, match="divisible by 2\\*cp=4") as err:
        shard_batch_for_cp(torch.zeros(2, 6, dtype=torch.long), 1, mesh)
    messages.append(str(err.value))
    with pytest.raises(ValueError, match="head dims differ"):
        core(torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 4), torch.randn(1, 2, 4, 8))
    with pytest.raises(ValueError, match="must agree"):
        core(torch.randn(1, 2, 4, 8), torch.randn(1, 3, 4, 8), torch.randn(1, 3, 4, 8))
    with pytest.raises(ValueError, match="no module with an nn.Module `core`"):
        apply_context_parallel(nn.Linear(2, 2), mesh)
    # The ranks must still be in step: a collective after the errors proves none of them
    # entered the all-gather before raising.
    torch.distributed.barrier()
    return messages


def test_bad_sequence_length_raises_clear_error():
    results = run_distributed(_bad_inputs, 2)
    for messages in results:
        assert all("2*cp" in m for m in messages)


class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.core = AttentionCore()


class _MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.reduce_aux_counts = lambda counts: counts

    def add_aux_count_reduction(self, reduce):  # as MoE's, with nothing added before
        self.reduce_aux_counts = reduce


class _ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_Attention(), _MoE(), _Attention()])


def _apply_cp(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    model = apply_context_parallel(_ToyModel(), mesh)
    counts = torch.full((2, 3), rank + 1)  # int64, as bincount gives
    summed = model.layers[1].reduce_aux_counts(counts)
    tokens = torch.arange(3 * 16).reshape(3, 16)
    local = shard_batch_for_cp(tokens, 1, mesh)
    return {
        "cores": [type(layer.core).__name__ for layer in (model.layers[0], model.layers[2])],
        "cp": (model.cp_rank, model.cp_size),
        "counts": summed.tolist(),
        "counts_unchanged": counts.tolist(),
        "local_ok": torch.equal(local[0], load_balanced_positions(16, rank, world_size)),
        "local": local.tolist(),  # tensors in the result queue die with the child process
    }


def test_apply_context_parallel_wires_model():
    world_size = 2
    results = run_distributed(_apply_cp, world_size)
    total = sum(r + 1 for r in range(world_size))
    for rank, res in enumerate(results):
        assert res["cores"] == ["ContextParallelAttentionCore"] * 2
        assert res["cp"] == (rank, world_size)
        assert res["counts"] == [[total] * 3] * 2
        assert res["counts_unchanged"] == [[rank + 1] * 3] * 2
        assert res["local_ok"]
    tokens = torch.arange(3 * 16).reshape(3, 16)
    local = [torch.tensor(r["local"]) for r in results]
    assert torch.equal(load_balanced_unshard(local, dim=1), tokens)


def _cp1(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("cp",))
    model = apply_context_parallel(_ToyModel(), mesh)
    q, k, v, _ = _make_inputs(10, 16, 8)  # any length works without CP
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    out = model.layers[0].core(q, k, v, scale=0.2)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.2)
    tokens = torch.arange(20).reshape(2, 10)
    return {
        "err": (out - ref).abs().max().item(),
        "cp": (model.cp_rank, model.cp_size),
        "shard_identity": torch.equal(shard_batch_for_cp(tokens, 1, mesh), tokens),
        "moe_untouched": model.layers[1].reduce_aux_counts(torch.ones(2)).tolist() == [1, 1],
    }


def test_cp_size_one_is_plain_causal_attention():
    (res,) = run_distributed(_cp1, 1)
    assert res["err"] == 0.0  # exact: at cp=1 the core makes this very SDPA call
    assert res["cp"] == (0, 1)
    assert res["shard_identity"] and res["moe_untouched"]


# ---- single-process tests (no process group) ----


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_shard_unshard_roundtrip(cp):
    x = torch.randn(2, 24, 3)
    shards = [load_balanced_shard(x, 1, r, cp) for r in range(cp)]
    assert all(s.shape == (2, 24 // cp, 3) for s in shards)
    assert torch.equal(load_balanced_unshard(shards, dim=1), x)


@pytest.mark.parametrize("cp", [2, 4])
def test_local_attention_math_matches_full(cp):
    """The per-rank chunk/mask logic on its own, fed the global K/V directly: isolates the
    masking from the collectives, and is the part that runs unchanged on any device."""
    seq, d_v = 32, 8
    q, k, v, _ = _make_inputs(seq, 16, d_v)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25)
    for r in range(cp):
        out = load_balanced_causal_attention(load_balanced_shard(q, 2, r, cp), k, v, r, cp, 0.25)
        torch.testing.assert_close(out, load_balanced_shard(ref, 2, r, cp), atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="global sequence"):
        load_balanced_causal_attention(q[:, :, :8], k[:, :, :20], v[:, :, :20], 0, cp)


@pytest.mark.parametrize("cp", [2, 4])
def test_each_chunk_attends_only_to_its_key_prefix(cp, monkeypatch):
    """Load balance and no wasted work: rank r's head chunk sees (r+1)c keys and its tail
    chunk (2cp-r)c, so every rank scores (2cp+1)c^2 query-key pairs, none fully masked."""
    import models.parallel.context_parallel as cp_mod

    seen = []
    real_sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        seen.append((q.size(2), k.size(2)))
        return real_sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(cp_mod.F, "scaled_dot_product_attention", spy)
    seq = 32
    c = seq // (2 * cp)
    q, k, v, _ = _make_inputs(seq, 16, 8)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    for r in range(cp):
        seen.clear()
        load_balanced_causal_attention(load_balanced_shard(q, 2, r, cp), k, v, r, cp)
        assert seen == [(c, (r + 1) * c), (c, (2 * cp - r) * c)]
        assert sum(nq * nk for nq, nk in seen) == (2 * cp + 1) * c * c
