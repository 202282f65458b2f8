"""Single-process tests of the Llama 3 and DeepSeek-V3 models, their shared pieces and the
registry. Everything runs on CPU in a few seconds; large flavors are only built on meta."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from models.common.args import DecoderArgs
from models.common.attention import AttentionCore
from models.common.decoder import Decoder, DecoderAttention, DecoderBlock, moe_layers
from models.common.experts import GroupedExperts
from models.common.gqa import GroupedQueryAttention as GQAttention
from models.common.init import ParamInit, full_init_tensor, init_parameters, param_seed
from models.common.moe import MoE, TokenChoiceRouter
from models.common.norms import RMSNorm
from models.common.rope import (
    Llama3RopeScaling,
    RotaryEmbedding,
    YarnRopeScaling,
    apply_rotary_emb,
    compute_rope_table,
)
from models.common.sequence import load_balanced_positions, load_balanced_shard
from models.deepseek_v3 import DeepSeekV3Args, deepseek_v3_flavors
from models.deepseek_v3.model import Attention as MLAttention
from models.llama3 import Llama3Args, llama3_flavors
from models.registry import build_model, get_model_spec

MODELS = ["llama3", "deepseek_v3"]


def _built(name: str, seed: int = 0, **overrides) -> nn.Module:
    model = build_model(name, "debugmodel", device="cpu", **overrides)
    model.init_weights(seed)
    return model


def _tokens(bs: int = 2, s: int = 64, vocab: int = 2048, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (bs, s), generator=torch.Generator().manual_seed(seed))


def _moe_args(**overrides) -> DeepSeekV3Args:
    base = dataclasses.replace(deepseek_v3_flavors["debugmodel"], dim=32, moe_inter_dim=16, n_shared_experts=1)
    return dataclasses.replace(base, **overrides)


# --------------------------------------------------------------------------------------------
# Shapes, sizes, pipeline conventions


@pytest.mark.parametrize("name", MODELS)
def test_forward_shapes_debug(name):
    model = _built(name)
    logits = model(_tokens())
    assert logits.shape == (2, 64, 2048)
    assert torch.isfinite(logits).all()
    # Fresh init: predictions are near uniform, so the loss is close to ln(vocab).
    loss = F.cross_entropy(logits.flatten(0, 1), _tokens().flatten())
    assert abs(loss.item() - math.log(2048)) < 1.5


def test_param_counts_large_flavors_on_meta():
    llama = build_model("llama3", "8B")
    n_llama = sum(p.numel() for p in llama.parameters())
    assert all(p.is_meta for p in llama.parameters())
    assert 8.00e9 < n_llama < 8.06e9, n_llama
    ds = build_model("deepseek_v3", "671B")
    n_ds = sum(p.numel() for p in ds.parameters())
    assert 668e9 < n_ds < 674e9, n_ds
    # 3 dense layers then MoE; 256 experts of width 2048.
    assert not ds.layers["2"].moe_enabled and ds.layers["3"].moe_enabled
    assert tuple(ds.layers["3"].moe.experts.w1.shape) == (256, 2048, 7168)
    assert hasattr(ds.layers["3"], "moe") and not hasattr(ds.layers["3"], "feed_forward")
    assert hasattr(ds.layers["0"], "feed_forward") and not hasattr(ds.layers["0"], "moe")


@pytest.mark.parametrize("name", MODELS)
def test_pipeline_stages_compose_to_full_model(name):
    model = _built(name, n_layers=4)
    tokens = _tokens(s=32)
    with torch.no_grad():
        full = model(tokens)
        first = copy.deepcopy(model)
        for key in ("2", "3"):
            del first.layers[key]
        first.norm = None
        first.output = None
        second = copy.deepcopy(model)
        for key in ("0", "1"):
            del second.layers[key]
        second.tok_embeddings = None
        hidden = first(tokens)
        assert hidden.shape == (2, 32, model.args.dim)
        torch.testing.assert_close(second(hidden), full, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="hidden states"):
        second(tokens)


@pytest.mark.parametrize("name", MODELS)
def test_sequence_longer_than_max_seq_len_is_rejected(name):
    model = _built(name, n_layers=1, max_seq_len=16)
    with pytest.raises(ValueError, match="max_seq_len=16"):
        model(_tokens(s=32))


# --------------------------------------------------------------------------------------------
# Initialization


@pytest.mark.parametrize("name", MODELS)
def test_meta_init_matches_cpu_init_and_seeds_differ(name):
    cpu = _built(name, seed=7, n_layers=3)
    meta = build_model(name, "debugmodel", device="meta", n_layers=3)
    meta.to_empty(device="cpu")
    meta.init_weights(7)
    sd_cpu, sd_meta = cpu.state_dict(), meta.state_dict()
    assert sd_cpu.keys() == sd_meta.keys()
    for key in sd_cpu:
        assert torch.equal(sd_cpu[key], sd_meta[key]), key
    assert torch.equal(cpu.rope.table, meta.rope.table)
    tokens = _tokens(s=16)
    torch.testing.assert_close(cpu(tokens), meta(tokens), rtol=0, atol=0)

    other = _built(name, seed=8, n_layers=3)
    for key, value in other.state_dict().items():
        if key.endswith("norm.weight") or key.endswith("expert_bias"):
            continue  # constants
        assert not torch.equal(value, sd_cpu[key]), key


@pytest.mark.parametrize("name", MODELS)
def test_init_independent_of_layer_deletion(name):
    full = _built(name, seed=3)
    stage = build_model(name, "debugmodel", device="meta")
    for key in ("3", "4", "5"):
        del stage.layers[key]
    stage.norm = None
    stage.output = None
    stage.to_empty(device="cpu")
    stage.init_weights(3)
    full_sd = full.state_dict()
    for key, value in stage.state_dict().items():
        assert torch.equal(value, full_sd[key]), key


def test_init_distributions():
    model = _built("llama3", n_layers=4)
    out_std = 0.02 / math.sqrt(2 * 4)
    for key, expected in [
        ("layers.0.attention.wq.weight", 0.02),
        ("layers.0.attention.wo.weight", out_std),
        ("layers.3.feed_forward.w2.weight", out_std),
        ("tok_embeddings.weight", 1.0),
        ("output.weight", 256**-0.5),
    ]:
        p = model.get_parameter(key)
        # A normal truncated at 3 std has std 0.986 * std.
        assert abs(p.std().item() / (0.986 * expected) - 1) < 0.05, key
        assert p.abs().max().item() <= 3 * expected + 1e-7, key
    assert torch.equal(model.layers["1"].ffn_norm.weight, torch.ones(256))
    # Same shape, different names -> independent draws.
    attn0, attn1 = model.layers["0"].attention, model.layers["1"].attention
    assert not torch.equal(attn0.wq.weight, attn1.wq.weight)
    assert not torch.equal(attn0.wk.weight, attn0.wv.weight)
    ds = _built("deepseek_v3", n_layers=2)
    assert abs(ds.layers["1"].moe.experts.w2.std().item() / (0.986 * 0.01) - 1) < 0.05
    assert torch.equal(ds.layers["1"].moe.expert_bias, torch.zeros(8))


def test_init_fqn_seed_is_stable_and_ignores_wrappers():
    # Pinned value: must not change between processes, ranks or versions (no Python hash()).
    assert param_seed(0, "layers.0.attention.wq.weight") == 5392389204723877286
    assert param_seed(0, "a") != param_seed(1, "a") != param_seed(0, "b")

    class Wrapper(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self._checkpoint_wrapped_module = inner

    plain = nn.Sequential(nn.Linear(4, 4, bias=False))
    wrapped = nn.Sequential(Wrapper(nn.Linear(4, 4, bias=False)))
    rule = lambda fqn, module, name: ParamInit.normal(0.02)  # noqa: E731
    init_parameters(plain, 5, rule)
    init_parameters(wrapped, 5, rule)
    assert torch.equal(plain[0].weight, wrapped[0]._checkpoint_wrapped_module.weight)


def test_init_rejects_meta_parameters():
    model = build_model("llama3", "debugmodel", device="meta", n_layers=1)
    with pytest.raises(ValueError, match="to_empty"):
        model.init_weights(0)


def test_init_writes_local_shard_of_dtensor():
    dist = pytest.importorskip("torch.distributed")
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=1, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        module = nn.Module()
        module.sharded = nn.Parameter(distribute_tensor(torch.zeros(6, 4), mesh, [Shard(0)], src_data_rank=None))
        module.replicated = nn.Parameter(distribute_tensor(torch.zeros(5, 3), mesh, [Replicate()], src_data_rank=None))
        init_parameters(module, 11, lambda fqn, m, name: ParamInit.normal(0.02))
        full_sharded = full_init_tensor(ParamInit.normal(0.02), (6, 4), 11, "sharded")
        full_replicated = full_init_tensor(ParamInit.normal(0.02), (5, 3), 11, "replicated")
        assert torch.equal(module.sharded.to_local(), full_sharded[3:])  # rank 1's half
        assert torch.equal(module.replicated.to_local(), full_replicated)
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# RoPE


def _reference_inv_freq_llama(dim: int, theta: float) -> list[float]:
    s = Llama3RopeScaling()
    out = []
    for i in range(0, dim, 2):
        f = 1.0 / theta ** (i / dim)
        wavelen = 2 * math.pi / f
        if wavelen < s.original_max_position_embeddings / s.high_freq_factor:
            out.append(f)
        elif wavelen > s.original_max_position_embeddings / s.low_freq_factor:
            out.append(f / s.scale_factor)
        else:
            smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
                s.high_freq_factor - s.low_freq_factor
            )
            out.append((1 - smooth) * f / s.scale_factor + smooth * f)
    return out


def _reference_inv_freq_yarn(dim, theta, factor, orig, beta_fast, beta_slow) -> list[float]:
    def corr(rot):
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(theta))

    low, high = max(math.floor(corr(beta_fast)), 0), min(math.ceil(corr(beta_slow)), dim - 1)
    out = []
    for j in range(dim // 2):
        f = 1.0 / theta ** (2 * j / dim)
        ramp = min(max((j - low) / (high - low), 0.0), 1.0)
        smooth = 1 - ramp
        out.append(f / factor * (1 - smooth) + f * smooth)
    return out


@pytest.mark.parametrize("kind", ["plain", "llama3", "yarn", "yarn_inactive"])
def test_rope_tables_match_reference_formulas(kind):
    dim, theta, max_len = 64, 500000.0, 64
    if kind == "plain":
        scaling, ref = None, [1.0 / theta ** (i / dim) for i in range(0, dim, 2)]
    elif kind == "llama3":
        scaling, ref = Llama3RopeScaling(), _reference_inv_freq_llama(dim, theta)
    else:
        theta = 10000.0
        orig = 32 if kind == "yarn" else 4096
        scaling = YarnRopeScaling(factor=40.0, original_seq_len=orig, beta_fast=32, beta_slow=1)
        ref = (
            _reference_inv_freq_yarn(dim, theta, 40.0, orig, 32, 1)
            if kind == "yarn"
            else [1.0 / theta ** (i / dim) for i in range(0, dim, 2)]
        )
    table = compute_rope_table(dim, max_len, theta, scaling)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float64), torch.tensor(ref, dtype=torch.float64))
    torch.testing.assert_close(table[..., 0], angles.cos().float(), rtol=0, atol=1e-6)
    torch.testing.assert_close(table[..., 1], angles.sin().float(), rtol=0, atol=1e-6)
    if kind in ("llama3", "yarn"):  # the scaling actually changed something
        plain = compute_rope_table(dim, max_len, theta, None)
        assert not torch.allclose(table, plain)


def test_rope_matches_complex_rotation_and_positions_index_rows():
    rope = RotaryEmbedding(16, 64, 10000.0)
    x = torch.randn(2, 10, 3, 16)
    positions = torch.tensor([5, 6, 7, 8, 9, 50, 51, 52, 53, 54])
    rotated = apply_rotary_emb(x, rope(positions))
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, 16, 2).double() / 16)
    angles = torch.outer(positions.double(), inv_freq)
    cis = torch.polar(torch.ones_like(angles), angles).to(torch.complex64)
    ref = torch.view_as_complex(x.view(2, 10, 3, 8, 2)) * cis[None, :, None]
    ref = torch.view_as_real(ref).flatten(-2)
    torch.testing.assert_close(rotated, ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="RoPE rows"):
        apply_rotary_emb(x, rope(positions[:4]))


@pytest.mark.parametrize("cp_rank", [0, 1])
def test_rope_with_load_balanced_positions_matches_full_sequence(cp_rank):
    rope = RotaryEmbedding(16, 64, 500000.0, Llama3RopeScaling())
    x_full = torch.randn(2, 32, 4, 16)
    full = apply_rotary_emb(x_full, rope(torch.arange(32)))
    positions = load_balanced_positions(32, cp_rank, 2)
    local = apply_rotary_emb(load_balanced_shard(x_full, 1, cp_rank, 2), rope(positions))
    # exact: one elementwise complex multiply of the same values; both calls' innermost loop is
    # the same d/2 contiguous pairs, so every element takes the same (vector or scalar) code
    torch.testing.assert_close(local, load_balanced_shard(full, 1, cp_rank, 2), rtol=0, atol=0)


class _RecordingCore(AttentionCore):
    def forward(self, q, k, v, mask=None, scale=None):
        self.q, self.k = q.detach(), k.detach()
        return super().forward(q, k, v, mask, scale)


@pytest.mark.parametrize("name", MODELS)
def test_context_parallel_positions_give_same_rotated_qk_as_full_model(name):
    """Layer 0's q/k only depend on each token and its position, so a CP rank fed its
    load-balanced tokens must produce exactly the full model's q/k at those positions."""
    model = _built(name, n_layers=1)
    core = _RecordingCore()
    model.layers["0"].attention.core = core
    tokens = _tokens(s=32)
    with torch.no_grad():
        model(tokens)
        full_q, full_k = core.q, core.k
        model.cp_size = 2
        for rank in range(2):
            model.cp_rank = rank
            model(load_balanced_shard(tokens, 1, rank, 2))
            for got, full in ((core.q, full_q), (core.k, full_k)):
                expected = load_balanced_shard(full, 2, rank, 2)
                torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    model.cp_rank = 2
    with pytest.raises(ValueError, match="cp_rank"):
        model(tokens)


# --------------------------------------------------------------------------------------------
# Attention


def _naive_causal_attention(q, k, v, scale):
    # q, k, v: [bs, s, h, d]
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    s = q.shape[1]
    mask = torch.ones(s, s, dtype=torch.bool).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)


def test_gqa_attention_matches_naive_reference():
    args = Llama3Args(dim=64, n_layers=1, n_heads=8, n_kv_heads=2, vocab_size=16, max_seq_len=32)
    attn = GQAttention(args)
    rope_module = RotaryEmbedding(args.head_dim, 32, args.rope_theta, Llama3RopeScaling())
    x = torch.randn(2, 12, 64)
    rope = rope_module(torch.arange(12))
    out = attn(x, rope)

    hd = args.head_dim
    q = apply_rotary_emb((x @ attn.wq.weight.T).view(2, 12, 8, hd), rope)
    k = apply_rotary_emb((x @ attn.wk.weight.T).view(2, 12, 2, hd), rope)
    v = (x @ attn.wv.weight.T).view(2, 12, 2, hd)
    group = torch.arange(8) // 4  # query head h reads kv head h // n_rep
    ref = _naive_causal_attention(q, k[:, :, group], v[:, :, group], hd**-0.5)
    ref = ref.reshape(2, 12, 64) @ attn.wo.weight.T
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_gqa_attention_reads_local_heads_from_shapes():
    """Simulate a TP rank holding half of the heads: shard wq/wk/wv by rows and wo by
    columns; the module must work unchanged and produce its partial sum of the output."""
    args = Llama3Args(dim=64, n_layers=1, n_heads=8, n_kv_heads=2, vocab_size=16, max_seq_len=32)
    attn = GQAttention(args)
    x = torch.randn(1, 6, 64)
    rope = RotaryEmbedding(args.head_dim, 32, args.rope_theta)(torch.arange(6))
    full = attn(x, rope)
    partial = torch.zeros_like(full)
    hd = args.head_dim
    for rank in range(2):
        shard = copy.deepcopy(attn)
        q_rows = slice(rank * 4 * hd, (rank + 1) * 4 * hd)
        kv_rows = slice(rank * hd, (rank + 1) * hd)
        shard.wq.weight = nn.Parameter(attn.wq.weight[q_rows].clone())
        shard.wk.weight = nn.Parameter(attn.wk.weight[kv_rows].clone())
        shard.wv.weight = nn.Parameter(attn.wv.weight[kv_rows].clone())
        shard.wo.weight = nn.Parameter(attn.wo.weight[:, q_rows].clone())
        partial += shard(x, rope)
    torch.testing.assert_close(partial, full, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("q_lora_rank", [0, 24])
def test_mla_attention_matches_naive_reference(q_lora_rank):
    args = dataclasses.replace(
        deepseek_v3_flavors["debugmodel"], dim=48, n_heads=4, q_lora_rank=q_lora_rank,
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, max_seq_len=32,
    )  # fmt: skip
    attn = MLAttention(args)
    assert (hasattr(attn, "wq") and not hasattr(attn, "wq_a")) == (q_lora_rank == 0)
    x = torch.randn(2, 10, 48)
    rope = RotaryEmbedding(4, 32, args.rope_theta)(torch.arange(10))
    out = attn(x, rope)

    q = attn.wq(x) if q_lora_rank == 0 else attn.wq_b(attn.q_norm(attn.wq_a(x)))
    q = q.view(2, 10, 4, 12)
    q = torch.cat([q[..., :8], apply_rotary_emb(q[..., 8:], rope)], -1)
    kv_a = attn.wkv_a(x)
    k_pe = apply_rotary_emb(kv_a[..., 16:].unsqueeze(2), rope)
    kv = attn.wkv_b(attn.kv_norm(kv_a[..., :16])).view(2, 10, 4, 14)
    k = torch.cat([kv[..., :8], k_pe.expand(2, 10, 4, 4)], -1)
    ref = _naive_causal_attention(q, k, kv[..., 8:], 12**-0.5).reshape(2, 10, 24) @ attn.wo.weight.T
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_mla_softmax_scale_uses_yarn_mscale_only_for_extended_context():
    short = MLAttention(deepseek_v3_flavors["debugmodel"])
    assert short.softmax_scale == pytest.approx(48**-0.5)
    big = get_model_spec("deepseek_v3", "671B").args
    assert big.max_seq_len > big.original_seq_len
    with torch.device("meta"):
        attn = MLAttention(big)
    m = 0.1 * 1.0 * math.log(40.0) + 1.0
    assert attn.softmax_scale == pytest.approx(192**-0.5 * m * m)


# --------------------------------------------------------------------------------------------
# MoE


def _naive_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Per-token loop over the router's choices (the dispatch under test is bypassed)."""
    bs, s, dim = x.shape
    flat = x.reshape(-1, dim)
    weights, selected, _ = moe.router(flat, moe.expert_bias)
    w1, w2, w3 = moe.experts.w1, moe.experts.w2, moe.experts.w3
    rows = []
    for t in range(flat.shape[0]):
        acc = moe.shared_experts(flat[t : t + 1])[0] if moe.shared_experts is not None else 0
        for j in range(selected.shape[1]):
            e = int(selected[t, j])
            h = F.silu(w1[e] @ flat[t]) * (w3[e] @ flat[t])
            acc = acc + weights[t, j] * (w2[e] @ h)
        rows.append(acc)
    return torch.stack(rows).view(bs, s, dim)


@pytest.mark.parametrize("use_grouped_mm", [False, None])
@pytest.mark.parametrize("score_func", ["sigmoid", "softmax"])
def test_moe_dispatch_matches_per_token_loop(use_grouped_mm, score_func):
    torch.manual_seed(0)
    moe = MoE(_moe_args(score_func=score_func, route_scale=2.5), use_grouped_mm=use_grouped_mm)
    with torch.no_grad():
        moe.expert_bias.copy_(torch.randn(8) * 0.1)
    x = torch.randn(2, 6, 32, requires_grad=True)
    out = moe(x)
    grad = torch.randn_like(out)
    params = [
        moe.router.gate.weight,
        moe.experts.w1,
        moe.experts.w2,
        moe.experts.w3,
        moe.shared_experts.w1.weight,
    ]
    got = torch.autograd.grad(out, [x, *params], grad)
    ref_out = _naive_moe(moe, x)
    ref = torch.autograd.grad(ref_out, [x, *params], grad)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert moe.tokens_per_expert.sum().item() == 2 * 6 * 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_experts_grouped_mm_equals_loop_with_empty_experts_and_padding(dtype):
    torch.manual_seed(0)
    experts = GroupedExperts(dim=16, hidden_dim=8, num_experts=4).to(dtype)
    counts = torch.tensor([3, 0, 5, 0])
    x = torch.randn(10, 16, dtype=dtype)  # 2 trailing padding rows
    results = []
    for mode in (True, False):
        experts.use_grouped_mm = mode
        xg = x.clone().requires_grad_()
        out = experts(xg, counts)
        out.sum().backward()  # stride-0 gradient: grouped_mm's backward needs _DenseGrad
        results.append((out.detach(), xg.grad, experts.w1.grad, experts.w2.grad))
        experts.zero_grad(set_to_none=True)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for a, b in zip(*results):
        torch.testing.assert_close(a.float(), b.float(), **tol)
    out = results[1][0]
    assert torch.equal(out[8:], torch.zeros(2, 16, dtype=dtype))
    # Expert 1 got no tokens: zero (not missing) gradient.
    assert torch.equal(results[1][2][1], torch.zeros(8, 16, dtype=dtype))
    x0, w1, w2, w3 = (t.float() for t in (x[:3], experts.w1[0], experts.w2[0], experts.w3[0]))
    ref0 = (F.silu(x0 @ w1.T) * (x0 @ w3.T)) @ w2.T
    torch.testing.assert_close(out[:3].float(), ref0, **tol)
    with pytest.raises(ValueError, match="local expert"):
        experts(x, torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="rows"):
        experts(x, torch.tensor([5, 5, 5, 0]))


def test_grouped_experts_with_no_tokens_still_gives_weight_grads():
    experts = GroupedExperts(dim=8, hidden_dim=4, num_experts=2)
    x = torch.randn(0, 8, requires_grad=True)
    out = experts(x, torch.tensor([0, 0]))
    assert out.shape == (0, 8)
    (out.sum() + 0.0).backward()
    assert experts.w1.grad is not None and torch.equal(experts.w1.grad, torch.zeros(2, 4, 8))


def test_router_bias_changes_selection_not_weights():
    torch.manual_seed(0)
    router = TokenChoiceRouter(16, 8, top_k=2, route_norm=True, route_scale=1.5)
    x = torch.randn(20, 16)
    _, sel0, scores = router(x)
    bias = torch.zeros(8)
    bias[5] = 10.0
    w1, sel1, _ = router(x, bias)
    assert (sel1 == 5).any(dim=1).all()
    assert not (sel0 == 5).any(dim=1).all()
    expected = scores.gather(1, sel1)
    expected = expected / expected.sum(-1, keepdim=True) * 1.5
    torch.testing.assert_close(w1, expected)
    bias[5] = 100.0
    w2, sel2, _ = router(x, bias)
    assert torch.equal(sel1, sel2)
    torch.testing.assert_close(w1, w2)


@pytest.mark.parametrize("score_func", ["sigmoid", "softmax"])
def test_grouped_routing_keeps_only_the_best_groups(score_func):
    torch.manual_seed(0)
    router = TokenChoiceRouter(16, 8, top_k=2, num_groups=4, num_limited_groups=1, score_func=score_func)
    x = torch.randn(50, 16)
    _, selected, scores = router(x)
    groups = selected // 2
    assert torch.equal(groups[:, 0], groups[:, 1])  # one kept group -> both picks inside it
    per_group = scores.view(50, 4, 2)
    # the router's group scores are these very floats (its top-2 sum adds the same two terms,
    # and a + b == b + a in floating point), so the kept group is their argmax
    best = per_group.sum(-1) if score_func == "sigmoid" else per_group.amax(-1)
    assert torch.equal(groups[:, 0], best.argmax(-1))
    # Without the group limit some tokens would have crossed groups.
    free = TokenChoiceRouter(16, 8, top_k=2, score_func=score_func)
    free.gate.weight = router.gate.weight
    _, free_sel, _ = free(x)
    assert ((free_sel[:, 0] // 2) != (free_sel[:, 1] // 2)).any()


def test_update_expert_bias_moves_toward_balance():
    moe = MoE(_moe_args(load_balance_coeff=0.05))
    counts = torch.tensor([40.0, 10.0, 10.0, 10.0, 10.0, 10.0, 5.0, 35.0])
    moe.tokens_per_expert.fill_(3.0)
    moe.update_expert_bias(counts)
    bias = moe.expert_bias
    assert bias[0] < 0 and bias[7] < 0 and bias[6] > 0
    assert abs(bias.sum().item()) < 1e-6
    assert torch.equal(moe.tokens_per_expert, torch.zeros(8))
    with pytest.raises(ValueError, match="one count per routed expert"):
        moe.update_expert_bias(torch.ones(4))

    # Closed loop: a gate skewed toward expert 0 becomes balanced by the bias alone.
    torch.manual_seed(0)
    moe = MoE(_moe_args(load_balance_coeff=0.02, n_expert_groups=1, n_limited_groups=1))
    with torch.no_grad():
        moe.router.gate.weight[0] += 0.2
    x = torch.randn(1, 256, 32) + 1.0  # positive inputs: expert 0's logit is consistently high

    def imbalance() -> float:
        with torch.no_grad():
            moe(x)
        load = moe.tokens_per_expert.clone()
        moe.update_expert_bias(load)
        return (load.max() / load.mean()).item()

    before = imbalance()
    for _ in range(30):
        after = imbalance()
    assert before > 3.0 and after < 1.5, (before, after)


def _reference_aux_loss(scores, selected, coeff, e, k):
    total = 0.0
    for b in range(scores.shape[0]):
        t = scores.shape[1]
        counts = torch.bincount(selected[b].reshape(-1), minlength=e).float()
        f = e / (k * t) * counts
        p = (scores[b] / scores[b].sum(-1, keepdim=True)).mean(0)
        total = total + (f * p).sum()
    return coeff * total


def test_sequence_aux_loss_and_context_parallel_count_hook():
    """The aux loss a forward reports (``aux_loss_total``) is DeepSeek's formula, its gradient
    (given by ``_AuxLossGrad`` in the backward through the output) is that formula's gradient
    divided by ``aux_loss_sequences``, and the CP count hook makes per-rank halves add up to the
    whole-sequence loss."""
    torch.manual_seed(0)
    moe = MoE(_moe_args(aux_loss_coeff=0.01))
    x = torch.randn(3, 8, 32)
    moe.aux_loss_sequences = 4
    out = moe(x)
    full = moe.aux_loss_total.clone()
    _, selected, scores = moe.router(x.reshape(-1, 32), moe.expert_bias)
    ref = _reference_aux_loss(scores.view(3, 8, 8), selected.view(3, 8, 2), 0.01, 8, 2)
    torch.testing.assert_close(full, ref.detach())
    # the loss trains the router: with a zero output gradient, the gate's gradient is the aux
    # loss's alone, d(ref / 4) / d(gate)
    out.backward(torch.zeros_like(out))
    (want,) = torch.autograd.grad(ref / 4, moe.router.gate.weight)
    assert want.abs().max() > 0
    torch.testing.assert_close(moe.router.gate.weight.grad, want)

    # Two "CP ranks" each hold half of every sequence; the hook adds the other half's counts.
    halves = [x[:, :4], x[:, 4:]]
    local_counts = []
    for half in halves:
        moe.reduce_aux_counts = lambda c: c
        _, sel, _ = moe.router(half.reshape(-1, 32), moe.expert_bias)
        local_counts.append(torch.zeros(3, 8).scatter_add_(1, sel.view(3, 8), torch.ones(3, 8)))
    total = 0.0
    for r, half in enumerate(halves):
        moe.reduce_aux_counts = lambda c, r=r: c + local_counts[1 - r]
        moe.aux_loss_total.zero_()
        moe(half)
        total = total + moe.aux_loss_total
    torch.testing.assert_close(total, full)

    off = MoE(_moe_args(aux_loss_coeff=0.0))
    x.requires_grad_(True)
    out = off(x)
    assert off.aux_loss_total.item() == 0.0
    assert "AuxLossGrad" not in type(out.grad_fn).__name__ and "AuxLossGrad" not in str(out.grad_fn.next_functions)


def test_moe_layers_helper_and_stats():
    model = _built("deepseek_v3", n_layers=3)
    layers = moe_layers(model)
    assert layers == [model.layers["1"].moe, model.layers["2"].moe]
    model(_tokens(s=16))
    for moe in layers:
        assert moe.tokens_per_expert.sum().item() == 2 * 16 * 2
    assert "expert_bias" in "".join(model.state_dict().keys())
    assert not any(k.endswith("tokens_per_expert") for k in model.state_dict())


# --------------------------------------------------------------------------------------------
# Training smoke test


@pytest.mark.parametrize("name", MODELS)
def test_adamw_steps_reduce_loss(name):
    torch.manual_seed(0)
    model = _built(name, n_layers=2)
    tokens = _tokens(bs=2, s=32)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    losses = []
    for _ in range(8):
        loss = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        for moe in moe_layers(model):
            moe.update_expert_bias(moe.tokens_per_expert.clone())
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.6 * losses[0], losses


# --------------------------------------------------------------------------------------------
# Args and registry


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(dim=250), "not divisible by n_heads"),
        (dict(n_kv_heads=3), "not divisible by n_kv_heads"),
        (dict(n_layers=0), "n_layers must be a positive int"),
        (dict(dim=96, n_heads=32), "is odd"),
        (dict(norm_eps=0.0), "norm_eps must be a positive number"),
        (dict(ffn_dim_multiplier=-1.0), "ffn_dim_multiplier"),
    ],
)
def test_llama3_args_validation(overrides, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(llama3_flavors["debugmodel"], **overrides).validate()


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(n_routed_experts=10), "not divisible by\\s+n_expert_groups"),
        (dict(n_limited_groups=5), "exceeds\\s+n_expert_groups"),
        (dict(n_activated_experts=5), "reachable"),
        (dict(score_func="relu"), "'sigmoid' or 'softmax'"),
        (dict(n_dense_layers=7), "n_dense_layers=7 exceeds"),
        (dict(qk_rope_head_dim=15), "qk_rope_head_dim=15 is odd"),
        (dict(load_balance_coeff=-1.0), "load_balance_coeff"),
        (dict(aux_loss_coeff=-0.1), "aux_loss_coeff"),
        (dict(rope_factor=0.5), "rope_factor"),
        (dict(q_lora_rank=-1), "q_lora_rank must be an int >= 0"),
    ],
)
def test_deepseek_v3_args_validation(overrides, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(deepseek_v3_flavors["debugmodel"], **overrides).validate()


def test_llama3_ffn_hidden_dim():
    assert llama3_flavors["8B"].ffn_hidden_dim == 14336
    assert llama3_flavors["70B"].ffn_hidden_dim == 28672
    assert llama3_flavors["405B"].ffn_hidden_dim == 53248
    assert llama3_flavors["debugmodel"].ffn_hidden_dim == 768


def test_registry():
    spec = get_model_spec("llama3", "8B")
    assert (spec.name, spec.flavor, spec.args.dim) == ("llama3", "8B", 4096)
    spec.args.dim = 1  # a private copy: the flavor table is untouched
    assert get_model_spec("llama3", "8B").args.dim == 4096
    with pytest.raises(ValueError, match="valid models: deepseek_v3, llama3, qwen3"):
        get_model_spec("gpt2", "debugmodel")
    with pytest.raises(ValueError, match="valid flavors: debugmodel, 16B, 671B"):
        get_model_spec("deepseek_v3", "7B")
    with pytest.raises(ValueError, match="Unknown override.*vocab"):
        build_model("llama3", "debugmodel", vocab=10)
    with pytest.raises(ValueError, match="vocab_size must be a positive int"):
        build_model("llama3", "debugmodel", vocab_size=0)
    model = build_model("deepseek_v3", "debugmodel", vocab_size=100, max_seq_len=128)
    assert model.output.weight.shape == (100, 256) and model.output.weight.is_meta
    assert model.rope.table.shape == (128, 8, 2)


def test_rope_launches_three_kernels_per_call():
    """RoPE is pure memory traffic over every query and key; the complex form is one pass
    (cast up, multiply, cast back). The written-out real form launched nine kernels forward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    views = {"view", "view_as_complex", "view_as_real", "unsqueeze", "_conj", "detach", "_unsafe_view"}

    class Kernels(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ not in views:
                self.ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    rope = RotaryEmbedding(16, 64, 1e4)(torch.arange(8))
    x = torch.randn(2, 8, 4, 16, dtype=torch.bfloat16, requires_grad=True)
    with Kernels() as fwd:
        y = apply_rotary_emb(x, rope)
    grad = torch.randn_like(y)
    with Kernels() as bwd:
        y.backward(grad)
    assert fwd.ops == ["_to_copy", "mul", "_to_copy"]
    # + one clone of the [s, d/2] conjugated table, not of the activations
    assert bwd.ops == ["_to_copy", "clone", "mul", "_to_copy"]


# --------------------------------------------------------------------------------------------
# The model contract: decoder shell, registry, a third model added with one registry line


def test_both_models_are_the_shared_decoder_shell():
    from models.deepseek_v3 import DeepSeekV3
    from models.llama3 import Llama3

    for cls in (Llama3, DeepSeekV3):
        assert issubclass(cls, Decoder)
        # the forward, positions, embedding checks and layer loop are the shell's, not copies
        for method in ("forward", "local_positions", "_embed", "moe_layers", "flops_per_token", "trunk"):
            if cls is DeepSeekV3 and method in ("forward", "flops_per_token"):
                continue  # extended for the MTP depths (models/deepseek_v3/model.py): the shell's without them
            assert getattr(cls, method) is getattr(Decoder, method), (cls.__name__, method)
    assert Llama3.init_weights is Decoder.init_weights  # DeepSeek extends it (MoE buffers)
    for name in MODELS:
        model = build_model(name, "debugmodel", device="meta", n_layers=2)
        names = [n for n, _ in model.named_children()]
        assert names == ["tok_embeddings", "rope", "layers", "norm", "output"]
        for block in model.layers.values():
            assert isinstance(block, DecoderBlock) and isinstance(block.attention, DecoderAttention)
            # what TP splits is declared and exists
            for proj in (*block.attention.tp_colwise, block.attention.tp_rowwise):
                assert isinstance(block.attention.get_submodule(proj), nn.Linear), proj
            for hook in block.attention.tp_grad_syncs:
                assert callable(getattr(block.attention, hook))
    q_lora = build_model("deepseek_v3", "debugmodel", device="meta", n_layers=1, q_lora_rank=32)
    assert q_lora.layers["0"].attention.tp_colwise == ("wkv_b", "wq_b")
    assert build_model("deepseek_v3", "debugmodel", n_layers=1).layers["0"].attention.tp_colwise == (
        "wkv_b",
        "wq",
    )


def test_registry_contract_for_every_registered_model():
    from models.common.hf_adapter import HFStateDictAdapter
    from models.parallelize import parallelize_model
    from models.registry import flavor_names, has_experts, model_names
    from trainer.reporting.metrics import training_flops_per_token

    assert model_names() == ["deepseek_v3", "llama3", "qwen3"]
    assert flavor_names("llama3") == ["debugmodel", "debugmodel_tied", "1B", "3B", "8B", "70B", "405B"]
    assert flavor_names("deepseek_v3") == ["debugmodel", "16B", "671B"]
    assert flavor_names("qwen3") == [
        "debugmodel",
        "debugmodel_moe",
        "0.6B",
        "1.7B",
        "4B",
        "8B",
        "14B",
        "32B",
        "30B-A3B",
        "235B-A22B",
    ]
    assert (has_experts("llama3"), has_experts("deepseek_v3")) == (False, True)
    assert has_experts("deepseek_v3", "16B") and not has_experts("llama3", "8B")
    with pytest.raises(ValueError, match="valid models"):
        has_experts("gpt2")
    with pytest.raises(ValueError, match="valid flavors"):
        has_experts("llama3", "7B")
    for name in model_names():
        for flavor in flavor_names(name):
            spec = get_model_spec(name, flavor)
            assert isinstance(spec.args, DecoderArgs) and issubclass(spec.model_cls, Decoder)
            assert list(spec.flavors) == flavor_names(name)
            with pytest.raises(TypeError):
                spec.flavors["x"] = spec.args  # read-only view of the flavor table
            assert spec.parallelize_fn is parallelize_model
            assert issubclass(spec.hf_state_dict_adapter, HFStateDictAdapter)
            assert spec.hf_state_dict_adapter.model_name == name
            model = build_model(name, flavor)  # meta
            moes = spec.moe_layers(model)
            assert bool(moes) == spec.has_experts == has_experts(name, flavor)
            assert spec.flops_per_token(model, 4096) == training_flops_per_token(model, 4096)


def test_moe_hook_follows_pipeline_stages():
    model = build_model("deepseek_v3", "debugmodel", device="meta", n_layers=4)
    assert model.moe_layers() == [model.layers[k].moe for k in ("1", "2", "3")]
    del model.layers["3"]
    assert model.moe_layers() == [model.layers[k].moe for k in ("1", "2")]
    assert build_model("llama3", "debugmodel", device="meta", n_layers=2).moe_layers() == []


def test_register_model_rejects_what_breaks_the_contract(monkeypatch):
    from models import registry
    from models.llama3 import Llama3

    monkeypatch.setattr(registry, "_MODELS", dict(registry._MODELS))
    with pytest.raises(ValueError, match="already registered"):
        registry.register_model("llama3", Llama3, llama3_flavors)
    with pytest.raises(TypeError, match="not a subclass of models.common.decoder.Decoder"):
        registry.register_model("mlp", nn.Linear, llama3_flavors)
    with pytest.raises(TypeError, match="must be a dataclass subclassing"):
        registry.register_model("x", Llama3, {"tiny": dict(dim=8)})
    with pytest.raises(ValueError, match="at least one flavor"):
        registry.register_model("x", Llama3, {})


# A third model, defined here the way a new folder under models/ would define it: args with
# flavors, blocks built from its own attention and MLP (other projection names than Llama's,
# declared for TP), a Decoder subclass. Only one registry line makes it trainable.


@dataclasses.dataclass
class ToyArgs(DecoderArgs):
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    vocab_size: int = 128
    max_seq_len: int = 64
    norm_eps: float = 1e-5
    mlp_ratio: int = 2
    attn_mask_type: str = "causal"
    attn_type: str = "sdpa"
    eos_id: int | None = None
    document_positions: bool = False

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def attention_dim(self) -> int:
        return self.dim

    def validate(self) -> None:
        if self.dim % self.n_heads or self.head_dim % 2:
            raise ValueError(f"ToyArgs: dim={self.dim} over n_heads={self.n_heads} needs an even head_dim.")


class ToyAttention(DecoderAttention):  # plain multi-head attention
    tp_colwise = ("wq", "wk", "wv")

    def __init__(self, args: ToyArgs) -> None:
        super().__init__()
        self.head_dim = args.head_dim
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(args.dim, args.dim, bias=False) for _ in range(4))
        self.core = AttentionCore()

    def forward(self, x, rope, mask=None):
        bs, s, _ = x.shape
        q, k, v = (w(x).view(bs, s, -1, self.head_dim) for w in (self.wq, self.wk, self.wv))
        q, k = apply_rotary_emb(q, rope), apply_rotary_emb(k, rope)
        out = self.core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)
        return self.wo(out.transpose(1, 2).reshape(bs, s, -1))


class ToyMLP(nn.Module):  # GELU MLP, not SwiGLU
    tp_colwise = ("fc_in",)
    tp_rowwise = "fc_out"

    def __init__(self, args: ToyArgs) -> None:
        super().__init__()
        self.fc_in = nn.Linear(args.dim, args.mlp_ratio * args.dim, bias=False)
        self.fc_out = nn.Linear(args.mlp_ratio * args.dim, args.dim, bias=False)

    def forward(self, x):
        return self.fc_out(F.gelu(self.fc_in(x)))


class ToyBlock(DecoderBlock):
    def __init__(self, layer_id: int, args: ToyArgs) -> None:
        super().__init__(layer_id)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = ToyAttention(args)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = ToyMLP(args)


class Toy(Decoder):
    def build_rope(self, args: ToyArgs) -> RotaryEmbedding:
        return RotaryEmbedding(args.head_dim, args.max_seq_len, 10000.0)

    def build_block(self, layer_id: int, args: ToyArgs) -> ToyBlock:
        return ToyBlock(layer_id, args)


@pytest.fixture
def toy_registered(monkeypatch):
    from models import registry

    monkeypatch.setattr(registry, "_MODELS", dict(registry._MODELS))  # undone after the test
    registry.register_model("toy", Toy, {"tiny": ToyArgs()})  # the one line
    return registry


def test_toy_model_gets_the_contract_from_one_registry_line(toy_registered):
    from models.registry import model_rules
    from parallel_dims import ParallelDims, check_model_layout
    from trainer.reporting.metrics import training_flops_per_token

    registry = toy_registered
    assert "toy" in registry.model_names() and registry.flavor_names("toy") == ["tiny"]
    assert not registry.has_experts("toy")
    meta = build_model("toy", "tiny", n_layers=3)
    meta.to_empty(device="cpu")
    meta.init_weights(4)
    cpu = build_model("toy", "tiny", device="cpu", n_layers=3)
    cpu.init_weights(4)
    for key, value in cpu.state_dict().items():
        assert torch.equal(value, meta.state_dict()[key]), key
    assert meta(_tokens(s=16, vocab=128)).shape == (2, 16, 128)
    n = sum(p.numel() for p in cpu.parameters())
    assert training_flops_per_token(cpu, 64) == 6 * (n - 128 * 64) + 12 * 3 * 64 * 64
    with pytest.raises(ValueError, match="has no experts"):
        check_model_layout(
            ParallelDims(world_size=2, dp_replicate=1, dp_shard=2, cp=1, tp=1, pp=1, ep=2, etp=1).degrees,
            model_rules(get_model_spec("toy", "tiny").args),
        )


def test_toy_model_tensor_parallel_plan_comes_from_its_declarations(toy_registered):
    """Dry run on a fake 2-rank group: the toy's own projection names get split."""
    dist = pytest.importorskip("torch.distributed")
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    from torch.distributed.tensor import Replicate, Shard

    from models.parallelize import ParallelizeOptions
    from parallel_dims import ParallelDims

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=1, world_size=2)
    try:
        pd = ParallelDims(world_size=2, dp_replicate=1, dp_shard=1, cp=1, tp=2, pp=1, ep=1, etp=1)
        pd.build_mesh("cpu")
        model = build_model("toy", "tiny")
        get_model_spec("toy", "tiny").parallelize_fn(model, pd, ParallelizeOptions())
        block = model.layers["1"]
        for param, placement in [
            (block.attention.wq.weight, Shard(0)),
            (block.attention.wv.weight, Shard(0)),
            (block.attention.wo.weight, Shard(1)),
            (block.feed_forward.fc_in.weight, Shard(0)),
            (block.feed_forward.fc_out.weight, Shard(1)),
            (block.ffn_norm.weight, Replicate()),
            (model.output.weight, Shard(0)),
        ]:
            assert param.placements == (placement,)
        assert block.feed_forward.fc_in.weight.to_local().shape == (64, 64)
    finally:
        dist.destroy_process_group()


def test_toy_model_trains_a_step_through_parallelize_model(toy_registered, tmp_path):
    import torch.distributed as dist

    from models.parallelize import ParallelizeOptions, parallelize_model
    from parallel_dims import ParallelDims

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        pd = ParallelDims(world_size=1, dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1)
        pd.build_mesh("cpu")
        spec = get_model_spec("toy", "tiny")
        model = build_model("toy", "tiny")
        # bf16 mixed precision on one rank: fp32 masters with bf16 compute copies
        # (models/parallel/mixed_precision.py), made after the meta model is materialised
        opts = ParallelizeOptions(param_dtype="bfloat16", ac_mode="full")
        assert spec.parallelize_fn is parallelize_model
        spec.parallelize_fn(model, pd, opts)
        assert hasattr(model, "compute_copies")
        model.to_empty(device="cpu")
        model.init_weights(0)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        tokens = _tokens(bs=2, s=33, vocab=128)
        losses = []
        for _ in range(3):
            logits = model(tokens[:, :-1])
            assert logits.dtype == torch.bfloat16
            loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses
        for n, p in model.named_parameters():
            assert p.dtype == torch.float32 and not torch.equal(p.detach(), before[n]), n
    finally:
        dist.destroy_process_group()
