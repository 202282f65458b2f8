"""The MoE combine (``combine_routed``: un-permute with an ``index_put_``, one bmm over each
token's ``top_k`` contributions) against the ``index_add`` combine it replaced, the padding flag
of ``GroupedExperts``, and the sequence-wise aux loss's gradient through ``_AuxLossGrad``
against the old mechanism (the aux loss added to the loss), at module level and through the
trainer's ``ModelForward``.

Every comparison of two code paths has a stated bound and a negative control (a deliberately
wrong variant that the same check rejects). Shapes are the smallest that exercise the property:
a few dozen tokens with ``top_k`` of 2-4 give every summation-order difference the bounds
account for; the model-level checks use the DeepSeek debug model cut to 2-3 layers.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from models.common import moe as moe_module
from models.common.experts import GroupedExperts
from models.common.moe import MoE, combine_routed
from models.deepseek_v3.args import deepseek_v3_flavors

pytestmark = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no torch._grouped_mm")

U32, U16 = 2.0**-24, 2.0**-8  # unit roundoff of float32 and bfloat16 (round to nearest)


def _index_add_combine(routed_out, weights, order):
    """The combine MoE.forward ran before: float32 copy of the routed output times the weights
    (permuted to sorted order), ``index_add`` into a zeroed float32 [T, dim]."""
    t, k = weights.shape
    routed_weights = weights.reshape(-1).index_select(0, order).unsqueeze(-1)
    combined = torch.zeros(t, routed_out.shape[-1], dtype=torch.float32, device=routed_out.device)
    return combined.index_add(0, order // k, routed_out.float() * routed_weights)


def _flipped_combine(routed_out, weights, order):
    """Negative control: each token's weights applied to the wrong picks."""
    return combine_routed(routed_out, weights.flip(1), order)


def _routing(t=48, k=4, e=8, d=32, dtype=torch.float32, seed=0):
    """Routed outputs in expert-sorted order, normalized positive weights and the sort order of
    ``t`` tokens picking ``k`` distinct experts of ``e``."""
    g = torch.Generator().manual_seed(seed)
    picks = torch.rand(t, e, generator=g).topk(k, dim=-1).indices
    order = torch.argsort(picks.reshape(-1), stable=True)
    weights = torch.rand(t, k, generator=g) + 0.1
    weights = weights / weights.sum(-1, keepdim=True)
    routed_out = torch.randn(t * k, d, generator=g).to(dtype)
    return routed_out, weights, order


def _exact(routed_out, weights, order):
    """float64 combine of the same (already rounded) inputs, and sum_j |w_j y_j| per element."""
    t, k = weights.shape
    y = torch.empty_like(routed_out, dtype=torch.float64)
    y[order] = routed_out.double()
    terms = weights.double().unsqueeze(-1) * y.view(t, k, -1)
    return terms.sum(1), terms.abs().sum(1)


def test_combine_float32_equals_index_add_within_summation_order_bound():
    """float32: the bmm and the index_add differ only in the order (and fusing) of each token's
    k products and k-1 additions, so each is within ``k u sum_j |w_j y_j|`` of the exact sum
    and they are within twice that of each other. The same holds for both gradients: dy is one
    product (w g) either way; dw is a dot product over ``dim``, within ``2 dim u sum |g y|``.
    Flipping the weights (the negative control) breaks the bound."""
    routed_out, weights, order = _routing()
    t, k = weights.shape
    d = routed_out.shape[-1]
    _, magnitude = _exact(routed_out, weights, order)
    cot = torch.randn(t, d, generator=torch.Generator().manual_seed(5))

    def run(fn):
        y, w = routed_out.clone().requires_grad_(), weights.clone().requires_grad_()
        out = fn(y, w, order)
        (out.float() * cot).sum().backward()
        return out.detach().double(), y.grad.double(), w.grad.double()

    new, old = run(combine_routed), run(_index_add_combine)
    assert new[0].dtype == torch.float64 and combine_routed(routed_out, weights, order).dtype == torch.float32
    assert ((new[0] - old[0]).abs() <= 2 * k * U32 * magnitude).all()
    y_sorted = torch.empty_like(routed_out, dtype=torch.float64)
    y_sorted[order] = routed_out.double()
    dw_mag = (cot.double().unsqueeze(1) * y_sorted.view(t, k, d)).abs().sum(-1)
    assert ((new[2] - old[2]).abs() <= 2 * d * U32 * dw_mag).all()
    dy_mag = (weights.double().reshape(-1)[order].unsqueeze(-1) * cot.double()[order // k]).abs()
    assert ((new[1] - old[1]).abs() <= 2 * U32 * dy_mag).all()
    # negative control: the same bound rejects a combine that pairs weights with the wrong picks
    wrong = run(_flipped_combine)
    assert not ((wrong[0] - old[0]).abs() <= 2 * k * U32 * magnitude).all()


def test_combine_bfloat16_within_bf16_bound():
    """bfloat16 expert outputs, float32 weights. The bmm rounds each weight to bf16 (relative
    error ``u = 2^-8``), forms the products exactly in its float32 accumulator (8-bit x 8-bit
    significands), sums them in float32 and rounds once to bf16: within
    ``u (sum_j |w_j y_j| + |exact|)`` (+ float32 summation error) of the float64 sum of the same
    inputs. The old combine (float32 weights, one final rounding) is within ``u |exact|``, and
    the two within the sum of both bounds. Negative control: flipped weights fail."""
    routed_out, weights, order = _routing(dtype=torch.bfloat16)
    k = weights.shape[1]
    exact, magnitude = _exact(routed_out, weights, order)
    new = combine_routed(routed_out, weights, order)
    old = _index_add_combine(routed_out, weights, order).bfloat16()
    assert new.dtype == torch.bfloat16
    fp32 = k * U32 * magnitude
    new_bound = U16 * (magnitude + exact.abs()) + fp32
    old_bound = U16 * exact.abs() + fp32
    assert ((new.double() - exact).abs() <= new_bound).all()
    assert ((old.double() - exact).abs() <= old_bound).all()
    assert ((new.double() - old.double()).abs() <= new_bound + old_bound).all()
    wrong = _flipped_combine(routed_out, weights, order)
    assert not ((wrong.double() - exact).abs() <= new_bound).all()


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]
)
def test_combine_is_deterministic(device):
    """Same inputs, same bits, forward and both gradients: the un-permute writes each row once
    and its backward gathers (no atomics); the bmm reduces in a fixed order. (On CUDA the old
    index_add added a token's rows with atomics in no fixed order.) 1024 tokens x top 8 on a
    GPU give the atomics' ordering room to vary; on CPU, a smoke test of the same property."""
    t = 1024 if device == "cuda" else 64
    routed_out, weights, order = _routing(t=t, k=8, e=16, d=64, dtype=torch.bfloat16)
    routed_out, weights, order = routed_out.to(device), weights.to(device), order.to(device)
    cot = torch.randn(t, 64, device=device)

    def run():
        y, w = routed_out.clone().requires_grad_(), weights.clone().requires_grad_()
        out = combine_routed(y, w, order)
        (out.float() * cot).sum().backward()
        return out, y.grad, w.grad

    first, second = run(), run()
    for a, b in zip(first, second):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------ the MoE module
DIM, HIDDEN = 32, 16


def _moe_args(**overrides):
    base = dataclasses.replace(deepseek_v3_flavors["debugmodel"], dim=DIM, moe_inter_dim=HIDDEN)
    return dataclasses.replace(base, **overrides)


def _moe_grads(moe, x, cot, loss_extra=None):
    moe.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    out = moe(x)
    loss = (out * cot).sum()
    if loss_extra is not None:
        loss = loss + loss_extra()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in moe.named_parameters()}
    grads["x"] = x.grad.clone()
    return out.detach(), grads


def _close(a: dict, b: dict, rtol: float, atol_scale: float) -> bool:
    return all(torch.allclose(a[n], b[n], rtol=rtol, atol=atol_scale * b[n].abs().max().item()) for n in b)


def test_moe_with_new_combine_matches_old_combine(monkeypatch):
    """The MoE wired to the new combine (sort order, weights, has_padding=False) gives the old
    combine's output and gradients within float32 rounding (rtol 1e-5: summation order of k=2
    terms and of the weights' dot products, amplified by at most a few ops downstream); the
    same MoE with the combine's weights flipped does not."""
    torch.manual_seed(0)
    moe = MoE(_moe_args())
    x = torch.randn(2, 16, DIM)
    cot = torch.randn(2, 16, DIM)
    new = _moe_grads(moe, x, cot)
    monkeypatch.setattr(moe_module, "combine_routed", _index_add_combine)
    old = _moe_grads(moe, x, cot)
    torch.testing.assert_close(new[0], old[0], rtol=1e-5, atol=1e-6)
    assert _close(new[1], old[1], rtol=1e-5, atol_scale=1e-6)
    monkeypatch.setattr(moe_module, "combine_routed", _flipped_combine)
    wrong = _moe_grads(moe, x, cot)
    assert not torch.allclose(wrong[0], old[0], rtol=1e-5, atol=1e-6)


class _OpNames(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func._overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("grouped", [True, False])
def test_has_padding_false_skips_the_mask_and_checks_the_statement(grouped):
    """``has_padding=False`` (what MoE passes): the grouped path runs no padding mask (no
    ``where``, forward or backward) and gives bitwise the masked path's results (same grouped
    GEMMs on the same rows; the mask only touches rows past the counts). An input that does
    have padding rows is refused: on device on the grouped path (RuntimeError on CPU), with a
    ValueError on the loop path."""
    torch.manual_seed(0)
    experts = GroupedExperts(DIM, HIDDEN, 4, use_grouped_mm=grouped)
    counts = torch.tensor([3, 0, 5, 2])
    x = torch.randn(10, DIM)
    results = {}
    for has_padding in (True, False):
        xi = x.clone().requires_grad_()
        experts.zero_grad(set_to_none=True)
        with _OpNames() as ops:
            out = experts(xi, counts, has_padding=has_padding)
            out.backward(torch.ones_like(out))
        results[has_padding] = [out, xi.grad, *(p.grad for p in experts.parameters())]
        if grouped:
            assert ops.names.count("where") == (3 if has_padding else 0), ops.names
    for a, b in zip(results[True], results[False]):
        assert torch.equal(a, b)
    padded = torch.randn(12, DIM)
    with pytest.raises(RuntimeError if grouped else ValueError, match="has_padding=False"):
        experts(padded, counts, has_padding=False)
    experts(padded, counts)  # the default still accepts (and masks) padding rows


# ------------------------------------------------------------------------------ the aux loss
def _capture_aux(monkeypatch):
    """The old mechanism: the MoE's aux_sum (with its graph) handed back to the caller, who adds
    it to the loss; the output passes through untouched."""
    captured = []

    def old_apply(out, aux_sum, sequences):
        captured.append(aux_sum)
        return out

    monkeypatch.setattr(moe_module._AuxLossGrad, "apply", old_apply)
    return captured


def test_aux_loss_gradient_equals_adding_it_to_the_loss(monkeypatch):
    """New: ``_AuxLossGrad`` gives aux_sum the gradient ``1 / aux_loss_sequences`` in backward.
    Old: ``loss + aux_sum / sequences``. Same router, same scores, same ops; only the order in
    which autograd adds the two gradient contributions of the router's scores (and of x) may
    differ, a float32 rounding or two: rtol 1e-5 with an absolute floor of 1e-6 x the largest
    entry. The aux term carries real weight here (coefficient 0.5, main loss scaled by 1e-2), so
    the negative controls (no division by the sequence count; twice the coefficient) miss the
    reference by far more than the tolerance. The reported value (``aux_loss_total``) is the old
    aux_sum, bitwise."""
    sequences, coeff = 4, 0.5
    torch.manual_seed(0)
    moe = MoE(_moe_args(aux_loss_coeff=coeff))
    x = torch.randn(3, 8, DIM)
    cot = 1e-2 * torch.randn(3, 8, DIM)

    def new_grads(divisor, c=coeff):
        moe.aux_loss_coeff, moe.aux_loss_sequences = c, divisor
        moe.aux_loss_total.zero_()
        return _moe_grads(moe, x, cot)

    got = new_grads(sequences)
    reported = moe.aux_loss_total.clone()
    with monkeypatch.context() as m:
        captured = _capture_aux(m)
        moe.aux_loss_coeff = coeff
        ref = _moe_grads(moe, x, cot, loss_extra=lambda: captured[-1] / sequences)
    assert torch.equal(reported, captured[-1].detach())
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=0)  # the forward is untouched
    assert _close(got[1], ref[1], rtol=1e-5, atol_scale=1e-6)
    without_aux = new_grads(sequences, 0.0)[1]["router.gate.weight"]
    aux_share = (ref[1]["router.gate.weight"] - without_aux).abs().max()
    assert aux_share > 0.1 * ref[1]["router.gate.weight"].abs().max()  # the aux term matters here
    for wrong in (new_grads(1), new_grads(sequences, 2 * coeff)):  # no division; wrong coefficient
        assert not _close(wrong[1], ref[1], rtol=1e-5, atol_scale=1e-6)


def test_model_forward_reports_and_trains_the_aux_loss_as_before(monkeypatch, tmp_path):
    """Through the trainer's ``ModelForward`` (one process, gloo world of 1): the reported loss
    is the old one (cross-entropy / tokens + each MoE layer's aux_sum / sequences, bitwise:
    the same float32 additions in the same order) and the gradients equal the old mechanism's
    (the aux sums added to the loss before the backward) within float32 rounding (see the
    module-level test). DeepSeek debug model cut to 3 layers (one dense, two MoE), float32."""
    import torch.distributed as dist

    from models.registry import build_model
    from parallel_dims import ParallelDims
    from trainer.forward import ModelForward, cross_entropy_sum

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    vocab, seq, batch, sequences = 64, 16, 2, 8
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        pd = ParallelDims(world_size=1, dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1)
        pd.build_mesh("cpu")
        torch.manual_seed(0)
        model = build_model(
            "deepseek_v3", "debugmodel", device="cpu", n_layers=3, vocab_size=vocab, max_seq_len=seq, aux_loss_coeff=0.1
        )
        model.init_weights(0)
        moes = model.moe_layers()
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(1))
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        gt = batch * seq
        forward = ModelForward(pd, [model], cross_entropy_sum, torch.device("cpu"), loss_parallel=False)

        def grads():
            out = {n: p.grad.clone() for n, p in model.named_parameters()}
            model.zero_grad(set_to_none=True)
            return out

        reported = forward(inputs, labels, gt, backward=True, aux_loss_sequences=sequences, moes=moes)
        got = grads()
        assert all(m.aux_loss_sequences == sequences for m in moes)
        with monkeypatch.context() as m:
            captured = _capture_aux(m)
            loss = cross_entropy_sum(model(inputs), labels) / gt
            for aux_sum in captured:
                loss = loss + aux_sum / sequences
            loss.backward()
        ref = grads()
        assert len(captured) == len(moes) == 2
        assert torch.equal(reported, loss.detach().float())
        assert _close(got, ref, rtol=1e-5, atol_scale=1e-6)
        # evaluation (no aux_loss_sequences): the reported loss is the cross-entropy alone
        with torch.no_grad():
            plain = forward(inputs, labels, gt, backward=False)
        assert torch.equal(plain, (cross_entropy_sum(model(inputs), labels) / gt).detach().float())
    finally:
        dist.destroy_process_group()
