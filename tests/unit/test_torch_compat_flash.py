"""The ``cpu_flash_attention_pack`` guard (parallel_dims/torch_compat_flash.py) as the models run
it: registered exactly where torch's own CPU flash attention kernel fails, and then still flash
attention. Natively (an AVX-512 ATen build, or a host without AMX) it checks that nothing is
registered; under ``ATEN_CPU_CAPABILITY=default`` on an AMX host (the kernel lane's setting) it
checks the guarded kernel. Its row's version column is checked in test_torch_compat.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from parallel_dims import torch_compat


def test_cpu_flash_attention_guard_is_installed_exactly_where_torchs_kernel_fails():
    """The cpu_flash_attention_pack guard, which importing the models installs, is registered in
    this process exactly when torch's own CPU flash attention kernel fails for a reduced dtype
    here (natively on an AVX-512 ATen build: never; under ``ATEN_CPU_CAPABILITY=default`` on an
    AMX host: bfloat16, torch's kernel still failing beneath the guard), and what every caller
    of ``scaled_dot_product_attention`` then gets is flash attention: the same autograd node
    (its output and logsumexp saved, what the planner's activation model counts), forward and
    backward at a shape torch packs, oneDNN's switch back on after the call, and the attention
    it computes: within bfloat16 rounding of float32 math on the same bfloat16 inputs. The
    kernel computes the scores and the softmax in float32 (products of bfloat16 values are exact
    there), then rounds twice to bfloat16 (8 significant bits: a rounding is off by at most 2^-8
    of its value): the unnormalized probabilities before their GEMM with the values (the
    normalized sum off by at most 2^-8 * max|v|, the weights summing to 1) and the output (at
    most 2^-8 * |out| <= 2^-8 * max|v|): at most 2^-7 * max|v| together, float32's own error
    (about 2^-20 of it here) far below. Negative control: the non-causal attention of the same
    inputs is outside that bound."""
    import models.common.attention  # noqa: F401 (installs the guard at import)
    from parallel_dims import torch_compat_flash

    fails = tuple(dt for dt in (torch.bfloat16, torch.float16) if torch_compat.flash_attention_pack_fails(dt))
    assert (torch_compat_flash._flash_cpu_library is not None) == bool(fails)  # by the import
    assert torch_compat.guard_cpu_flash_attention() == fails

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 64, 64, generator=g).to(torch.bfloat16).requires_grad_() for _ in range(3))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.grad_fn.name() == "ScaledDotProductFlashAttentionForCpuBackward0"
    out.float().square().sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))
    assert torch.backends.mkldnn.enabled

    q32, k32, v32 = (t.detach().float() for t in (q, k, v))
    bound = 2.0**-7 * v32.abs().max().item()
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        ref = F.scaled_dot_product_attention(q32, k32, v32, is_causal=True)
        wrong = F.scaled_dot_product_attention(q32, k32, v32, is_causal=False)
    assert (out.detach().float() - ref).abs().max().item() <= bound
    assert (out.detach().float() - wrong).abs().max().item() > bound
