"""Float8 grouped GEMMs of the routed experts (models/common/float8_grouped.py) on CPU.

The CUDA backend is torchao's ``_to_fp8_rowwise_then_scaled_grouped_mm``, whose quantization
kernels are triton and whose GEMM is ``torch._scaled_grouped_mm``: none of them runs on CPU. To
run that backend here anyway, exactly as the experts call it (our token-group alignment, the
weights' column-major views, int32 group ends, its layout asserts), the tests swap torchao's
triton kernels for torchao's own torch reference functions and ``torch._scaled_grouped_mm`` for
one rowwise ``torch._scaled_mm`` per group (:func:`torchao_on_cpu`). What this cannot show is
the CUDA kernels themselves (the first-GPU-run checklist has that item).

The CPU backend (one ``_scaled_mm`` per expert) must then match the torchao backend: the same
quantized operands and scales go into per-group GEMMs. The torchao backend's groups carry zero
padding rows (to multiples of 16), which leave every output row and the forward/input-gradient
GEMMs bitwise unchanged, while the weight gradient contracts over the padded token count, so a
GEMM may block its sum differently: within 2 bf16 ulps (2 * 2^-8 relative), measured bitwise on
this machine.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from models.common.float8_grouped import (
    FLOAT8_GROUP_ALIGN,
    align_token_groups,
    float8_grouped_mm,
    quantize_rowwise,
    unalign,
)

pytestmark = pytest.mark.unit

BF16_ULPS = 2 * 2.0**-8


def _ref_axiswise(hp, axis, output_dtype, round_scales_to_power_of_2):
    """torchao's own torch reference of an axiswise float8 cast: (data, scales along ``axis``)."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated

    scales = tensor_to_scale(
        hp,
        output_dtype,
        scaling_granularity=ScalingGranularity.AXISWISE,
        axiswise_dim=axis,
        round_scales_to_power_of_2=round_scales_to_power_of_2,
    )
    return to_fp8_saturated(hp.to(torch.float32) * scales, output_dtype), scales


def _ref_rowwise_2d(hp, output_dtype=torch.float8_e4m3fn, round_scales_to_power_of_2=False):
    return _ref_axiswise(hp, -1, output_dtype, round_scales_to_power_of_2)


def _ref_colwise_3d(hp, output_dtype=torch.float8_e4m3fn, round_scales_to_power_of_2=False):
    data, scales = _ref_axiswise(hp, -2, output_dtype, round_scales_to_power_of_2)  # scales [E, 1, N]
    return data.transpose(-2, -1).contiguous().transpose(-2, -1), scales  # column-major per expert


def _ref_colwise_dual(a, b, offsets, output_dtype=torch.float8_e4m3fn, round_scales_to_power_of_2=False):
    """torchao's per-group column-wise reference on each tensor (one group at a time: the
    reference cannot take an empty group, whose GEMM contracts over nothing; its scales are 1)."""
    from torchao.prototype.moe_training.utils import torch_to_float8_per_group_colwise

    out = []
    ends = offsets.tolist()
    for t in (a, b):
        data = torch.zeros(t.shape, dtype=output_dtype)
        scales = []
        for s, e in zip([0] + ends[:-1], ends):
            if e == s:
                scales.append(torch.ones(t.shape[1]))
                continue
            d, sc = torch_to_float8_per_group_colwise(
                t[s:e], torch.tensor([e - s], dtype=torch.int32), output_dtype, round_scales_to_power_of_2
            )
            data[s:e], _ = d, scales.append(sc)
        out += [data.t().contiguous().t(), torch.cat(scales)]
    return tuple(out)


def _scaled_grouped_mm_by_loop(a, b, scale_a, scale_b, offs, out_dtype=torch.bfloat16, use_fast_accum=False):
    """torch._scaled_grouped_mm's two layouts as one rowwise torch._scaled_mm per group. Rows
    past the last group are NaN: the CUDA kernel leaves them unwritten (uninitialized memory),
    and none of it may reach a result or a gradient."""
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    if b.dim() == 3:  # [M, K] x [G, K, N], groups of rows
        out = torch.full((a.shape[0], b.shape[2]), float("nan"), dtype=out_dtype)
        out[: ends[-1]] = 0
        for g, (s, e) in enumerate(zip(starts, ends)):
            if e > s:
                out[s:e] = torch._scaled_mm(
                    a[s:e], b[g], scale_a=scale_a[s:e, None], scale_b=scale_b[g][None, :], out_dtype=out_dtype
                )
        return out
    # [N, M] x [M, K], groups along the contraction: [G, N, K]
    n, k = a.shape[0], b.shape[1]
    out = torch.zeros(len(ends), n, k, dtype=out_dtype)
    for g, (s, e) in enumerate(zip(starts, ends)):
        if e > s:
            out[g] = torch._scaled_mm(
                a[:, s:e].contiguous(),
                b[s:e].t().contiguous().t(),
                scale_a=scale_a[g * n : (g + 1) * n, None].contiguous(),
                scale_b=scale_b[None, g * k : (g + 1) * k].contiguous(),
                out_dtype=out_dtype,
            )
    return out


@contextlib.contextmanager
def torchao_on_cpu(monkeypatch):
    """torchao's float8 grouped GEMM with its CUDA-only kernels replaced (module docstring)."""
    from torchao.prototype.moe_training import fp8_grouped_mm
    from torchao.prototype.moe_training.utils import torch_to_3d_rowwise_float8_transpose_rhs

    monkeypatch.setattr(fp8_grouped_mm, "triton_fp8_rowwise_2d_scale_and_cast", _ref_rowwise_2d)
    monkeypatch.setattr(fp8_grouped_mm, "triton_fp8_colwise_3d_scale_and_cast", _ref_colwise_3d)
    monkeypatch.setattr(
        fp8_grouped_mm,
        "triton_fp8_rowwise_3d_transpose_rhs",
        lambda hp, output_dtype, round_scales_to_power_of_2: torch_to_3d_rowwise_float8_transpose_rhs(
            hp, output_dtype, round_scales_to_power_of_2
        ),
    )
    monkeypatch.setattr(fp8_grouped_mm, "triton_fp8_per_group_colwise_scales_dual", _ref_colwise_dual)
    monkeypatch.setattr(torch, "_scaled_grouped_mm", _scaled_grouped_mm_by_loop)
    yield


def _experts(seed: int = 0, e: int = 4, dim: int = 64, hidden: int = 48, rows: int = 70):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, dim, generator=g)
    w1 = torch.randn(e, hidden, dim, generator=g) * 0.1
    w2 = torch.randn(e, dim, hidden, generator=g) * 0.1
    w3 = torch.randn(e, hidden, dim, generator=g) * 0.1
    return x, w1, w2, w3


# counts with an empty expert, a group already a multiple of 16, and 6 rows of EP padding past the sum
COUNTS = torch.tensor([13, 0, 32, 19])


def _run(backend, x, w1, w2, w3, counts=COUNTS, dtype=torch.float32):
    leaves = [t.to(dtype).detach().requires_grad_() for t in (x, w1, w2, w3)]
    out = float8_grouped_mm(*leaves, counts, backend)
    g = torch.Generator().manual_seed(1)
    out.backward(torch.randn(out.shape, generator=g).to(device=out.device, dtype=dtype))
    return out.detach(), [t.grad for t in leaves]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torchao_backend_matches_the_per_expert_backend(monkeypatch, dtype):
    """torchao's float8 grouped GEMM, called as the CUDA experts call it, against the per-expert
    ``_scaled_mm`` backend CPU runs: output and every gradient within 2 bf16 ulps elementwise
    (module docstring), rows past the counts' sum zero with zero gradients. Negative control:
    the same experts without float8 are more than 5x the tolerance away (measured 8x: 6.4e-2
    relative)."""
    x, w1, w2, w3 = _experts()
    with torchao_on_cpu(monkeypatch):
        out_t, grads_t = _run("torchao", x, w1, w2, w3, dtype=dtype)
    out_s, grads_s = _run("scaled_mm", x, w1, w2, w3, dtype=dtype)
    total = int(COUNTS.sum())
    assert out_t.dtype == dtype and out_s.dtype == dtype
    for name, a, b in [("out", out_t, out_s)] + [
        (n, p, q) for n, p, q in zip(("x", "w1", "w2", "w3"), grads_t, grads_s)
    ]:
        torch.testing.assert_close(a.float(), b.float(), rtol=BF16_ULPS, atol=1e-6, msg=name)
    assert not out_s[total:].any() and not grads_s[0][total:].any()
    assert not out_t[total:].any() and not grads_t[0][total:].any()
    assert all(torch.isfinite(t).all() for t in (out_t, *grads_t))
    # an expert with no token: zero weight gradients
    assert not grads_t[1][1].any() and not grads_s[1][1].any()
    hp = torch.zeros_like(out_s.float())
    start = 0
    for e, n in enumerate(COUNTS.tolist()):
        xe = x[start : start + n]
        hp[start : start + n] = (torch.nn.functional.silu(xe @ w1[e].t()) * (xe @ w3[e].t())) @ w2[e].t()
        start += n
    assert _rel(out_s, hp) > 5 * BF16_ULPS


def test_the_per_expert_backend_has_float8_error_and_the_emulation_equals_it():
    """Against the same experts in float32: the relative error of the output and the gradients
    is what e4m3 rounding gives (3 mantissa bits: a few percent), not more (a wrong scale or a
    transposed operand is O(1)), and not zero (it really quantized). The emulated backend
    (float32 GEMMs on the dequantized operands) gives the same numbers: on CPU the float8 GEMM
    accumulates in float32 too."""
    x, w1, w2, w3 = _experts(seed=3)
    out_s, grads_s = _run("scaled_mm", x, w1, w2, w3)
    out_e, grads_e = _run("emulated", x, w1, w2, w3)
    torch.testing.assert_close(out_e, out_s, rtol=BF16_ULPS, atol=1e-6)
    for a, b in zip(grads_e, grads_s):
        torch.testing.assert_close(a, b, rtol=BF16_ULPS, atol=1e-6)

    leaves = [t.detach().requires_grad_() for t in (x, w1, w2, w3)]
    xs = torch.split(leaves[0], COUNTS.tolist() + [x.shape[0] - int(COUNTS.sum())])
    ref = torch.cat(
        [
            (torch.nn.functional.silu(xe @ leaves[1][e].t()) * (xe @ leaves[3][e].t())) @ leaves[2][e].t()
            for e, xe in enumerate(xs[:-1])
        ]
        + [torch.zeros(xs[-1].shape)]
    )
    ref.backward(torch.randn(ref.shape, generator=torch.Generator().manual_seed(1)))
    errors = [_rel(out_s, ref)] + [_rel(a, b.grad) for a, b in zip(grads_s, leaves)]
    assert all(0.01 < err < 0.15 for err in errors), errors


def test_quantize_rowwise_scales_are_powers_of_two_and_saturate():
    t = torch.tensor([[1.0, -3.0, 0.5], [0.0, 0.0, 0.0], [1000.0, 1.0, -2.0]])
    data, inv = quantize_rowwise(t, dim=-1)
    assert data.dtype == torch.float8_e4m3fn and inv.shape == (3, 1)
    assert torch.equal(torch.log2(inv), torch.round(torch.log2(inv)))  # exact powers of two
    # each row's largest magnitude lands in the top binade of e4m3 (256..448)
    assert (data.float()[[0, 2]].abs().amax(dim=-1) >= 256).all()
    assert torch.isfinite(inv).all() and not data.float()[1].any()  # an all-zero row stays finite
    torch.testing.assert_close(data.float() * inv, t, rtol=2.0**-3, atol=1e-2)


def test_align_token_groups_pads_each_group_to_16_rows_and_reads_back():
    x = torch.arange(70 * 4, dtype=torch.float32).view(70, 4) + 1
    buffer, ends, dest, valid = align_token_groups(x, COUNTS)
    assert ends.dtype == torch.int32 and ends.tolist() == [16, 16, 48, 80]
    assert buffer.shape[0] == 70 + 4 * FLOAT8_GROUP_ALIGN
    assert all(e % FLOAT8_GROUP_ALIGN == 0 for e in ends.tolist())
    # group 0: rows 0..12 at 0..12, zeros to 16; group 2: rows 13..44 at 16..47; group 3 at 48..66
    assert torch.equal(buffer[:13], x[:13]) and not buffer[13:16].any()
    assert torch.equal(buffer[16:48], x[13:45]) and torch.equal(buffer[48:67], x[45:64]) and not buffer[67:].any()
    back = unalign(buffer, dest, valid)
    assert torch.equal(back[:64], x[:64]) and not back[64:].any()  # padding rows read back as zeros


# ---------------------------------------------------------------- converter, config, census


def _deepseek():
    from models.registry import build_model

    torch.manual_seed(0)
    return build_model("deepseek_v3", "debugmodel", device="cpu")


def test_converter_marks_the_selected_experts_and_keeps_their_weights_plain():
    """``float8_experts`` alone: no linear is swapped, the experts that ``moe_fqns`` selects (and
    whose per-etp-rank hidden slice is a multiple of 16) are marked, their parameters stay the
    plain master-dtype tensors they were (FSDP, EP and checkpoints see nothing new)."""
    from torchao.float8.float8_linear import Float8Linear

    from models.parallel.float8 import Float8Options, convert_to_float8, float8_expert_decisions

    model = _deepseek()
    experts = [fqn for fqn, mod in model.named_modules() if fqn.endswith("moe.experts")]
    assert len(experts) == 5
    params = {n: p for n, p in model.named_parameters()}
    report = convert_to_float8(
        model, Float8Options(linears=False, moe_fqns=("layers.2.", "layers.4.")), fsdp_all_gather=False
    )
    assert report.experts == ["layers.2.moe.experts", "layers.4.moe.experts"] and not report.converted
    assert report.experts_kept == {f: "not matched by float8.moe_fqns" for f in experts if f not in report.experts}
    marked = {fqn: mod.float8_emulate for fqn, mod in model.named_modules() if fqn in experts}
    assert marked == {f: (False if f in report.experts else None) for f in experts}
    assert not any(isinstance(m, Float8Linear) for m in model.modules())
    assert all(p is params[n] and type(p) is torch.nn.Parameter for n, p in model.named_parameters())
    # the debug model's hidden 256 split over etp=32 ranks is 8 rows: kept, and why
    why = float8_expert_decisions(model, Float8Options(moe_fqns=("experts",)), etp=32)
    assert set(why.values()) == {"a dimension not a multiple of 16 (dim 256, hidden 8 per etp rank)"}


def _expert_flops(census) -> tuple[int, int, int]:
    """(float8 _scaled_mm FLOPs, high-precision _grouped_mm FLOPs, all other matmul FLOPs)."""
    f8 = sum(f for (op, dt), f in census.op_flops.items() if op == "_scaled_mm" and dt.itemsize == 1)
    grouped = sum(f for (op, dt), f in census.op_flops.items() if op == "_grouped_mm")
    return f8, grouped, census.total_flops - f8 - grouped


def test_census_counts_every_expert_gemm_as_float8():
    """One forward + backward of the debug model under the matmul census: without float8 the
    experts' GEMMs are ``_grouped_mm`` (float32); with ``float8_experts`` exactly those FLOPs run
    as float8 ``_scaled_mm`` instead (integer FLOP counts, equal: every forward, input-gradient
    and weight-gradient GEMM of every expert), and nothing else changes. The expected count is
    computed here from the shapes: 3 weights x 3 GEMMs x 2 * dim * hidden per routed token."""
    from models.parallel.float8 import Float8Options, convert_to_float8
    from trainer.instruments.matmul_census import MatmulCensus

    tokens = torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(0))
    counted = []
    for opts in (None, Float8Options(linears=False, moe_fqns=("experts",))):
        model = _deepseek()
        if opts is not None:
            convert_to_float8(model, opts, fsdp_all_gather=False)
        with MatmulCensus() as census:
            model(tokens).sum().backward()
        counted.append(_expert_flops(census))
    (f8_off, grouped_off, rest_off), (f8_on, grouped_on, rest_on) = counted
    dim, hidden = 256, 256  # the debug flavor's dim and moe_inter_dim
    routed = tokens.numel() * 2  # top_k = 2
    expected = 5 * routed * 3 * 3 * 2 * dim * hidden  # 5 MoE layers
    assert (f8_off, grouped_off) == (0, expected)
    assert (f8_on, grouped_on) == (expected, 0)
    assert rest_on == rest_off


def test_selective_ac_saves_the_float8_expert_gemms():
    """Selective per-op activation checkpointing keeps every float8 expert GEMM's output, as it
    keeps the bf16 ``_grouped_mm``'s: one forward + backward runs exactly as many float8 FLOPs
    with it as without AC (the recomputed forward redoes only the cheap ops: quantization,
    SwiGLU). Before ``_scaled_mm`` joined the save list, the census counted the expert GEMMs'
    forward twice (make bench-gpu's smoke row: float8 share 0.808 against the planner's 0.796)."""
    from models.parallel.activation_checkpoint import apply_activation_checkpointing
    from models.parallel.float8 import Float8Options, convert_to_float8
    from trainer.instruments.matmul_census import MatmulCensus

    tokens = torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(0))
    counted = []
    for ac in ("none", "selective"):
        model = _deepseek()
        convert_to_float8(model, Float8Options(linears=False, moe_fqns=("experts",)), fsdp_all_gather=False)
        apply_activation_checkpointing(model, ac, "op")
        with MatmulCensus() as census:
            model(tokens).sum().backward()
        counted.append(_expert_flops(census))
    assert counted[0][0] > 0 and counted[1] == counted[0]


@pytest.mark.parametrize(
    "converters, fqns, expected",
    [
        ("float8_experts", None, {"linears": False, "moe_fqns": ("experts",)}),
        ("quantize.grouped_mm.float8", None, {"linears": False, "moe_fqns": ("experts",)}),
        ("float8,float8_experts", "layers.2", {"linears": True, "moe_fqns": ("layers.2",)}),
        ("float8", None, {"linears": True, "moe_fqns": ()}),
    ],
)
def test_config_turns_on_linears_and_experts_separately(converters, fqns, expected):
    from models.parallel.float8 import Float8Options
    from trainer.config import load_config
    from trainer.plan import float8_options

    args = ["--config", "deepseek_v3.toml", "--model.converters", converters]
    args += ["--float8.moe_fqns", fqns] if fqns else []
    assert float8_options(load_config(args)) == Float8Options(**expected)


def test_torchtitan_grouped_mm_section_is_accepted():
    """torchtitan 0.2.2's spelling: converter 'quantize.grouped_mm.float8' and the nested
    [quantize.grouped_mm.float8] table with its key ``fqns``."""
    from models.parallel.float8 import Float8Options
    from trainer.config import config_from_dict
    from trainer.plan import float8_options

    cfg = config_from_dict(
        {
            "model": {"name": "deepseek_v3", "flavor": "debugmodel", "converters": ["quantize.grouped_mm.float8"]},
            "quantize": {"grouped_mm": {"float8": {"fqns": ["layers.3.moe"]}}},
        }
    )
    assert float8_options(cfg) == Float8Options(linears=False, moe_fqns=("layers.3.moe",))


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--config", "deepseek_v3.toml", "--model.converters", "float8_experts", "--float8.moe_fqns", ""],
            "model.converters has 'float8_experts' but float8.moe_fqns is empty, so no routed experts would "
            "convert: set float8.moe_fqns = ['experts'] (every MoE layer), or remove 'float8_experts'",
        ),
        (
            ["--config", "llama3.toml", "--model.converters", "float8_experts"],
            "model.converters has 'float8_experts' but the llama3 model has no routed experts: remove it from "
            "model.converters ('float8' converts the linear layers)",
        ),
        (
            ["--config", "deepseek_v3.toml", "--model.converters", "float8_experts", "--float8.moe_fqns", "router"],
            "model.converters has 'float8_experts' but no routed-expert module converts (layers.1.moe.experts: not "
            "matched by float8.moe_fqns): set float8.moe_fqns to strings their FQNs contain (e.g. ['experts']), or "
            "remove 'float8_experts'",
        ),
    ],
)
def test_experts_that_cannot_convert_are_one_line(args, message):
    from trainer.config import ConfigError, load_config
    from trainer.plan import plan_job

    with pytest.raises(ValueError) as err:
        plan_job(load_config(args), 1, device_type="cpu")
    assert isinstance(err.value, ConfigError) or "\n" not in str(err.value)
    assert str(err.value) == message


@pytest.mark.parametrize("capability, refused", [((8, 9), True), ((9, 0), False)])
def test_experts_need_sm90_on_cuda(monkeypatch, capability, refused):
    """torch._scaled_grouped_mm needs compute capability 9.0 (H100): an sm89 GPU (L40S) takes
    float8 linears but not float8 experts, one line naming the fix; emulation is accepted."""
    import torchao.prototype.moe_training  # noqa: F401  (imported before CUDA is faked: it probes the GPU)

    from models.parallel.float8 import Float8Options, check_float8_support

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA test GPU")
    check_float8_support(Float8Options(), "cuda", compile_model=False)  # linears: sm89 is enough
    experts = Float8Options(linears=False, moe_fqns=("experts",))
    if refused:
        with pytest.raises(ValueError, match=r"need torch._scaled_grouped_mm, which needs compute capability 9.0"):
            check_float8_support(experts, "cuda", compile_model=False)
    else:
        check_float8_support(experts, "cuda", compile_model=False)
    check_float8_support(Float8Options(linears=False, moe_fqns=("experts",), emulate=True), "cuda", False)
    if not refused:  # a torchao without the float8 grouped GEMM (0.16 has none): one line
        import sys

        monkeypatch.setitem(sys.modules, "torchao.prototype.moe_training", None)
        with pytest.raises(ValueError, match=r"torchao >= 0.17\), which torchao [0-9.]+ lacks: pip install -U"):
            check_float8_support(experts, "cuda", compile_model=False)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
    reason="the first-GPU-run check (benchmarks/gpu_checklist.py): torchao's CUDA kernels need sm90+",
)
def test_cuda_torchao_kernels_match_the_per_expert_backend():
    """On an H100: torchao's real triton quantization and ``torch._scaled_grouped_mm`` (the
    backend the experts take there) against one rowwise ``_scaled_mm`` per expert on the same
    GPU, bf16. torchao's grouped GEMM accumulates with ``use_fast_accum`` and ours without, so
    they agree to bf16 rounding of the GEMM sums, not bitwise: within 1e-2 relative (Frobenius),
    while both are float8-far (> 1e-2) from the bf16 experts without float8."""
    x, w1, w2, w3 = (t.cuda() for t in _experts(rows=4096, e=8, dim=512, hidden=256))
    counts = torch.tensor([700, 0, 1000, 300, 512, 900, 80, 600], device="cuda")  # 4092 of 4096 rows
    out_t, grads_t = _run("torchao", x, w1, w2, w3, counts, dtype=torch.bfloat16)
    out_s, grads_s = _run("scaled_mm", x, w1, w2, w3, counts, dtype=torch.bfloat16)
    for a, b in [(out_t, out_s), *zip(grads_t, grads_s)]:
        assert _rel(a, b) < 1e-2
    assert not out_t[4092:].any() and not grads_t[0][4092:].any()
    leaves = [t.to(torch.bfloat16) for t in (x, w1, w2, w3)]
    ref = torch.zeros_like(out_s)
    start = 0
    for e, n in enumerate(counts.tolist()):
        xe = leaves[0][start : start + n]
        ref[start : start + n] = (torch.nn.functional.silu(xe @ leaves[1][e].t()) * (xe @ leaves[3][e].t())) @ leaves[
            2
        ][e].t()
        start += n
    assert 1e-2 < _rel(out_t, ref) < 0.15 and 1e-2 < _rel(out_s, ref) < 0.15
