"""Muon's update scale: one Muon step's update has an RMS of about ``update_rms`` per unit lr at
every shape, and ``update_rms = 1.0`` gives it the RMS of AdamW's first update
(docs/optimizers.md#muon, where the loss curves at AdamW's lr are measured; the default stays
Moonlight's 0.2).

The update is W0 - W1 over lr after one step from zero momentum without weight decay: Muon
scales the orthogonalised update O (RMS about 1/sqrt(max(m, n)) when its singular values are
near 1) by ``update_rms`` x sqrt(max(m, n)), so its RMS is ``update_rms`` times the mean square
singular value of O. On full-rank Gaussian gradients that factor is 0.85-0.95 here (measured
0.852-0.954 over the shapes below, Jordan's Newton-Schulz leaves singular values in about
[0.7, 1.2]), so the test asks for [0.8, 1.0] x ``update_rms``. AdamW's first update is the sign
of the gradient, RMS 1: ``update_rms = 1.0`` (what docs/optimizers.md recommends for small
models at AdamW's lr) puts Muon's within 20% of it.

Negative controls on the same orthogonalised update, against the band of ``update_rms = 1.0``:
Moonlight's r = 0.2 (the default), Keller Jordan's scale sqrt(max(1, m/n)) and the scale
sqrt(min(m, n)) (the wrong dimension) all miss it.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from trainer.config import load_config
from trainer.optim.muon import Muon

pytestmark = pytest.mark.unit

LR = 1e-3
SHAPES = [(64, 256), (256, 64), (128, 128), (2, 48, 96), (256, 768)]  # wide, tall, square, experts, a debug MLP


def _rms(t: torch.Tensor) -> float:
    return t.double().pow(2).mean().sqrt().item()


def _first_update(opt_cls, shape, **kw) -> torch.Tensor:
    torch.manual_seed(0)
    p = nn.Parameter(0.02 * torch.randn(*shape))
    w0 = p.detach().clone()
    p.grad = torch.randn(*shape)
    opt_cls([p], lr=LR, weight_decay=0.0, **kw).step()
    return (w0 - p.detach()) / LR


def test_default_update_rms_is_the_configs():
    """Moonlight's 0.2, in the optimizer and in the config."""
    assert Muon([nn.Parameter(torch.zeros(2, 2))], lr=LR).param_groups[0]["update_rms"] == 0.2
    assert load_config(["--config", "llama3.toml"]).optimizer.muon_update_rms == 0.2


@pytest.mark.parametrize("shape", SHAPES)
def test_update_rms_is_update_rms_at_every_shape(shape):
    m, n = shape[-2:]
    adamw = _rms(_first_update(torch.optim.AdamW, shape))
    assert abs(adamw - 1.0) < 1e-3, adamw  # AdamW's first step: the gradient's sign
    update = _first_update(Muon, shape, update_rms=0.5)
    assert 0.8 <= _rms(update) / 0.5 <= 1.0, _rms(update)
    default = _rms(_first_update(Muon, shape))  # Moonlight's 0.2
    assert 0.8 <= default / 0.2 <= 1.0, default
    muon = _rms(_first_update(Muon, shape, update_rms=1.0))
    assert 0.8 <= muon <= 1.0, muon
    assert abs(muon - adamw) <= 0.2 * adamw, (muon, adamw)
    # negative controls: the same orthogonalised update under other scales
    o = update / (0.5 * math.sqrt(max(m, n)))  # the scale taken out
    wrong = {
        "Moonlight's 0.2 (the default)": 0.2 * math.sqrt(max(m, n)),
        "Jordan's sqrt(max(1, m/n))": math.sqrt(max(1.0, m / n)),
        "sqrt(min(m, n))": math.sqrt(min(m, n)),
    }
    for name, scale in wrong.items():
        if name == "sqrt(min(m, n))" and m == n:
            continue  # the same as the right one on a square matrix
        assert not 0.8 <= _rms(o * scale) <= 1.0, name
