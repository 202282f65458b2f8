"""The kernels chosen at run time (issue 39, items 3 and 4): torch's fused RMSNorm
(``models/common/norms.py``) and MLA's values unpadded where a kernel takes them
(``models/common/attention.py`` ``value_head_plan``), and the start-up line that names them
(``models/kernels.py``).

This CPU has neither of the kernels a GPU picks (the CUDA ``_fused_rms_norm``, cuDNN attention),
so the tests prove what a CPU can: the fused op's semantics against ours (``F.rms_norm`` on CPU
is torch's composite of the math the CUDA kernel computes), the wiring (which path each device
and dtype takes), the decision rule against the backend choices a GPU would report, and the
numerics of unpadded values (the math kernel here) against padded ones (the flash kernel).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

import models.common.attention as attention
import models.common.norms as norms
from models.common.attention import AttentionCore, ValueHeadPlan, sdpa_value_plan, value_head_plan
from models.kernels import kernels_line
from models.registry import build_model

D = 64  # RMSNorm width: a reduction long enough to differ in summation order, a few µs per call


def _norm_fwd_bwd(dtype: torch.dtype, fused: bool, eps: float = 1e-6, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 5, D, generator=g).to(dtype).requires_grad_()
    w = (1 + 0.5 * torch.randn(D, generator=g)).to(dtype).requires_grad_()
    cot = torch.randn(3, 5, D, generator=g)
    y = norms.rms_norm(x, w, eps, fused=fused)
    (y.float() * cot).sum().backward()
    return y.detach().float(), x.grad.float(), w.grad.float()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


# fp32: the fused CUDA kernel sums the 64 squares in another order: <= 64 * 2^-24 = 3.8e-6 relative
# (on CPU F.rms_norm runs the same ops as ours and is bitwise equal; the bound is for the kernel).
# bf16: ours rounds the normalized tensor to bf16 and then the product with the gain, the fused op
# the product once: <= 3 units of 2^-8 per element; the op-by-op backward also rounds g * w to
# bf16. Bound 2^-6 of the tensor's largest entry (measured worst over 20 seeds: 0.0074).
# Negative control: the wrong eps, which a real bug (eps dropped, or the default 1e-5 for ours)
# would be; the control's eps moves rstd by ~50x the bound.
NORM_CASES = {torch.float32: (1e-5, 1e-2), torch.bfloat16: (2**-6, 0.5)}


@pytest.mark.parametrize("dtype", list(NORM_CASES), ids=str)
def test_fused_rms_norm_matches_op_by_op(dtype):
    """``F.rms_norm`` (what the model calls on CUDA) against the op-by-op norm: output, input
    gradient and gain gradient within the bound above, and the wrong eps outside it. Shapes
    [3, 5, 64]: several rows (the statistics are per row) and a 64-wide reduction."""
    bound, wrong_eps = NORM_CASES[dtype]
    fused, ours = _norm_fwd_bwd(dtype, True), _norm_fwd_bwd(dtype, False)
    for name, a, b in zip(("out", "dx", "dw"), fused, ours, strict=True):
        assert _rel(a, b) <= bound, (name, _rel(a, b))
    wrong = _norm_fwd_bwd(dtype, True, eps=wrong_eps)
    assert _rel(wrong[0], ours[0]) > 4 * bound and _rel(wrong[1], ours[1]) > 4 * bound


def test_rms_norm_path_by_device_and_dtype(monkeypatch):
    """Fused on CUDA when input and gain share a dtype; op by op on CPU (torch has no fused CPU
    kernel: the op's CPU dispatch is its composite) and for mixed dtypes (F.rms_norm would fall
    back with a warning and return the input's dtype where ours promotes). The module takes the
    path the function names: with CPU counted as fused it calls F.rms_norm."""
    bf16, fp32 = torch.bfloat16, torch.float32
    assert norms.rms_norm_path("cuda", bf16, bf16) == "fused" == norms.rms_norm_path("cuda", fp32, fp32)
    assert norms.rms_norm_path("cuda", bf16, fp32) == "op_by_op"
    assert norms.rms_norm_path("cpu", bf16, bf16) == "op_by_op" == norms.rms_norm_path("cpu", fp32, fp32)
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("aten::_fused_rms_norm", "CPU")

    calls = []
    real = F.rms_norm

    def spy(*args, **kwargs):
        calls.append(args[1:])
        return real(*args, **kwargs)

    monkeypatch.setattr(norms.F, "rms_norm", spy)
    module = norms.RMSNorm(D, eps=1e-5)
    x = torch.randn(2, D)
    module(x)
    assert calls == []
    monkeypatch.setattr(norms, "FUSED_DEVICE_TYPES", ("cuda", "cpu"))
    module(x)
    assert calls == [((D,), module.weight, 1e-5)]


def _backend_choices(monkeypatch, narrow: SDPBackend, padded: SDPBackend):
    """Make SDPA's backend selection answer as a GPU would: ``narrow`` for values narrower than
    q/k (asked with cuDNN first), ``padded`` for values of q/k's head dim."""

    def choice(q, k, v, *args, **kwargs):
        return int(narrow if v.shape[-1] < q.shape[-1] else padded)

    monkeypatch.setattr(attention.torch, "_fused_sdp_choice", choice)
    attention._probe.cache_clear()


def test_value_plan_rule(monkeypatch):
    """The rule: values go unpadded when the backend SDPA picks for them (cuDNN first) is at
    least as fast as the one it picks for padded values. On this CPU: the flash kernel needs one
    head dim, so padded (unpadded would run the math path), causal or masked, fp32 or bf16. With
    a GPU's answers: cuDNN takes them -> unpadded under cuDNN-first priority; only the
    memory-efficient kernel takes them while FlashAttention takes padded values -> padded; fp32
    (no FlashAttention, memory-efficient either way) -> unpadded. FlexAttention takes them
    always, varlen (FlashAttention) never."""
    for dtype in (torch.float32, torch.bfloat16):
        for masked in (False, True):
            assert sdpa_value_plan("cpu", dtype, 48, 32, masked) == ValueHeadPlan(pad=True, kernel="flash")
    try:
        cases = [
            (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, ValueHeadPlan(False, "cudnn", True)),
            (SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, ValueHeadPlan(True, "flash")),
            (SDPBackend.EFFICIENT_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, ValueHeadPlan(False, "efficient")),
            (SDPBackend.MATH, SDPBackend.MATH, ValueHeadPlan(False, "math")),
        ]
        for narrow, padded, plan in cases:
            _backend_choices(monkeypatch, narrow, padded)
            assert sdpa_value_plan("cpu", torch.bfloat16, 192, 128, False) == plan, (narrow, padded)
    finally:
        monkeypatch.undo()
        attention._probe.cache_clear()
    cpu = torch.device("cpu")
    assert value_head_plan(AttentionCore("block_causal", "flex"), cpu, torch.bfloat16, 192, 128).pad is False
    assert value_head_plan(AttentionCore("block_causal", "varlen"), cpu, torch.bfloat16, 192, 128).pad is True


SEQ, BATCH, VOCAB, EOS = 16, 2, 64, 3


def _mla_fwd_bwd(mask_type: str, plan: ValueHeadPlan, monkeypatch, wrong_pad: bool = False, compile: bool = False):
    """One DeepSeek-V3 debug attention layer's forward and backward with the value plan forced."""
    monkeypatch.setattr(attention, "_probe", lambda *key: plan)
    if wrong_pad:  # the negative control: zero columns on the wrong side of v
        real_pad = F.pad
        monkeypatch.setattr(F, "pad", lambda t, p, *a, **k: real_pad(t, (p[1], p[0]), *a, **k))
    torch.manual_seed(0)
    extra = {"eos_id": EOS} if mask_type == "block_causal" else {}
    model = build_model(
        "deepseek_v3", "debugmodel", device="cpu", n_layers=1, vocab_size=VOCAB, max_seq_len=SEQ,
        attn_mask_type=mask_type, **extra,
    )  # fmt: skip
    model.init_weights(0)
    attn = model.layers["0"].attention
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(4, VOCAB, (BATCH, SEQ), generator=gen)
    tokens[0, [4, 9]] = EOS
    rope, mask = model.attention_inputs(tokens, SEQ, BATCH, tokens.device)
    x = torch.randn(BATCH, SEQ, model.args.dim, generator=gen).requires_grad_()
    cot = torch.randn(BATCH, SEQ, model.args.dim, generator=gen)
    fn = torch.compile(attn, backend="aot_eager", fullgraph=True) if compile else attn
    try:
        out = fn(x, rope, mask)
    finally:
        if compile:
            torch._dynamo.reset()
    (out * cot).sum().backward()
    monkeypatch.undo()
    grads = [x.grad] + [p.grad for p in attn.parameters()]
    return out.detach(), grads


def _max_rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(_rel(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("mask_type", ["causal", "block_causal"])
def test_mla_unpadded_values_match_padded(mask_type, monkeypatch):
    """MLA with values unpadded (SDPA's math kernel here, as a GPU's cuDNN would take them)
    against padded (the flash kernel): output, input gradient and every parameter gradient in
    float32 within 1e-5 of the largest entry (two kernels summing the same products in another
    order: ~1e-7 measured), causal (the is_causal flag) and block-causal (a boolean mask). The
    unpadded plan runs with cuDNN first in the priority, as on a GPU, and compiles into one
    graph (``fullgraph=True``: the priority context and the constant plan trace). Negative
    control: padding on the wrong side of v, a bug the slice after SDPA would not hide, is off
    by orders of magnitude. Debug shapes (16 heads of 48/32, 16 tokens) suffice: the claim is
    the code path, not the size."""
    padded = _mla_fwd_bwd(mask_type, ValueHeadPlan(pad=True, kernel="flash"), monkeypatch)
    unpadded_plan = ValueHeadPlan(pad=False, kernel="cudnn", cudnn_first=True)
    unpadded = _mla_fwd_bwd(mask_type, unpadded_plan, monkeypatch)
    assert _rel(unpadded[0], padded[0]) <= 1e-5 and _max_rel(unpadded[1], padded[1]) <= 1e-5
    compiled = _mla_fwd_bwd(mask_type, unpadded_plan, monkeypatch, compile=True)
    assert _rel(compiled[0], padded[0]) <= 1e-5 and _max_rel(compiled[1], padded[1]) <= 1e-5
    wrong = _mla_fwd_bwd(mask_type, ValueHeadPlan(pad=True, kernel="flash"), monkeypatch, wrong_pad=True)
    assert _rel(wrong[0], padded[0]) > 1e-2


def test_kernels_line(monkeypatch):
    """The start-up line names what the forward runs, asked of the same functions: on this CPU
    op-by-op norms and padded MLA values (flash); on a GPU whose SDPA gives narrow values to
    cuDNN, fused norms and unpadded values (the backend choice is faked; the norm path is the
    function the module calls)."""
    llama = build_model("llama3", "debugmodel", device="cpu", n_layers=1)
    deepseek = build_model("deepseek_v3", "debugmodel", device="cpu", n_layers=1)
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    assert kernels_line([llama], cpu, bf16) == "kernels: rms_norm op by op (no fused kernel on cpu); attention sdpa"
    assert kernels_line([deepseek], cpu, bf16) == (
        "kernels: rms_norm op by op (no fused kernel on cpu); attention sdpa, MLA V padded 32->48 (flash)"
    )
    monkeypatch.setattr(attention, "_probe", lambda *key: ValueHeadPlan(False, "cudnn", True))
    assert kernels_line([deepseek], torch.device("cuda"), bf16) == (
        "kernels: rms_norm fused (F.rms_norm); attention sdpa, MLA V unpadded (cudnn)"
    )


def test_flex_takes_narrow_values():
    """FlexAttention (compiled, forward: torch 2.13 has no CPU backward) on values narrower than
    q/k, as MLA's flex path now passes them, against SDPA on the same unpadded values and on
    padded ones: fp32, within 1e-5 (measured ~1e-6); the wrong causal alignment (a mask shifted
    by one) as negative control. [2, 2, 32, 48/32]: one flex block per row, a few seconds of
    compilation on a cold inductor cache."""
    from tests.distributed.inductor_probe import skip_without_flex_cpu

    skip_without_flex_cpu()
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 2, 32, 48, generator=g) for _ in range(2))
    v = torch.randn(2, 2, 32, 32, generator=g)
    with torch.no_grad():
        flex = AttentionCore("causal", "flex")
        out = flex(q, k, v, flex.prepare(None, 2, 32, q.device))
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        padded = F.scaled_dot_product_attention(q, k, F.pad(v, (0, 16)), is_causal=True)[..., :32]
        shifted = torch.ones(32, 32, dtype=torch.bool).tril(diagonal=-1)
        shifted[0, 0] = True
        wrong = F.scaled_dot_product_attention(q, k, v, attn_mask=shifted)
    assert out.shape == (2, 2, 32, 32)
    assert _rel(out, ref) <= 1e-5 and _rel(out, padded) <= 1e-5
    assert _rel(wrong, ref) > 1e-2
