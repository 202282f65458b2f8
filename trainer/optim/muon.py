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
approximate U V^T of U's SVD, whose RMS is about 1/sqrt(max(m, n)). The scale r sqrt(max(m, n))
is Moonlight's shape rule (section 2.2 of the paper): it makes the update's RMS about r whatever
the shape, so one lr serves every width. r defaults to Moonlight's 0.2
(``optimizer.muon_update_rms``), the RMS of AdamW's update in their long billion-parameter runs,
where it carries AdamW's lr and weight decay over. On small models in short runs it does not:
measured on the debug model (benchmarks/muon_lr.py, docs/optimizers.md), Muon at AdamW's lr with
r = 0.2 falls far behind AdamW and with r = 1.0 (the RMS of AdamW's first, sign-like update)
keeps up with it; matching the update's RMS does not match the speed (for a low-rank gradient an
orthogonal update puts most of its norm where the gradient is small). NS runs in float32 here (the CPU proofs compare layouts in fp32; Jordan's and
Moonlight's code use bfloat16 on GPUs).

Distribution. NS needs each whole matrix; FSDP and TP shard them. Each parameter is a DTensor
on its own mesh (the meshes ParallelDims built for FSDP, TP, EP). Leading (expert) dimensions
stay sharded (EP: each rank orthogonalises only its own experts); a parameter none of whose
matrix dimensions is sharded runs NS locally. For the others, ``distribution``
(``optimizer.muon_distribution``):

- ``round_robin`` (default): each whole matrix is orthogonalised by one owner rank of the group
  that shards it, chosen by FLOPs, and each member gets its shard of the result back
  (trainer/optim/muon_dist.py): 1/S of the group's NS FLOPs per rank, and about 2 (S-1)/S of the local
  shard's bytes moved each way.
- ``gather``: the update is redistributed to placements that replicate the two matrix
  dimensions (an all-gather over the dimensions that split it); every rank of that group runs NS
  on the whole matrix, then keeps its own shard (Replicate -> Shard is a local slice).

Both assemble the same whole matrix and run the same NS on it, so they give bitwise the same
update; docs/optimizers.md prices and measures them.

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

from trainer.optim.low_precision import attach_state_dtype, global_index, low_bits, random_bits, salt, store
from trainer.optim.muon_dist import RoundRobin, matrix_mesh_dims

__all__ = ["DISTRIBUTIONS", "Muon", "newton_schulz", "orthogonalized_update"]

PER_SHARD_ENV = "MESHTRAIN_TEST_MUON_PER_SHARD"
NS_COEFFICIENTS = (3.4445, -4.775, 2.0315)
DISTRIBUTIONS = ("round_robin", "gather")
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
    update_rms. ``distribution``: how sharded matrices get whole (module docstring)."""

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
        distribution: str = "round_robin",
        state_dtype: torch.dtype = torch.float32,
        seed: int = 0,
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
        if distribution not in DISTRIBUTIONS:
            raise ValueError(f"Muon distribution {distribution!r}: use one of {DISTRIBUTIONS}")
        self.distribution = distribution
        self._round_robin = RoundRobin()
        self.per_shard = os.environ.get(PER_SHARD_ENV) == "1"
        # bf16 momentum: stochastically rounded (trainer/optim/low_precision.py); the step count
        # salts the rounding bits
        attach_state_dtype(self, state_dtype, seed)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        updates = []  # (group, parameter, local update) of every parameter with a gradient
        for group in self.param_groups:
            mu = group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p, dtype=self.state_dtype)
                g, buf = _local(p.grad), _local(state["momentum_buffer"])
                if buf.dtype == torch.bfloat16:
                    # a step count (as AdamW's) salts the rounding bits; only bf16 state has it
                    state["step"] = state.get("step", torch.tensor(0.0)) + 1
                    stored, buf = buf, buf.float().mul_(mu).add_(g)
                    t, n = int(state["step"].item()), self._number[id(p)]
                    bits = random_bits(global_index(p), salt(self.seed, t, n, 2))
                    store(stored, buf, low_bits(bits))
                else:
                    buf.mul_(mu).add_(g)
                updates.append((group, p, g.add(buf, alpha=mu) if group["nesterov"] else buf.clone()))
        for (group, p, _), o in zip(updates, self._orthogonalize(updates)):
            lr, wd = group["lr"], group["weight_decay"]
            scale = group["update_rms"] * math.sqrt(max(p.shape[-2], p.shape[-1]))
            w = _local(p)
            w.mul_(1.0 - lr * wd)
            w.add_(o.to(w.dtype), alpha=-lr * scale)
        return loss

    def _orthogonalize(self, updates: list) -> list[torch.Tensor]:
        """This rank's shard of NS of every update, by the configured distribution: round-robin
        owners for the parameters whose matrices are sharded (trainer/optim/muon_dist.py), the gather
        scheme, or (negative control) each shard on its own; whole local matrices (one process,
        EP's local experts) run here."""
        out: list[torch.Tensor | None] = [None] * len(updates)
        shared = []  # indices of the updates whose matrices are split over ranks
        for i, (group, p, u) in enumerate(updates):
            steps, coef = group["ns_steps"], group["ns_coefficients"]
            if self.per_shard or not isinstance(p, DTensor) or not matrix_mesh_dims(p):
                out[i] = newton_schulz(u, steps, coef)
            elif self.distribution == "gather":
                out[i] = orthogonalized_update(p, u, steps, coef)
            else:
                shared.append(i)
        if shared:
            self._round_robin.plan([(updates[i][1], updates[i][0]["ns_steps"]) for i in shared])
            ns_of = {id(updates[i][1]): updates[i][0] for i in shared}

            def ns(whole, p):
                g = ns_of[id(p)]
                return newton_schulz(whole, g["ns_steps"], g["ns_coefficients"])

            results = self._round_robin.orthogonalize([(updates[i][1], updates[i][2]) for i in shared], ns)
            for i, o in zip(shared, results):
                out[i] = o
        return out
