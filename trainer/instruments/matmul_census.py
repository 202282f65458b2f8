"""``profiling.matmul_census_step``: did the GEMMs really run in bf16? A dispatch mode that sees
every aten op of a step after autocast and mixed precision have done their work and adds up
the FLOPs of the matmul-class ops (mm, addmm, bmm, baddbmm, _grouped_mm, the float8 _scaled_mm and
_scaled_grouped_mm, scaled-dot-product attention, forward and backward) per dtype; the hook writes one step's census to
``<dump_folder>/matmul_census_rank<R>.json``."""

from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from trainer.instruments.base import HookBase
from trainer.runtime.files import atomic_write_json

__all__ = ["MatmulCensus", "MatmulCensusHook"]

_MATMULS = {"mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "_scaled_mm", "_scaled_grouped_mm"}
_GROUPED = ("_grouped_mm", "_scaled_grouped_mm")


def _local_shard(t: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def _defers(args: tuple, kwargs: dict | None) -> bool:
    """Whether an argument is a tensor subclass other than DTensor (torchao's float8 training
    tensor): the census then lets the subclass run the op, and counts the ops the subclass
    runs on its plain tensors (``_scaled_mm`` on float8 data), not the op it was called with
    (an ``mm`` whose operands only claim the high-precision dtype)."""
    from torch.distributed.tensor import DTensor
    from torch.utils._pytree import tree_leaves

    return any(
        isinstance(t, torch.Tensor) and type(t) not in (torch.Tensor, nn.Parameter) and not isinstance(t, DTensor)
        for t in tree_leaves((args, kwargs or {}))
    )


def _shape(t: Any) -> tuple[int, ...]:
    return tuple(t.shape)


_FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _dtype(t: Any) -> torch.dtype:
    """The dtype the kernel multiplies ``t`` in: a float8 wrapper (torchao's Float8TrainingTensor,
    whose ``dtype`` is the original one, carries its float8 payload in ``_data``; its matmul is
    seen here as ``mm`` before the wrapper runs ``_scaled_mm``) counts as its payload's."""
    data = getattr(_local_shard(t), "_data", None)
    return data.dtype if isinstance(data, torch.Tensor) and data.dtype in _FLOAT8 else t.dtype


def _matmul_flops(name: str, args: tuple) -> tuple[int, torch.dtype] | None:
    """(FLOPs, dtype of the multiplied operands) of one matmul-class op, or None."""
    if name in ("mm", "bmm"):
        a, b = args[0], args[1]
    elif name in ("addmm", "baddbmm"):
        a, b = args[1], args[2]
    elif name in ("_grouped_mm", "_scaled_mm", "_scaled_grouped_mm"):
        a, b = args[0], args[1]
    elif "scaled_dot_product" in name or "flash_attention" in name or "efficient_attention" in name:
        return _attention_flops(name, args)
    else:
        return None
    sa, sb = _shape(a), _shape(b)
    # (_scaled_grouped_mm: torchao's float8 experts on CUDA, their rows padded to groups of 16)
    if name in _GROUPED and len(sa) == 2 and len(sb) == 2:
        # [m, k_total] x [k_total, n] with the contraction split into groups: output [g, m, n]
        flops = 2 * sa[0] * sa[1] * sb[1]
    elif name in _GROUPED and len(sa) == 3 and len(sb) == 2:
        # [g, m, k] x [k, n_total], columns split into groups: output [m, n_total]
        flops = 2 * sa[1] * sa[2] * sb[1]
    elif name in _GROUPED and len(sa) == 2 and len(sb) == 3:
        # [rows_total, k] x [g, k, n], rows split into groups
        flops = 2 * sa[0] * sa[1] * sb[2]
    else:
        # (batched) dense matmul [..., m, k] x [..., k, n]
        batch = math.prod(sa[:-2]) if len(sa) > 2 else 1
        flops = 2 * batch * sa[-2] * sa[-1] * sb[-1]
    return flops, _dtype(a)


def _attention_flops(name: str, args: tuple) -> tuple[int, torch.dtype] | None:
    q, k, v = args[0], args[1], args[2]
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)) or q.dim() != 4:
        return None
    if "backward" in name:
        # backward ops take the output gradient first: (grad_out, q, k, v, ...)
        q, k, v = args[1], args[2], args[3]
    b, h, sq, d = _shape(q)
    sk, dv = k.shape[-2], v.shape[-1]
    fwd = 2 * b * h * sq * sk * (d + dv)  # Q K^T and P V
    return (2 * fwd if "backward" in name else fwd), q.dtype


class MatmulCensus(TorchDispatchMode):
    """Adds up the FLOPs of matmul-class ops per dtype while active.

    A dispatch mode sees ops after autocast and FSDP's parameter casts, so the dtypes are the
    ones the kernels really ran in. A DTensor op is seen once, before DTensor runs it on the
    local shards; by default it counts at its global shapes (the shares per dtype are what
    matters), with ``local=True`` at the shapes of the arguments' local shards: the FLOPs this
    rank computes (exact for the tensor-parallel matmuls, whose inputs the TP plan lays out
    before the op so DTensor runs it on the shards as they are). Use as a context manager
    around forward+backward."""

    def __init__(self, local: bool = False) -> None:
        super().__init__()
        self.local = local
        self.flops: Counter[torch.dtype] = Counter()
        self.calls: Counter[tuple[str, torch.dtype]] = Counter()
        self.op_flops: Counter[tuple[str, torch.dtype]] = Counter()  # (op name, dtype) -> FLOPs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _defers(args, kwargs):
            return NotImplemented  # the subclass runs it; its inner ops come back through here
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if self.local:
            args = tuple(_local_shard(a) for a in args)
        counted = _matmul_flops(name, args)
        if counted is not None:
            flops, dtype = counted
            self.flops[dtype] += flops
            self.calls[(name, dtype)] += 1
            self.op_flops[(name, dtype)] += flops
        return out

    @property
    def total_flops(self) -> int:
        return sum(self.flops.values())

    def share(self, dtype: torch.dtype) -> float:
        """Fraction of matmul FLOPs that ran in ``dtype`` (0 when nothing was counted)."""
        total = self.total_flops
        return self.flops[dtype] / total if total else 0.0

    def write(self, path: str, **meta: Any) -> None:
        """``meta`` (step, rank, ...) and :meth:`summary` as one JSON object at ``path``
        (atomically: a reader never sees half a file)."""
        atomic_write_json(path, {**meta, **self.summary()})

    def summary(self) -> dict[str, Any]:
        return {
            "total_flops": self.total_flops,
            "local_shapes": self.local,
            "total_gflops": self.total_flops / 1e9,
            "share": {str(d).removeprefix("torch."): self.share(d) for d in self.flops},
            "calls": {f"{n}/{str(d).removeprefix('torch.')}": c for (n, d), c in sorted(self.calls.items(), key=str)},
        }


class MatmulCensusHook(HookBase):
    """Counts step ``step``'s matmul FLOPs at the local shards' shapes and writes them."""

    def __init__(self, step: int, folder: str, meta: dict[str, Any], log: Callable[[str], None]):
        super().__init__()
        self.step, self.folder, self.meta, self.log = step, folder, meta, log
        self._census: MatmulCensus | None = None

    def on_step_start(self, step: int) -> None:
        if step == self.step:
            self._census = MatmulCensus(local=True)
            self._census.__enter__()

    def on_step_end(self, step: int, result: Any) -> None:
        census = self._stop()
        if census is None:
            return
        path = os.path.join(self.folder, f"matmul_census_rank{self.meta['rank']}.json")
        census.write(path, step=step, **self.meta)
        self.log(f"counted the matmul FLOPs of step {step}: {self.folder}/matmul_census_rank<R>.json")

    def _stop(self) -> MatmulCensus | None:
        census, self._census = self._census, None
        if census is not None:
            census.__exit__(None, None, None)
        return census

    def close(self, exc: BaseException | None = None) -> None:
        self._stop()  # a step that failed while counting leaves the dispatch mode
