"""The mixed-precision bare loop of `make bench-gpu` (benchmarks/gpu_bare.py, recipe ``mixed``) is
the trainer's recipe written out by hand, the reference for the framework's overhead: these
tests prove, on CPU with autocast off, that its step keeps fp32 master weights and fp32 AdamW
state, casts them once into bf16 compute copies, runs every GEMM of forward and backward in
bf16, hands fp32 copies of the bf16 gradients to the masters, clips them to the total norm and
updates the masters in fp32; each check with a negative control that a wrong recipe fails.

Shapes: the Llama 3 debug model cut to 1 layer of width 256 with a vocabulary of 256, 2 x 16
tokens: every kind of GEMM of the real model (attention projections, SDPA, the SwiGLU MLP, the
output head) runs forward and backward, and the recipe's properties do not depend on size."""

from __future__ import annotations

import pytest
import torch

from benchmarks.gpu_bare import BareStep
from trainer.instruments.matmul_census import MatmulCensus

VOCAB, BATCH, SEQ = 256, 2, 16


def _model():
    from models.registry import build_model

    torch.manual_seed(0)
    model = build_model("llama3", "debugmodel", device="meta", n_layers=1, vocab_size=VOCAB, max_seq_len=SEQ)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(0)
    return model


def _batch(seed: int):
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], tokens[:, 1:]


def _loop(recipe: str, max_norm: float = 1.0) -> BareStep:
    return BareStep(_model(), recipe, ac_mode="selective", compile=False, n_tokens=BATCH * SEQ, max_norm=max_norm)


def test_mixed_step_keeps_fp32_masters_and_runs_its_gemms_in_bf16():
    """Three steps under the matmul census (autocast off: nothing but the loop's own casts picks
    a dtype): every GEMM FLOP is bf16; masters, their gradients and AdamW's moments are fp32; the
    compute copies are bf16 and, at each step's start, exactly the masters rounded to bf16 (the
    same fp32 -> bf16 rounding on both sides). Negative control: the same census over the fp32
    masters' model (no cast) sees no bf16 GEMM, so the census tells the recipes apart."""
    assert not torch.is_autocast_enabled("cpu")
    loop = _loop("mixed")
    assert loop.compute is not None and loop.compute_params[0] is not loop.masters[0]
    with MatmulCensus() as census:
        for i in range(3):
            loop.cast_in()
            for m, c in zip(loop.masters, loop.compute_params):
                assert torch.equal(c, m.detach().to(torch.bfloat16))
            loop.step(*_batch(i))
    assert census.share(torch.bfloat16) == 1.0
    assert {p.dtype for p in loop.masters} == {torch.float32}
    assert {p.grad.dtype for p in loop.masters if p.grad is not None} == {torch.float32}
    assert {p.dtype for p in loop.compute_params} == {torch.bfloat16}
    assert all(p.grad is None for p in loop.compute_params)  # freed once handed to the masters
    states = [s for s in loop.optimizer.state.values()]
    assert len(states) == len(loop.masters)
    assert {s[k].dtype for s in states for k in ("exp_avg", "exp_avg_sq")} == {torch.float32}

    masters_model = _model()  # the negative control: fp32 parameters, no compute copy
    with MatmulCensus() as control:
        masters_model(_batch(0)[0]).float().sum().backward()
    assert control.share(torch.bfloat16) == 0.0 and control.share(torch.float32) == 1.0


def test_mixed_step_updates_fp32_masters_from_fp32_copies_of_the_bf16_grads():
    """One step in parts: the masters' gradients are the bf16 gradients widened exactly to fp32;
    clipping (max_norm 1e-3, far below this model's gradient norm, so it clips) leaves them a total
    norm of max_norm (one _foreach_norm); the optimizer's update equals torch's single-tensor
    AdamW on fp32 copies of the same masters and gradients.

    Tolerance: 1e-6 relative to each tensor's largest weight (foreach and single-tensor AdamW do
    the same fp32 arithmetic per element in the same order, 0 measured here; kept as a tolerance
    because they are different code paths).
    Negative control: the same reference applied to bf16 masters (the ``bf16`` recipe's state)
    misses the fp32 result by orders of magnitude more than the tolerance."""
    loop = _loop("mixed", max_norm=1e-3)
    loop.cast_in()
    loop.forward_backward(*_batch(0))
    bf16_grads = [None if p.grad is None else p.grad.clone() for p in loop.compute_params]
    assert all(g is not None and g.dtype == torch.bfloat16 for g in bf16_grads)
    loop.grads_to_masters()
    for m, g in zip(loop.masters, bf16_grads):
        assert m.grad.dtype == torch.float32 and torch.equal(m.grad, g.float())
    norm_before = torch.linalg.vector_norm(torch.stack([g.float().norm() for g in bf16_grads]))
    assert norm_before > 10 * loop.max_norm
    returned = loop.clip()
    assert returned == pytest.approx(norm_before.item(), rel=1e-5)
    clipped = torch.linalg.vector_norm(torch.stack([m.grad.norm() for m in loop.masters]))
    assert clipped.item() == pytest.approx(loop.max_norm, rel=1e-4)

    before = [m.detach().clone() for m in loop.masters]
    grads = [m.grad.clone() for m in loop.masters]
    loop.optimizer_step()

    def reference(dtype):
        params = [torch.nn.Parameter(b.clone().to(dtype)) for b in before]
        for p, g in zip(params, grads):
            p.grad = g.clone().to(dtype)
        opt = torch.optim.AdamW(params, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
        opt.step()
        return [p.detach().float() for p in params]

    def worst(expected):
        return max(((m.detach() - e).abs().max() / e.abs().max()).item() for m, e in zip(loop.masters, expected))

    assert worst(reference(torch.float32)) < 1e-6
    assert worst(reference(torch.bfloat16)) > 1e-4  # bf16 masters: the wrong recipe is caught
    # the RMSNorm weights (1.0) moved by about lr = 3e-4, below bf16's spacing at 1.0 (2^-7): only
    # fp32 masters keep such an update, bf16 parameters would round it away
    norms = [(m, b) for m, b in zip(loop.masters, before) if m.dim() == 1 and torch.all(b == 1.0)]
    assert norms
    for m, b in norms:
        assert not torch.equal(m.detach(), b) and torch.equal(m.detach().to(torch.bfloat16), b.to(torch.bfloat16))


def test_bf16_recipe_is_the_pure_bf16_loop():
    """The second reference: parameters, gradients and AdamW state all bf16, its GEMMs bf16 (the
    other side of the first test's contrast: only the mixed recipe keeps fp32 masters)."""
    loop = _loop("bf16")
    with MatmulCensus() as census:
        loop.step(*_batch(0))
    assert census.share(torch.bfloat16) == 1.0
    assert {p.dtype for p in loop.masters} == {torch.bfloat16}
    assert {s["exp_avg"].dtype for s in loop.optimizer.state.values()} == {torch.bfloat16}
    with pytest.raises(ValueError, match="not one of mixed, bf16"):
        BareStep(_model(), "fp16", ac_mode="none", compile=False, n_tokens=1)
