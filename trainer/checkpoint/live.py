"""Full tensors of the live, sharded model, moved to one rank: the source of the exports that
skip a temporary DCP checkpoint (:mod:`trainer.checkpoint.hf_live`, and the pipeline branch of
:func:`trainer.checkpoint.export.export_consolidated`).

A parameter may be a DTensor (FSDP2 / TP / EP / ETP shards; ``full_tensor()`` is collective
over its mesh), a plain tensor, or, with pipeline parallelism, held only by the ranks of one
stage. :class:`LiveModel` learns once (one ``all_gather_object``) which ranks hold which key
with what shape and dtype; :meth:`LiveModel.fetch` then walks keys in an order every rank
agrees on: the key's holders call ``full_tensor()`` together, and when the destination rank
holds none of it, the first holder sends it there (point-to-point on ``process_group``). Each
operation involves exactly the ranks that take part in it, in the same global order on every
rank, so the walk cannot deadlock; ranks that neither hold a key nor receive it skip it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor

from trainer.checkpoint.state import distributed, model_state_dict

__all__ = ["LiveModel"]

Meta = dict[str, tuple[tuple[int, ...], torch.dtype]]


class LiveModel:
    """The weights of ``model_parts`` (this rank's stages) under plain FQNs, as full tensors on
    demand. Construct it on every rank of ``process_group`` (collective)."""

    def __init__(self, model_parts: Sequence[nn.Module], process_group=None):
        self.pg = process_group
        self.distributed = distributed()
        self.rank = dist.get_rank(process_group) if self.distributed else 0
        self.world = dist.get_world_size(process_group) if self.distributed else 1
        self.state = model_state_dict(model_parts)
        own = [(k, tuple(v.shape), v.dtype) for k, v in self.state.items() if isinstance(v, Tensor)]
        per_rank = [own]
        if self.world > 1:
            per_rank = [None] * self.world
            dist.all_gather_object(per_rank, own, group=process_group)
        self.meta: Meta = {}
        self.holders: dict[str, list[int]] = {}
        self.order: list[str] = []  # stage 0's keys first when pp is the outer mesh dim
        for r, entries in enumerate(per_rank):
            for k, shape, dtype in entries:
                if k in self.meta and self.meta[k] != (shape, dtype):
                    raise RuntimeError(f"ranks disagree on {k}: {self.meta[k]} vs {(shape, dtype)} on rank {r}")
                if k not in self.meta:
                    self.meta[k] = (shape, dtype)
                    self.order.append(k)
                self.holders.setdefault(k, []).append(r)
        self._device = self._comm_device()

    def _comm_device(self) -> torch.device:
        if self.distributed and "nccl" in str(dist.get_backend(self.pg)) and torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def fetch(
        self,
        keys: Sequence[str],
        dst: int,
        cast: Callable[[Tensor], Tensor] | None = None,
    ) -> dict[str, Tensor]:
        """Collective over all ranks (each calls it with the same ``keys`` and ``dst``): the full
        tensors of ``keys`` on rank ``dst``, on CPU (through ``cast`` first, applied by the rank
        that holds the tensor, e.g. to the export dtype); ``{}`` on the other ranks. Holds one
        full tensor at a time on a rank that is not ``dst``."""
        out: dict[str, Tensor] = {}
        for k in keys:
            holders = self.holders[k]
            full = None
            if self.rank in holders:
                full = self._full(self.state[k])
                if cast is not None:
                    full = cast(full)
            if dst in holders:
                if self.rank == dst:
                    out[k] = full.to("cpu")
                continue
            src = holders[0]
            if self.rank == src:
                dist.send(full.to(self._device).contiguous(), group=self.pg, group_dst=dst)
            elif self.rank == dst:
                shape, dtype = self.meta[k]
                if cast is not None:  # the dtype ``cast`` gives, from a meta tensor
                    dtype = cast(torch.empty(shape, dtype=dtype, device="meta")).dtype
                buf = torch.empty(shape, dtype=dtype, device=self._device)
                dist.recv(buf, group=self.pg, group_src=src)
                out[k] = buf.to("cpu")
            del full
        return out

    @staticmethod
    def _full(t: Tensor) -> Tensor:
        from torch.distributed.tensor import DTensor

        t = t.detach()
        return t.full_tensor() if isinstance(t, DTensor) else t
