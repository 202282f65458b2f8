"""Muon and parameter groups on a float8 model (``model.converters = ["float8"]``), one process:
the llama3 debug model converted by models/parallel/float8.py (torchao ``Float8Linear``: every
linear but the output head), three optimizer steps of Muon with three parameter groups.

- The groups' FQNs are the same with and without float8: the start-up summary (each group's
  optimizer, tensor and parameter counts) is identical; Muon's parameters are exactly the
  float8 linears' weights minus the table that routes ``w2`` to AdamW (the head, the only
  linear float8 keeps, goes to AdamW by default).
- Muon updates a float8 weight as it updates a plain one: after the first step (zero momentum,
  Nesterov: U = (1 + mu) G) every Muon weight is W0 (1 - lr wd) - lr r sqrt(max(m, n)) NS(U) (r = ``muon_update_rms``),
  computed here from the weight's own gradient, within 1e-6 (weights up to 0.0625 moved by up to
  6e-4; measured 7.5e-9, float32 round-off of the different operation order); negative control:
  the same check with the gradient of another block's weight of the same shape is off by 4.5e-4.
- With the weights wrapped for FSDP's float8 all-gather (torchao's
  ``WeightWithDynamicFloat8CastTensor``, what FSDP shards when
  ``float8.enable_fsdp_float8_all_gather`` is on) the three steps' losses and final weights are
  bitwise the plain float8 run's.
"""

from __future__ import annotations

import math

import pytest
import torch

from models.parallel.float8 import Float8Options, convert_to_float8
from models.registry import build_model
from trainer.config import load_config
from trainer.optim.muon import Muon, newton_schulz
from trainer.optim.optimizers import build_optimizer

pytest.importorskip("torchao.float8")

GROUPS = "[{pattern = 'norm', lr_mult = 2.0}, {pattern = 'attention.wo', weight_decay = 0.0}, {pattern = 'w2', optimizer = 'AdamW'}]"
CFG = load_config(["--config", "llama3.toml", "--model.n_layers", "2", "--optimizer.name", "Muon",
                   "--optimizer.param_groups", GROUPS])  # fmt: skip


def _run(float8: bool, all_gather: bool = False, steps: int = 3):
    torch.manual_seed(0)
    model = build_model("llama3", "debugmodel", device="cpu", n_layers=2)
    if float8:
        convert_to_float8(model, Float8Options(), fsdp_all_gather=all_gather)
    opt = build_optimizer([model], CFG)
    tokens = torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(1))
    w0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    losses, grads0 = [], None
    for _ in range(steps):
        loss = model(tokens).float().logsumexp(-1).mean()
        loss.backward()
        if grads0 is None:
            grads0 = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if len(losses) == 1:
            w1 = {n: p.detach().clone() for n, p in model.named_parameters()}
    return model, opt, losses, w0, grads0, w1


@pytest.fixture(scope="module")
def runs():
    return {"plain": _run(False), "float8": _run(True), "float8_ag": _run(True, all_gather=True)}


def test_groups_match_the_same_fqns_and_muon_takes_the_float8_weights(runs):
    from torchao.float8.float8_linear import Float8Linear

    assert runs["float8"][1].summary == runs["plain"][1].summary
    model, opt = runs["float8"][0], runs["float8"][1]
    f8 = {f"{fqn}.weight" for fqn, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert len(f8) == 14  # 7 linears per block, 2 blocks; the head stays nn.Linear
    names = {id(p): n for n, p in model.named_parameters()}
    muon = {names[id(p)] for o in opt.optimizers if isinstance(o, Muon) for g in o.param_groups for p in g["params"]}
    assert muon == {n for n in f8 if ".w2." not in n}


def _expected_first_step(w0, g):
    mu, lr, wd = CFG.optimizer.muon_momentum, CFG.optimizer.lr, CFG.optimizer.weight_decay
    scale = CFG.optimizer.muon_update_rms * math.sqrt(max(w0.shape))
    return w0 * (1 - lr * wd) - lr * scale * newton_schulz((1 + mu) * g, 5)


def test_first_muon_step_on_float8_weights_is_the_algorithm(runs):
    _, _, _, w0, g, w1 = runs["float8"]
    checked = 0
    for n in ("layers.0.attention.wq.weight", "layers.1.feed_forward.w1.weight", "layers.0.attention.wk.weight"):
        err = (w1[n] - _expected_first_step(w0[n], g[n])).abs().max().item()
        assert err <= 1e-6, (n, err)
        checked += 1
    # negative control: another block's gradient of the same shape
    n, other = "layers.0.attention.wq.weight", "layers.1.attention.wq.weight"
    assert (w1[n] - _expected_first_step(w0[n], g[other])).abs().max().item() > 1e-4  # measured 4.5e-4
    assert checked == 3


def test_fsdp_float8_all_gather_weights_step_bitwise_like_plain_float8(runs):
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    model_ag = runs["float8_ag"][0]
    assert any(isinstance(p, WeightWithDynamicFloat8CastTensor) for p in model_ag.parameters())
    assert runs["float8_ag"][2] == runs["float8"][2]
    for (n, a), (_, b) in zip(runs["float8"][0].named_parameters(), model_ag.named_parameters()):
        assert torch.equal(
            a.detach(), b.detach().as_subclass(torch.Tensor) if type(b) is not torch.nn.Parameter else b.detach()
        ), n
    assert runs["float8"][2][-1] < runs["float8"][2][0]  # it trains
