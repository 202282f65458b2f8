"""Looking inside a training step: profiler traces, CUDA memory snapshots, and a census of the
dtypes the matmuls ran in.

``[profiling]`` (torchtitan's option names) drives :class:`StepProfiler`: a torch profiler
window of ``profiler_warmup`` unrecorded plus ``profiler_active`` recorded steps that ends at
every multiple of ``profile_freq``, written as Chrome-trace JSON (open it in Perfetto or
chrome://tracing) to ``<dump_folder>/<save_traces_folder>/iteration_<step>/rank<r>_trace.json``;
and CUDA allocator snapshots (open them at https://pytorch.org/memory_viz) every
``profile_freq`` steps and when a step runs out of memory. Windows are aligned to global step
numbers, so a resumed run profiles the same steps as an uninterrupted one.

:class:`MatmulCensus` answers "did the GEMMs really run in bf16?": it sees every aten op of a
step after autocast and mixed precision have done their work and adds up the FLOPs of the
matmul-class ops (mm, addmm, bmm, baddbmm, _grouped_mm, scaled-dot-product attention, forward
and backward) per dtype.
"""

from __future__ import annotations

import math
import os
import pickle
from collections import Counter
from typing import Any

import torch
from torch.profiler import ProfilerAction, ProfilerActivity
from torch.utils._python_dispatch import TorchDispatchMode

from trainer.config import Profiling as ProfilingConfig

__all__ = ["MatmulCensus", "StepProfiler", "profiler_action"]

_MEMORY_HISTORY_ENTRIES = 100_000


def profiler_action(step: int, freq: int, warmup: int, active: int) -> ProfilerAction:
    """What the profiler does during global step ``step`` (1-based): record the ``active``
    steps ending at each multiple of ``freq`` (saving at the multiple), warm up for the
    ``warmup`` steps before them, idle otherwise."""
    phase = step % freq  # 0 = the step that closes a window
    if phase == 0:
        return ProfilerAction.RECORD_AND_SAVE
    first_recorded = freq - active + 1
    if phase >= first_recorded:
        return ProfilerAction.RECORD
    if phase >= first_recorded - warmup:
        return ProfilerAction.WARMUP
    return ProfilerAction.NONE


class StepProfiler:
    """Profiler traces and memory snapshots for the steps ``[profiling]`` asks for.

    Call :meth:`step` after every training step with the number of the step just finished,
    and use the object as a context manager around the loop. Both parts are off unless
    enabled, and then cost nothing outside their windows."""

    def __init__(self, cfg: ProfilingConfig, run_folder: str, rank: int, device: torch.device, first_step: int):
        self.cfg, self.rank, self.device = cfg, rank, device
        self.trace_dir = os.path.join(run_folder, cfg.save_traces_folder)
        self.snapshot_dir = os.path.join(run_folder, cfg.save_memory_snapshot_folder)
        self._prof: torch.profiler.profile | None = None
        self._snapshots = cfg.enable_memory_snapshot and device.type == "cuda"
        self._first_step = first_step + 1  # the global step the profiler's schedule starts at
        self._last_step = first_step
        self.messages: list[str] = []
        if cfg.enable_memory_snapshot and not self._snapshots:
            self.messages.append(
                "profiling.enable_memory_snapshot: memory snapshots record the CUDA caching "
                "allocator and this run is on CPU; no snapshots will be written"
            )

    def __enter__(self) -> StepProfiler:
        if self.cfg.enable_profiling:
            activities = [ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(ProfilerActivity.CUDA)
            c = self.cfg
            self._prof = torch.profiler.profile(
                activities=activities,
                schedule=lambda i: profiler_action(
                    self._first_step + i, c.profile_freq, c.profiler_warmup, c.profiler_active
                ),
                on_trace_ready=self._save_trace,
                record_shapes=True,
            )
            self._prof.__enter__()
            self.messages.append(
                f"profiling steps {c.profile_freq}, {2 * c.profile_freq}, ... "
                f"(warmup {c.profiler_warmup}, recorded {c.profiler_active}); traces in {self.trace_dir}"
            )
        if self._snapshots:
            torch.cuda.memory._record_memory_history(max_entries=_MEMORY_HISTORY_ENTRIES)
            self.messages.append(f"memory snapshots every {self.cfg.profile_freq} steps in {self.snapshot_dir}")
        return self

    def step(self, step: int) -> None:
        """``step`` (1-based) has just finished."""
        self._last_step = step
        if self._prof is not None:
            self._prof.step()
        if self._snapshots and step % self.cfg.profile_freq == 0:
            self._dump_snapshot(f"iteration_{step}")

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._snapshots:
            if exc_type is not None and issubclass(exc_type, torch.OutOfMemoryError):
                self._dump_snapshot(f"iteration_{self._last_step + 1}_oom")
            torch.cuda.memory._record_memory_history(enabled=None)
        if self._prof is not None:
            self._prof.__exit__(exc_type, exc, tb)
            self._prof = None

    def _save_trace(self, prof: torch.profiler.profile) -> None:
        step = self._first_step + prof.step_num - 1
        folder = os.path.join(self.trace_dir, f"iteration_{step}")
        os.makedirs(folder, exist_ok=True)
        prof.export_chrome_trace(os.path.join(folder, f"rank{self.rank}_trace.json"))

    def _dump_snapshot(self, name: str) -> None:
        folder = os.path.join(self.snapshot_dir, name)
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"rank{self.rank}_memory_snapshot.pickle"), "wb") as f:
            pickle.dump(torch.cuda.memory._snapshot(), f)


# ------------------------------------------------------------------------ matmul census

_MATMULS = {"mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "_scaled_mm"}


def _local_shard(t: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def _shape(t: Any) -> tuple[int, ...]:
    return tuple(t.shape)


def _matmul_flops(name: str, args: tuple) -> tuple[int, torch.dtype] | None:
    """(FLOPs, dtype of the multiplied operands) of one matmul-class op, or None."""
    if name in ("mm", "bmm"):
        a, b = args[0], args[1]
    elif name in ("addmm", "baddbmm"):
        a, b = args[1], args[2]
    elif name in ("_grouped_mm", "_scaled_mm"):
        a, b = args[0], args[1]
    elif "scaled_dot_product" in name or "flash_attention" in name or "efficient_attention" in name:
        return _attention_flops(name, args)
    else:
        return None
    sa, sb = _shape(a), _shape(b)
    if name == "_grouped_mm" and len(sa) == 2 and len(sb) == 2:
        # [m, k_total] x [k_total, n] with the contraction split into groups: output [g, m, n]
        flops = 2 * sa[0] * sa[1] * sb[1]
    elif name == "_grouped_mm" and len(sa) == 3 and len(sb) == 2:
        # [g, m, k] x [k, n_total], columns split into groups: output [m, n_total]
        flops = 2 * sa[1] * sa[2] * sb[1]
    elif name == "_grouped_mm" and len(sa) == 2 and len(sb) == 3:
        # [rows_total, k] x [g, k, n], rows split into groups
        flops = 2 * sa[0] * sa[1] * sb[2]
    else:
        # (batched) dense matmul [..., m, k] x [..., k, n]
        batch = math.prod(sa[:-2]) if len(sa) > 2 else 1
        flops = 2 * batch * sa[-2] * sa[-1] * sb[-1]
    return flops, a.dtype


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

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if self.local:
            args = tuple(_local_shard(a) for a in args)
        counted = _matmul_flops(name, args)
        if counted is not None:
            flops, dtype = counted
            self.flops[dtype] += flops
            self.calls[(name, dtype)] += 1
        return out

    @property
    def total_flops(self) -> int:
        return sum(self.flops.values())

    def share(self, dtype: torch.dtype) -> float:
        """Fraction of matmul FLOPs that ran in ``dtype`` (0 when nothing was counted)."""
        total = self.total_flops
        return self.flops[dtype] / total if total else 0.0

    def write(self, path: str, **meta: Any) -> None:
        """``meta`` (step, rank, ...) and :meth:`summary` as one JSON object at ``path``,
        written to a temporary name first (a reader never sees half a file)."""
        import json

        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump({**meta, **self.summary()}, f, indent=1)
        os.replace(tmp, path)

    def summary(self) -> dict[str, Any]:
        return {
            "total_flops": self.total_flops,
            "local_shapes": self.local,
            "total_gflops": self.total_flops / 1e9,
            "share": {str(d).removeprefix("torch."): self.share(d) for d in self.flops},
            "calls": {f"{n}/{str(d).removeprefix('torch.')}": c for (n, d), c in sorted(self.calls.items(), key=str)},
        }
