"""Float8 GEMMs on a CPU (``float8.cpu_gemm``, parallel_dims/torch_compat.py
``emulated_scaled_mm``): the emulation is torch's own CPU arithmetic for ``torch._scaled_mm``
(bitwise, on every host: torch's kernel with oneDNN switched off is that arithmetic), it agrees
with torch's kernel as this host runs it (oneDNN on AMX-INT8 hosts) within a float32 summation
bound that one float8 step of one operand element breaks, and it is what runs in eager
``Float8Linear`` layers, their backward and compiled graphs. The shapes are the GEMMs of the
converted linears of both debug models at the e2e tests' micro-batch (``FAST``: 2 x 64 tokens).
(Training with it: tests/e2e/test_float8_train.py; what it costs: ``make bench``'s float8_cpu.)"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from torch import nn

from models.parallel.float8 import Float8Options, convert_to_float8, cpu_gemm_note, float8_decisions, set_cpu_gemm
from models.registry import build_model
from parallel_dims import torch_compat
from parallel_dims.torch_compat import emulate_cpu_scaled_mm, emulated_scaled_mm

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max
TOKENS = 128  # tests/e2e/helpers.py FAST: local batch 2 x seq_len 64
U32 = 2.0**-24  # float32 unit round-off
# rows of the first operand compared against torch's kernel as this host runs it: each output
# element is one row times one column, so a few rows carry every contraction length and column
# (on an AMX host oneDNN takes ~1 s per 256^3 GEMM; 8 rows keep this test at seconds)
ROWS = 8


def _gemm_shapes() -> list[tuple[int, int, int]]:
    """(M, K, N) of every GEMM of a converted linear (in -> out) of both debug models, one micro-batch:
    output [T, in] @ [in, out], input gradient [T, out] @ [out, in], weight gradient
    [out, T] @ [T, in]; distinct shapes, sorted."""
    shapes = set()
    for name in ("llama3", "deepseek_v3"):
        model = build_model(name, "debugmodel")  # meta: shapes only
        mods = dict(model.named_modules())
        for fqn, why in float8_decisions(model, Float8Options()).items():
            if why is None:
                k, n = mods[fqn].in_features, mods[fqn].out_features
                shapes |= {(TOKENS, k, n), (TOKENS, n, k), (n, TOKENS, k)}
    return sorted(shapes)


SHAPES = _gemm_shapes()


@contextlib.contextmanager
def _torch_kernel(onednn: bool):
    """torch's own CPU ``_scaled_mm`` kernel (the emulation uninstalled), with oneDNN allowed or
    not (off: every host runs torch's float32 emulation; on: AMX-INT8 hosts run oneDNN)."""
    was = emulate_cpu_scaled_mm(False)
    try:
        with warnings.catch_warnings():  # the flags context warns about TF32 on Intel GPUs
            warnings.simplefilter("ignore", UserWarning)
            with torch.backends.mkldnn.flags(enabled=onednn):
                yield
    finally:
        emulate_cpu_scaled_mm(was)


@contextlib.contextmanager
def _emulated():
    was = emulate_cpu_scaled_mm(True)
    try:
        yield
    finally:
        emulate_cpu_scaled_mm(was)


def _operands(m: int, k: int, n: int, seed: int):
    """Float8 operands quantized like torchao does (``fp8_max / amax`` tensorwise, per row of a
    and per column of b rowwise), b column-major as ``_scaled_mm`` takes it, with the multipliers
    that dequantize them."""
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g) * 0.02
    tw_a, tw_b = E4M3_MAX / a.abs().amax(), E4M3_MAX / b.abs().amax()
    rw_a, rw_b = E4M3_MAX / a.abs().amax(1, keepdim=True), E4M3_MAX / b.abs().amax(0, keepdim=True)
    tensorwise = ((a * tw_a).to(E4M3), (b * tw_b).to(E4M3).t().contiguous().t(), 1 / tw_a, 1 / tw_b)
    rowwise = ((a * rw_a).to(E4M3), (b * rw_b).to(E4M3).t().contiguous().t(), 1 / rw_a, 1 / rw_b)
    return tensorwise, rowwise


def _cases(m: int, k: int, n: int, seed: int = 0):
    """What torchao and the float8 experts ask of ``_scaled_mm``: tensorwise to float32 and to
    bf16 (with a bf16 bias, as torchao passes one), rowwise to bf16, and a float8 output scaled
    by ``scale_result``."""
    (a, b, sa, sb), (ra, rb, rsa, rsb) = _operands(m, k, n, seed)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(seed + 1)).to(torch.bfloat16)
    return {
        "tensorwise->float32": (a, b, dict(scale_a=sa, scale_b=sb, out_dtype=torch.float32)),
        "tensorwise->bf16": (a, b, dict(scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)),
        "tensorwise->bf16+bias": (a, b, dict(scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, bias=bias)),
        "rowwise->bf16": (ra, rb, dict(scale_a=rsa, scale_b=rsb, out_dtype=torch.bfloat16)),
        "tensorwise->e4m3": (a, b, dict(scale_a=sa, scale_b=sb, out_dtype=E4M3, scale_result=torch.tensor(4.0))),
    }


def test_shapes_are_the_debug_models_gemms():
    """The shape list is not empty or trivial: llama3's 4 projection shapes and DeepSeek-V3's
    MLA / MoE ones, each in its three GEMMs, with the micro-batch as the weight gradient's
    contraction."""
    assert (TOKENS, 256, 768) in SHAPES and (TOKENS, 768, 256) in SHAPES and (768, TOKENS, 256) in SHAPES
    assert len(SHAPES) >= 12 and {k for _, k, _ in SHAPES} >= {TOKENS, 256, 768}


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_emulation_is_torchs_own_cpu_arithmetic_bitwise(shape):
    """Every case on every test shape, and the ``out=`` form inductor's CPU lowering calls:
    bitwise what torch's CPU kernel computes where it emulates (oneDNN off), which is what every
    CPU without AMX-INT8, and every CPU for rowwise scales, runs by default. Bitwise is right
    here, on any host: both sides run the same kernels on the same shapes and strides (an exact
    widening of float8 to float32, one IEEE multiply by the scale, the same float32 matmul of
    row-major operands, the same cast); a different widening, scale order or operand layout
    shows as other bits (the agreement test below is the tolerance check against oneDNN)."""
    cases = _cases(*shape)
    with _torch_kernel(onednn=False):
        ref = {name: torch._scaled_mm(a, b, **kw) for name, (a, b, kw) in cases.items()}
    for name, (a, b, kw) in cases.items():
        got = emulated_scaled_mm(a, b, **kw)
        assert got.dtype == ref[name].dtype and torch.equal(got.float(), ref[name].float()), name
    with _emulated():
        a, b, kw = cases["tensorwise->bf16"]
        out = torch.empty(0, dtype=torch.bfloat16)
        assert torch._scaled_mm(a, b, **kw, out=out) is out and torch.equal(out, ref["tensorwise->bf16"])


CASES = list(_cases(2, 16, 16))
# each output dtype's rounding: two values rounded from float32 values within the bound lie at
# most one ulp of the larger apart beyond it (half an ulp each); (relative ulp, the spacing of
# the subnormals, where the relative one stops: e4m3's is 2^-9 below 2^-6, which oneDNN's
# float8 output conversion does not always round to nearest: 3.48 steps became 4, measured)
ULP = {torch.float32: (2.0**-23, 0.0), torch.bfloat16: (2.0**-7, 0.0), E4M3: (2.0**-3, 2.0**-9)}


def _bound(a, b, kw) -> torch.Tensor:
    """Per element, how far two float32 evaluations of ``(a * sa) @ (b * sb) + bias`` may lie
    apart when they differ only in the order of the K additions and in where the scales are
    applied (to the operands, or to the products or the sum): each is within
    ``(K + 3) u (sum_k |a_k sa b_k sb| + |bias|)`` of the exact value (K roundings of the sum,
    one per scale, one for the bias), so together within twice that; divided by
    ``scale_result`` for a float8 output, as the results are."""
    sa, sb = kw["scale_a"].double(), kw["scale_b"].double()
    mags = (a.double().abs() * sa.abs()) @ (b.double().abs() * sb.abs())
    if kw.get("bias") is not None:
        mags = mags + kw["bias"].double().abs()
    bound = 2 * (a.shape[1] + 3) * U32 * mags
    if kw.get("scale_result") is not None:
        bound = bound / kw["scale_result"].double()
    return bound


def _agree(got: torch.Tensor, real: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """Elementwise: two results of ``got.dtype`` rounded from float32 values at most ``bound``
    apart agree (the bound plus one ulp of the larger, or one subnormal step)."""
    g, r = got.double(), real.double()
    relative, subnormal = ULP[got.dtype]
    return (g - r).abs() <= bound + (relative * torch.maximum(g.abs(), r.abs())).clamp(min=subnormal)


def _bumped(a: torch.Tensor) -> torch.Tensor:
    """``a`` with one element, row 0's largest, one float8 step smaller in magnitude: the smallest
    change of a float8 operand."""
    bits = a.view(torch.uint8).clone()
    k = a[0].float().abs().argmax()
    bits[0, k] -= 1  # sign and magnitude: one code down is one step toward zero (448 -> 416)
    return bits.view(a.dtype)


@pytest.mark.parametrize("case", CASES)
def test_emulation_agrees_with_torchs_kernel_on_this_host(case):
    """Against ``torch._scaled_mm`` as this host runs it (oneDNN for tensorwise scales on
    AMX-INT8 hosts, where the two differ in summation order; torch's emulation, equal bitwise,
    elsewhere): every element of every test shape within the float32 summation bound of
    :func:`_bound` plus one rounding of the output dtype. Negative control on every shape: one
    element of the first operand moved by one float8 step (a rounding float8 could have made)
    breaks the agreement in that row, so the tolerance is far below float8's own error and
    cannot hide a difference in quantization (not for a float8 output, whose own rounding is as
    coarse as that step)."""
    for m, k, n in SHAPES:
        a, b, kw = _cases(min(m, ROWS), k, n, seed=k + n)[case]
        with _torch_kernel(onednn=True):
            real = torch._scaled_mm(a, b, **kw)
        got = emulated_scaled_mm(a, b, **kw)
        bound = _bound(a, b, kw)
        ok = _agree(got, real, bound)
        worst = ((got.double() - real.double()).abs() / bound.clamp(min=1e-30)).max().item()
        assert ok.all(), f"{case} {m}x{k}x{n}: {(~ok).sum().item()} elements apart; worst {worst:.2f} bounds"
        if kw["out_dtype"] != E4M3:  # a float8 output rounds as coarsely as the step (2^-3)
            control = _agree(emulated_scaled_mm(_bumped(a), b, **kw), real, bound)
            assert not control[0].all(), f"{case} {m}x{k}x{n}: a float8 step of one element went unnoticed"


def test_float8_linear_runs_the_emulation_eager_in_backward_and_compiled(monkeypatch):
    """torchao's ``Float8Linear`` (as convert_to_float8 makes it, tensorwise, cpu_gemm
    'emulated'): its three GEMMs per layer call the emulation in forward and backward, eager and
    under ``torch.compile`` (inductor's CPU lowering calls the ``out`` form through the
    dispatcher); the compiled layer gives the eager one's output within float8's rounding of
    inductor's own fused scaling (tolerance: one e4m3 step, 2^-3 relative, of the largest
    output). cpu_gemm 'scaled_mm' restores torch's kernel (no call)."""
    pytest.importorskip("torchao.float8")
    calls = []

    def counting(*args, **kwargs):
        calls.append(tuple(args[0].shape))
        return emulated_scaled_mm(*args, **kwargs)

    was = emulate_cpu_scaled_mm(False)
    monkeypatch.setattr(torch_compat, "emulated_scaled_mm", counting)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(256, 768, bias=False), nn.Linear(768, 256, bias=False))
        convert_to_float8(model, Float8Options(), fsdp_all_gather=False)
        x = torch.randn(ROWS, 256, requires_grad=True)
        out = model(x)
        out.square().sum().backward()
        assert len(calls) == 6, calls  # 2 layers x (output, input gradient, weight gradient)
        compiled = torch.compile(model)
        with torch._inductor.config.patch(compile_threads=1):  # no pool of compile workers
            out_c = compiled(x)
            out_c.square().sum().backward()
        assert len(calls) == 12, calls
        assert (out_c - out).abs().max() <= 2.0**-3 * out.abs().max()
        convert_to_float8(
            nn.Sequential(nn.Linear(256, 256)), Float8Options(cpu_gemm="scaled_mm"), fsdp_all_gather=False
        )
        model(x[:2]).sum().backward()
        assert len(calls) == 12
    finally:
        emulate_cpu_scaled_mm(False)
        monkeypatch.undo()
        emulate_cpu_scaled_mm(was)


def test_convert_sets_the_process_wide_choice_and_the_startup_line_says_it():
    was = emulate_cpu_scaled_mm(False)
    try:
        convert_to_float8(nn.Linear(32, 32), Float8Options(linears=False), fsdp_all_gather=False)
        assert emulate_cpu_scaled_mm(True) is True
        convert_to_float8(nn.Linear(32, 32), Float8Options(linears=False, cpu_gemm="scaled_mm"), fsdp_all_gather=False)
        assert emulate_cpu_scaled_mm(False) is False
        assert set_cpu_gemm("emulated") == "scaled_mm" and set_cpu_gemm("scaled_mm") == "emulated"
        with pytest.raises(ValueError, match="float8.cpu_gemm must be one of 'emulated', 'scaled_mm', got 'onednn'"):
            set_cpu_gemm("onednn")
    finally:
        emulate_cpu_scaled_mm(was)
    assert "emulated" in cpu_gemm_note("emulated") and "float8.cpu_gemm = 'scaled_mm'" in cpu_gemm_note("emulated")
    assert "by torch._scaled_mm" in cpu_gemm_note("scaled_mm")


def test_cpu_gemm_config_choices():
    from trainer.config import ConfigError, load_config
    from trainer.plan import float8_options

    cfg = load_config(["--config", "llama3.toml", "--model.converters", "float8", "--float8.cpu_gemm", "scaled_mm"])
    assert float8_options(cfg).cpu_gemm == "scaled_mm"
    assert float8_options(load_config(["--model.converters", "float8"])).cpu_gemm == "emulated"
    with pytest.raises(ConfigError) as err:
        load_config(["--model.converters", "float8", "--float8.cpu_gemm", "onednn"])
    assert "float8.cpu_gemm must be one of 'emulated', 'scaled_mm', got 'onednn'" in str(err.value)
