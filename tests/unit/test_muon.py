"""Muon on one process against a direct float64 implementation of the algorithm, and which
parameters Muon takes.

The reference below is written from the papers, not from trainer/optim/muon.py: Nesterov momentum
B <- mu B + G, U <- G + mu B; the Newton-Schulz quintic X <- a X + (b A + c A^2) X with
A = X X^T, from X0 = U / (||U||_F + 1e-7) on the wide orientation, (a, b, c) = (3.4445, -4.775,
2.0315), 5 steps, one matrix at a time (a 3-D expert weight is one matrix per expert); then
W <- W (1 - lr wd) - lr 0.2 sqrt(max(m, n)) O (Moonlight's scale, arXiv:2502.16982 section 2.2).

Tolerance: Muon runs the iteration in float32 and stores W in float32. Measured against float64
the orthogonalised update differs by at most 1.0e-6 (entries up to 0.44), and after three steps
W (entries up to 4.1, float32 spacing 4.8e-7 there) by at most 6.4e-7, i.e. about one float32
step of W: the test allows 4e-6 (8 such steps). Negative controls: the same comparison fails by orders of
magnitude for the easy mistakes (orthogonalising row halves separately, as a per-shard Muon
would; four iterations instead of five; no Nesterov). (Transposing tall matrices is no such
mistake: the odd polynomial gives p(X X^T) X = X p(X^T X); the orientation only sets the
Gram matrix's size, i.e. the cost.)
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from trainer.config import load_config
from trainer.optim.muon import Muon, newton_schulz
from trainer.optim.optimizers import build_optimizer

COEF = (3.4445, -4.775, 2.0315)
LR, WD, MU = 0.02, 0.1, 0.95
TOL = 4e-6  # on W, module docstring


def ref_ns(u: torch.Tensor, steps: int = 5, halves: bool = False) -> torch.Tensor:
    """Direct float64 Newton-Schulz, matrix by matrix (``halves``: the negative control)."""
    a, b, c = COEF
    mats = u.double().reshape(-1, *u.shape[-2:])
    out = []
    for g in mats:
        if halves:
            h = g.shape[0] // 2
            out.append(torch.cat([ref_ns(g[:h], steps), ref_ns(g[h:], steps)]))
            continue
        tall = g.shape[0] > g.shape[1]
        x = g.T if tall else g
        x = x / (torch.sqrt((x * x).sum()) + 1e-7)
        for _ in range(steps):
            gram = x @ x.T
            x = a * x + (b * gram + c * gram @ gram) @ x
        out.append(x.T if tall else x)
    return torch.stack(out).reshape(u.shape)


def ref_muon(w0, grads, nesterov=True, **ns):
    """Float64 trajectory of one parameter under the gradients ``grads``."""
    w, buf = w0.double().clone(), torch.zeros_like(w0, dtype=torch.float64)
    scale = 0.2 * math.sqrt(max(w0.shape[-2], w0.shape[-1]))
    for g in grads:
        g = g.double()
        buf = MU * buf + g
        u = g + MU * buf if nesterov else buf
        w = w * (1 - LR * WD) - LR * scale * ref_ns(u, **ns)
    return w


SHAPES = [(64, 32), (32, 96), (4, 48, 40)]  # tall, wide, 4 experts of a tall matrix


def _muon_trajectory(shape):
    torch.manual_seed(0)
    w0 = torch.randn(*shape)
    grads = [torch.randn(*shape) for _ in range(3)]
    p = nn.Parameter(w0.clone())
    opt = Muon([p], lr=LR, weight_decay=WD, momentum=MU)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return w0, grads, p.detach()


def _gap(got, ref) -> float:
    return (got.double() - ref).abs().max().item()


@pytest.mark.parametrize("shape", SHAPES)
def test_muon_matches_a_float64_implementation(shape):
    w0, grads, got = _muon_trajectory(shape)
    gap = _gap(got, ref_muon(w0, grads))
    assert gap < TOL, gap
    # negative controls: each plausible mistake is orders of magnitude beyond the tolerance
    mistakes = {"row halves (per shard)": dict(halves=True), "four steps": dict(steps=4)}
    for name, kw in mistakes.items():
        assert _gap(got, ref_muon(w0, grads, **kw)) > 100 * TOL, name
    assert _gap(got, ref_muon(w0, grads, nesterov=False)) > 100 * TOL


def test_newton_schulz_output_is_nearly_orthogonal():
    """What the iteration is for: the singular values of NS(U) lie in about [0.7, 1.2]
    (Jordan's design target), for a spectrum spread over two decades (the smallest singular value of the normalised
    U is then 5e-3: five steps amplify small values by up to a^5 = 485)."""
    torch.manual_seed(1)
    q1, _ = torch.linalg.qr(torch.randn(48, 48))
    q2, _ = torch.linalg.qr(torch.randn(32, 32))
    u = q1[:, :32] @ torch.diag(torch.logspace(-1, 1, 32)) @ q2
    s = torch.linalg.svdvals(newton_schulz(u, 5))
    assert s.min() > 0.6 and s.max() < 1.25, s


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(16, 8)
        self.layers = nn.ModuleDict({"0": nn.Linear(8, 8)})
        self.experts = nn.Parameter(torch.randn(2, 8, 4))
        self.norm = nn.LayerNorm(8)
        self.output = nn.Linear(8, 16, bias=False)


def _kinds(opt, model):
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: type(o).__name__ for o in opt.optimizers for g in o.param_groups for p in g["params"]}


def test_muon_takes_hidden_matrices_and_adamw_the_rest():
    model = Block()
    opt = build_optimizer([model], load_config(["--config", "llama3.toml", "--optimizer.name", "Muon"]))
    assert _kinds(opt, model) == {
        "tok_embeddings.weight": "AdamW",
        "layers.0.weight": "Muon",
        "layers.0.bias": "AdamW",
        "experts": "Muon",
        "norm.weight": "AdamW",
        "norm.bias": "AdamW",
        "output.weight": "AdamW",
    }
    assert not opt.skips_on_device  # Muon cannot skip a step on the device
    # a group routes the experts to AdamW and the head to Muon
    groups = "[{pattern = '^experts', optimizer = 'AdamW'}, {pattern = '^output', optimizer = 'Muon'}]"
    c = load_config(["--config", "llama3.toml", "--optimizer.name", "Muon", "--optimizer.param_groups", groups])
    kinds = _kinds(build_optimizer([model], c), model)
    assert kinds["experts"] == "AdamW" and kinds["output.weight"] == "Muon" and kinds["layers.0.weight"] == "Muon"
    bad = "[{pattern = 'norm', optimizer = 'Muon'}]"
    c = load_config(["--config", "llama3.toml", "--optimizer.name", "Muon", "--optimizer.param_groups", bad])
    with pytest.raises(ValueError, match=r"routes norm.weight \(1-D\) to Muon"):
        build_optimizer([model], c)
