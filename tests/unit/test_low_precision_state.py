"""bf16 optimizer state (``optimizer.state_dtype = "bfloat16"``, trainer/optim/low_precision.py).

- Stochastic rounding is unbiased: the mean rounding error over 20,000 values x 32 draws is
  within 5 standard deviations of 0, the deviation computed from each value's own variance
  p (1 - p) ulp^2 (a Bernoulli per draw); constant bits (truncation) are 100 deviations off. Negative control: the EMA ``v <- b2 v + (1 - b2) c``
  (b2 = 0.999) stored with round-to-nearest freezes far from the fp64 value (each step is under
  half an ulp) while stochastic rounding tracks it within the same kind of bound.
- AdamW with bf16 moments against an fp64 AdamW: the weights within lr T 2^-7 (each step's
  update is off by at most ~1.5 x 2^-8 relative: the moments' rounding, sqrt halving v's) and
  the float32-state path of the same kernel bitwise torch's AdamW; Muon's bf16 momentum against
  fp32 Muon likewise.
- The state is half the bytes, measured on the optimizers the trainer builds (AdamW, and Muon
  with its AdamW part), and :func:`state_bytes_per_param` prices it.
- Checkpoint state: a resume through the state dict is bitwise the uninterrupted run; a float32
  state loads into bf16 state by round-to-nearest, and bf16 into float32 exactly.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from trainer.config import Optimizer as OptimizerConfig
from trainer.optim.low_precision import (
    AdamWLowPrecision,
    high_bits,
    low_bits,
    random_bits,
    salt,
    state_bytes,
    state_bytes_per_param,
    stochastic_round_bf16,
)
from trainer.optim.muon import Muon
from trainer.optim.optimizers import Optimizers

pytestmark = pytest.mark.unit


def _ulp_parts(x: torch.Tensor):
    """(lower bf16 neighbour, ulp, p = fraction of the ulp above it) in float64."""
    i = x.view(torch.int32) & -65536
    lo = i.view(torch.float32).double()
    hi = (i + 65536).view(torch.float32).double()
    return lo, hi - lo, (x.double() - lo) / (hi - lo)


def test_stochastic_rounding_is_unbiased_within_its_variance():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(20000, generator=g) * 3 + 1
    idx = torch.arange(x.numel())
    _, ulp, p = _ulp_parts(x)
    draws = 32
    for half in (low_bits, high_bits):  # the two moments' halves of one hash
        total = torch.zeros_like(ulp)
        for step in range(draws):
            r = stochastic_round_bf16(x, half(random_bits(idx, salt(0, step, 3, 1)))).double()
            assert ((r - x.double()).abs() < ulp).all()  # one of the two neighbours
            total += r
        err = (total / draws - x.double()).sum()
        sd = math.sqrt(float((p * (1 - p) * ulp**2).sum()) / draws)
        assert abs(float(err)) < 5 * sd, (half.__name__, float(err), sd)
    # the control: constant bits (truncation, a biased rounding) are far outside that bound
    zero = stochastic_round_bf16(x, torch.zeros_like(idx, dtype=torch.int32)).double()
    assert (zero - x.double()).sum().abs() > 100 * sd


def test_ema_round_to_nearest_freezes_stochastic_rounding_tracks():
    b2, c, n, steps = 0.999, 0.5, 4096, 400
    idx = torch.arange(n)
    sr = torch.ones(n, dtype=torch.bfloat16)
    rtn = torch.ones(n, dtype=torch.bfloat16)
    for t in range(1, steps + 1):
        sr = stochastic_round_bf16(sr.float() * b2 + (1 - b2) * c, low_bits(random_bits(idx, salt(0, t, 0, 1))))
        rtn = (rtn.float() * b2 + (1 - b2) * c).to(torch.bfloat16)
    exact = c + (1 - c) * b2**steps  # fp64: 0.835
    # SR: each step adds a rounding error of variance <= ulp^2 / 4 (ulp <= 2^-8 below 1), damped
    # by b2 per later step: the stored value's sd <= 2^-9 / sqrt(1 - b2^2); over n values / sqrt(n)
    bound = 5 * 2**-9 / math.sqrt(1 - b2**2) / math.sqrt(n)
    assert abs(sr.double().mean().item() - exact) < bound, (sr.double().mean().item(), exact, bound)
    assert abs(rtn.double().mean().item() - exact) > 20 * bound  # frozen at 1.0
    assert (rtn == 1.0).all()


def _adamw64(w, grads, lr, betas, eps, wd):
    w = w.double().clone()
    m, v = torch.zeros_like(w), torch.zeros_like(w)
    for t, g in enumerate(grads, 1):
        g = g.double()
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        w = w * (1 - lr * wd) - lr / (1 - betas[0] ** t) * m / ((v / (1 - betas[1] ** t)).sqrt() + eps)
    return w


def test_adamw_bf16_moments_against_fp64_and_fp32_path_bitwise_torch():
    torch.manual_seed(0)
    lr, betas, eps, wd, steps = 1e-2, (0.9, 0.95), 1e-8, 0.1, 40
    w0 = torch.randn(64, 64)
    grads = [torch.randn(64, 64) * (1 + t % 3) for t in range(steps)]
    ref = _adamw64(w0, grads, lr, betas, eps, wd)
    out = {}
    for name in ("bf16", "fp32", "torch"):
        p = nn.Parameter(w0.clone())
        if name == "torch":
            opt = torch.optim.AdamW([p], lr=lr, betas=betas, eps=eps, weight_decay=wd, foreach=False)
        else:
            dtype = torch.bfloat16 if name == "bf16" else torch.float32
            opt = AdamWLowPrecision([p], lr=lr, betas=betas, eps=eps, weight_decay=wd, state_dtype=dtype)
        for g in grads:
            p.grad = g.clone()
            opt.step()
        out[name] = p.detach()
        if name == "bf16":
            assert opt.state[p]["exp_avg"].dtype == opt.state[p]["exp_avg_sq"].dtype == torch.bfloat16
    assert torch.equal(out["fp32"], out["torch"])
    err = (out["bf16"].double() - ref).abs().max().item()
    assert err <= lr * steps * 2**-7, err
    assert err > (out["fp32"].double() - ref).abs().max().item()  # the bf16 state does round


def test_muon_bf16_momentum_against_fp32_momentum():
    torch.manual_seed(1)
    lr, steps = 2e-2, 20
    w0 = torch.randn(32, 48)
    grads = [torch.randn(32, 48) for _ in range(steps)]
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        p = nn.Parameter(w0.clone())
        opt = Muon([p], lr=lr, state_dtype=dtype, update_rms=1.0)
        for g in grads:
            p.grad = g.clone()
            opt.step()
        assert opt.state[p]["momentum_buffer"].dtype == dtype
        out[dtype] = p.detach()
    # the momentum's relative rounding (<= 2^-8) moves each orthogonalised update by about as
    # much relative to its RMS (update_rms = 1 per unit lr): <= lr T 2^-6 with margin for NS
    err = (out[torch.bfloat16] - out[torch.float32]).abs().max().item()
    assert 0 < err <= lr * steps * 2**-6, err


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.layers = nn.ModuleList(nn.Linear(16, 16, bias=False) for _ in range(2))
        self.norm = nn.LayerNorm(16)

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.norm(h).sum()


def _trained(name: str, state_dtype: str, steps: int, start: int = 0, model=None, load=None):
    """``steps`` training steps from step ``start`` (the batches are the step's)."""
    torch.manual_seed(0)
    model = model or _Tiny()
    cfg = OptimizerConfig(name=name, state_dtype=state_dtype, lr=1e-2)
    if name == "Muon":
        cfg.param_groups = [{"pattern": r"layers\.", "optimizer": "Muon"}]
    opts = Optimizers([model], cfg)
    if load is not None:
        model.zero_grad()  # as at a trainer's start: no gradients, so DCP materialises the state
        opts.load_state_dict(load)
    for s in range(steps):
        torch.manual_seed(100 + start + s)
        model.zero_grad()
        model(torch.randint(0, 50, (4, 8))).backward()
        opts.step()
    return model, opts


@pytest.mark.parametrize("name", ["AdamW", "Muon"])
def test_state_bytes_halved_measured_and_priced(name):
    measured = {}
    for dtype in ("float32", "bfloat16"):
        _, opts = _trained(name, dtype, 1)
        steps = sum(4 for o in opts.optimizers for st in o.state.values() if "step" in st)
        measured[dtype] = sum(state_bytes(o) for o in opts.optimizers) - steps
        priced = 0
        for o in opts.optimizers:
            kind = "Muon" if isinstance(o, Muon) else "AdamW"
            priced += sum(p.numel() for g in o.param_groups for p in g["params"]) * state_bytes_per_param(kind, dtype)
        assert measured[dtype] == priced, (dtype, measured[dtype], priced)
    assert measured["bfloat16"] * 2 == measured["float32"]


@pytest.mark.parametrize("name", ["AdamW", "Muon"])
def test_resume_through_the_state_dict_is_bitwise(name):
    straight, _ = _trained(name, "bfloat16", 5)
    first, opts = _trained(name, "bfloat16", 3)
    saved = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in opts.state_dict().items()}
    moments = [k for k in saved if k.endswith(("exp_avg", "exp_avg_sq", "momentum_buffer"))]
    assert moments and all(saved[k].dtype == torch.bfloat16 for k in moments)
    resumed, _ = _trained(name, "bfloat16", 2, start=3, model=first, load=saved)
    a, b = straight.state_dict(), resumed.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["layers.0.weight"], _trained(name, "float32", 5)[0].state_dict()["layers.0.weight"])


def test_cross_dtype_state_cast():
    _, fp32 = _trained("AdamW", "float32", 2)
    _, bf16 = _trained("AdamW", "bfloat16", 2)
    sd32, sd16 = fp32.state_dict(), bf16.state_dict()
    _, into16 = _trained("AdamW", "bfloat16", 0, load=sd32)
    _, into32 = _trained("AdamW", "float32", 0, load=sd16)
    got16, got32 = into16.state_dict(), into32.state_dict()
    for k in (k for k in sd32 if k.endswith(("exp_avg", "exp_avg_sq"))):
        assert got16[k].dtype == torch.bfloat16 and torch.equal(got16[k], sd32[k].to(torch.bfloat16)), k
        assert got32[k].dtype == torch.float32 and torch.equal(got32[k], sd16[k].float()), k
