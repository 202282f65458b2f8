"""What ``optimizer.name = "Muon"`` adds to one rank's step and memory (trainer/optim/muon.py,
trainer/optim/muon_dist.py, docs/optimizers.md): per parameter Muon takes, decided by the trainer's own
rule, ``trainer.optim.groups.choose`` over the config's ``[[optimizer.param_groups]]`` routing
(the first table whose pattern matches; a table's ``optimizer`` key routes its parameters to
Muon or AdamW; unmatched parameters: >= 2-D outside the embedding and the head). Only trainable
parameters count: under LoRA the adapters (the frozen base has no optimizer state):

* state: one float32 momentum buffer per local element (4 bytes), where AdamW keeps two (8);
* Newton-Schulz FLOPs, ``trainer.optim.muon_dist.ns_flops``: k (4 m^2 n + 2 m^3) per whole matrix
  (m <= n), times the matrices of the block this rank's group orthogonalises (a routed expert
  weight: the experts local after EP and expert FSDP, which shard the expert dimension only);
* the sharding group of a matrix: the mesh axes that split one of its two matrix dimensions:
  FSDP (``fsdp``, dim 0 of a 2-D weight), ``tp`` for a TP-split weight, ``etp`` for an
  etp-split expert weight (expert FSDP splits the expert dimension: no group);
* ``gather``: every rank of the group runs Newton-Schulz on every matrix and receives each
  through one all-gather (output: the whole block, float32);
* ``round_robin``: the group's matrices are assigned to owners by FLOPs (the trainer's
  longest-processing-time-first rule, replayed here), and the busiest owner's FLOPs are the
  rank's; communication: two all-to-all-v rounds per group (the trainer's batched point-to-point
  exchange), priced as all-to-alls whose input is the larger of the busiest owner's whole
  matrices and the rank's local shards (each round moves (S-1)/S of it).

The FLOPs run in float32 (TF32 with ``training.enable_tf32``), after the backward, not
overlapped; the communication is exposed too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .inventory import _ETP_DIM, cached_layout, model_inventory, rank_shards

__all__ = ["MuonCost", "muon_cost", "muon_params", "routing_section"]


@dataclass(frozen=True)
class MuonCost:
    local_numel: int  # this rank's local (unpadded) elements of Muon's parameters (one state each)
    ns_flops: int  # Newton-Schulz FLOPs this rank runs per step
    comm: tuple  # ({"kind", "axes", "group_size", "count", "bytes"}, ...) per step


def _group_axes(shard, degrees) -> tuple[str, ...]:
    p = shard.info
    axes = []
    if p.expert:
        if degrees.etp > 1 and _ETP_DIM.get(p.fqn.rsplit(".", 1)[-1]) is not None:
            axes.append("etp")
    else:
        if shard.fsdp_mesh == "fsdp" and shard.fsdp_size > 1:
            axes.append("fsdp")
        if p.tp_dim is not None and degrees.tp > 1:
            axes.append("tp")
    return tuple(axes)


def _whole(shard) -> tuple[int, ...]:
    """The block the group orthogonalises: the matrix whole, leading (expert) dims as local."""
    p = shard.info
    if len(p.shape) == 2:
        return p.shape
    lead = shard.local_shape[0]
    if shard.fsdp_size > 1:  # expert FSDP shards the expert dim (busiest rank: the ceiling)
        lead = math.ceil(lead / shard.fsdp_size)
    return (lead, *p.shape[1:])


def routing_section(param_groups: tuple = ()):
    """The optimizer section ``trainer.optim.groups.choose`` reads for the routing, with
    ``optimizer.name = "Muon"`` and the config's tables as ``(pattern, optimizer or None)``
    pairs (:attr:`tools.planner.estimate.Job.param_groups`); the other keys are the defaults
    (they choose hyperparameters, not the optimizer)."""
    from trainer.config import Optimizer

    tables = [{"pattern": p, **({"optimizer": o} if o else {})} for p, o in param_groups]
    return Optimizer(name="Muon", param_groups=tables)


def muon_params(params, param_groups: tuple = ()) -> frozenset[str]:
    """The FQNs of ``params`` (:class:`ParamInfo`, the trainable ones) that the trainer gives to
    Muon under the routing ``param_groups`` (``trainer.optim.groups.choose``, which raises the
    trainer's error for a table that routes a 1-D parameter to Muon)."""
    from trainer.optim.groups import choose

    section = routing_section(param_groups)
    return frozenset(p.fqn for p in params if choose(p.fqn, len(p.shape), section).optimizer == "Muon")


def muon_cost(
    model, flavor, overrides: dict, degrees, rank: int, mixed: bool, stages, scheme: str, ns_steps: int,
    param_groups: tuple = (), lora=None,
):  # fmt: skip
    """:class:`MuonCost` of ``rank`` (its ``stages``: (layers, embed, head) tuples), the
    parameters routed as ``param_groups`` says (:func:`muon_params`); with ``lora`` (a
    :class:`~models.parallel.lora.LoRAOptions`) the adapters are the trainable parameters."""
    from trainer.optim.muon_dist import ns_flops

    params, _ = model_inventory(model, flavor, **overrides)
    if lora is not None:
        from .lora import adapter_infos

        params = adapter_infos(params, model, flavor, tuple(sorted(overrides.items())), lora)
    takes = muon_params(params, param_groups)
    layout = cached_layout(degrees)
    local = flops = 0
    buckets: dict[tuple[str, ...], list[tuple[int, int, int]]] = {}  # axes -> (flops, whole, local numel)
    for layers, embed, head in stages:
        for s in rank_shards(params, degrees, layout, rank, mixed, layers, embed, head):
            if s.info.fqn not in takes:
                continue
            local += s.local_numel
            whole = _whole(s)
            f = ns_flops(whole, ns_steps)
            axes = _group_axes(s, degrees)
            if not axes:
                flops += f
            else:
                buckets.setdefault(axes, []).append((f, math.prod(whole), s.local_numel))
    comm = []
    for axes, items in buckets.items():
        size = math.prod(layout.size(a) for a in axes)
        if scheme == "gather":
            flops += sum(f for f, _, _ in items)
            by_bytes: dict[int, int] = {}
            for _, n, _ in items:
                by_bytes[4 * n] = by_bytes.get(4 * n, 0) + 1
            comm += [
                {"kind": "all_gather", "axes": axes, "group_size": size, "count": c, "bytes": b}
                for b, c in sorted(by_bytes.items())
            ]
            continue
        loads, owned = [0] * size, [0] * size
        for i in sorted(range(len(items)), key=lambda i: -items[i][0]):  # trainer.optim.muon_dist.RoundRobin.plan
            owner = loads.index(min(loads))
            loads[owner] += items[i][0]
            owned[owner] += items[i][1]
        busiest = loads.index(max(loads))
        flops += loads[busiest]
        nbytes = 4 * max(owned[busiest], sum(n for _, _, n in items))
        comm.append({"kind": "all_to_all", "axes": axes, "group_size": size, "count": 2, "bytes": nbytes})
    return MuonCost(local, flops, tuple(comm))
