"""Muon (MomentUm Orthogonalized by Newton-Schulz) for the hidden matrices, on every layout.

The algorithm (Keller Jordan, "Muon: An optimizer for hidden layers in neural networks", 2024,
kellerjordan.github.io/posts/muon; Liu et al., "Muon is Scalable for LLM Training", 2025,
arXiv:2502.16982, the Moonlight paper), per parameter W of shape [..., m, n] with gradient G:

    B <- mu B + G                                   (momentum buffer)
    U <- G + mu B   (Nesterov)   or   U <- B         (plain)
    O <- NS_k(U)                                    (per matrix: every leading index, e.g. each expert)
    W <- W (1 - lr wd) - lr * r * sqrt(max(m, n)) * O

NS_k is ``k`` steps of the quintic Newton-Schulz iteration X <- a X + b (X X^T) X + c (X X^T)^2 X
from X0 = U / (||U||_F + 1e-7), on the wide orientation (transposed when m > n), with (a, b, c)
= (3.4445, -4.7750, 2.0315): it drives every singular value of X towards [0.7, 1.2], an
approximate U V^T of U's SVD. The scale r sqrt(max(m, n)) with r = 0.2 is Moonlight's rule
(section 2.2 of the paper): it gives the update the RMS of a typical AdamW update (0.2-0.4), so
AdamW's learning rate and decoupled weight decay carry over unchanged. NS runs in float32 here
(the CPU proofs compare layouts in fp32; Jordan's and Moonlight's code use bfloat16 on GPUs).

Distribution. NS needs each whole matrix; FSDP and TP shard them. Each parameter's update is a
DTensor on the parameter's own mesh (the meshes ParallelDims built for FSDP, TP, EP):
redistributed to placements that replicate the two matrix dimensions and keep every shard of
the leading (expert) dimension, so under EP each rank orthogonalises only its own experts and
under FSDP/TP the matrix is all-gathered over the dimensions that split it; every rank of that
group runs NS on the whole matrix, then keeps its own shard (Replicate -> Shard is a local
slice, no communication). Cost: one all-gather of each sharded matrix per step (the
gradient's size, like FSDP's parameter all-gather), and NS on the whole matrix on every rank of
its sharding group (docs/optimizers.md prices both and compares the round-robin alternative).

``MESHTRAIN_TEST_MUON_PER_SHARD=1`` (a test-only switch, the negative control of the layout
tests) orthogonalises each rank's local shard on its own instead: the easy wrong version,
which tests/e2e/test_muon_layouts.py shows failing the layout comparison.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import torch
from torch.distributed.tensor import DTensor, Replicate

__all__ = ["Muon", "newton_schulz", "orthogonalized_update"]

PER_SHARD_ENV = "MESHTRAIN_TEST_MUON_PER_SHARD"
NS_COEFFICIENTS = (3.4445, -4.775, 2.0315)
_NS_EPS = 1e-7


def newton_schulz(u: torch.Tensor, steps: int, coefficients: Sequence[float] = NS_COEFFICIENTS) -> torch.Tensor:
    """The quintic Newton-Schulz iteration on every matrix of ``u`` ([..., m, n]), in float32."""
    a, b, c = coefficients
    x = u.float()
    wide = x.shape[-2] <= x.shape[-1]
    if not wide:
        x = x.mT
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) + _NS_EPS)
    for _ in range(steps):
        gram = x @ x.mT
        poly = b * gram + c * (gram @ gram)
        x = a * x + poly @ x
    return x if wide else x.mT


def _matrix_placements(p: DTensor) -> list:
    """``p``'s placements with every shard of the last two dims replaced by Replicate: the whole
    matrices, leading (expert) dims still sharded. A strided shard (FSDP over TP) has ``dim`` too."""
    out = []
    for pl in p.placements:
        dim = getattr(pl, "dim", None)
        out.append(Replicate() if dim is not None and dim % p.ndim >= p.ndim - 2 else pl)
    return out


def orthogonalized_update(
    p: torch.Tensor, u: torch.Tensor, steps: int, coefficients: Sequence[float], per_shard: bool = False
) -> torch.Tensor:
    """NS of the update ``u`` (the local shard of parameter ``p``'s update, a plain tensor) over
    whole matrices; returns this rank's shard of the result, shaped like ``u``."""
    if not isinstance(p, DTensor) or per_shard:
        return newton_schulz(u, steps, coefficients)
    mesh, target = p.device_mesh, _matrix_placements(p)
    if list(target) == list(p.placements):  # nothing splits a matrix (EP: whole experts)
        return newton_schulz(u, steps, coefficients)
    whole = DTensor.from_local(u, mesh, p.placements, shape=p.shape, stride=p.stride()).redistribute(mesh, target)
    o = newton_schulz(whole.to_local(), steps, coefficients)
    o = DTensor.from_local(o, mesh, target, shape=p.shape, stride=p.stride())
    return o.redistribute(mesh, p.placements).to_local()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class Muon(torch.optim.Optimizer):
    """Muon over >= 2-D parameters (plain tensors or DTensors of any placements). State per
    parameter: ``momentum_buffer``, laid out like the parameter (DCP reshards it like AdamW's
    moments). Group keys: lr, weight_decay, momentum, nesterov, ns_steps, ns_coefficients,
    update_rms."""

    def __init__(
        self,
        params,
        lr: float,
        weight_decay: float = 0.0,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        ns_coefficients: Sequence[float] = NS_COEFFICIENTS,
        update_rms: float = 0.2,
    ):
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_steps=ns_steps,
            ns_coefficients=list(ns_coefficients),
            update_rms=update_rms,
        )
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim < 2:
                    raise ValueError(f"Muon takes >= 2-D parameters, got one of shape {tuple(p.shape)}")
        self.per_shard = os.environ.get(PER_SHARD_ENV) == "1"

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                g, buf = _local(p.grad), _local(state["momentum_buffer"])
                buf.mul_(mu).add_(g)
                u = g.add(buf, alpha=mu) if group["nesterov"] else buf.clone()
                o = orthogonalized_update(p, u, group["ns_steps"], group["ns_coefficients"], self.per_shard)
                scale = group["update_rms"] * math.sqrt(max(p.shape[-2], p.shape[-1]))
                w = _local(p)
                w.mul_(1.0 - lr * wd)
                w.add_(o.to(w.dtype), alpha=-lr * scale)
        return loss
