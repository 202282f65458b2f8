"""``[profiling]`` (torchtitan's option names): torch profiler traces and CUDA memory snapshots.

A torch profiler window of ``profiler_warmup`` unrecorded plus ``profiler_active`` recorded steps
ends at every multiple of ``profile_freq`` and is written as Chrome-trace JSON (open it in
Perfetto or chrome://tracing) to
``<dump_folder>/<save_traces_folder>/iteration_<step>/rank<r>_trace.json``; CUDA allocator
snapshots (open them at https://pytorch.org/memory_viz) are written every ``profile_freq`` steps
and when a step runs out of memory. Windows are aligned to global step numbers, so a resumed run
profiles the same steps as an uninterrupted one.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

import torch
from torch.profiler import ProfilerAction, ProfilerActivity

from trainer.config import Profiling as ProfilingConfig
from trainer.instruments.base import HookBase
from trainer.runtime.files import atomic_file, atomic_path

__all__ = ["StepProfiler", "profiler_action"]

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


class StepProfiler(HookBase):
    """Profiler traces and memory snapshots for the steps ``[profiling]`` asks for.

    Starts when built (the trainer builds it as the loop starts, after resuming: ``first_step``
    is the last step already done); each step's end advances it; :meth:`close` stops it. Both
    parts are off unless enabled, and then cost nothing outside their windows."""

    def __init__(self, cfg: ProfilingConfig, run_folder: str, rank: int, device: torch.device, first_step: int):
        super().__init__()
        self.cfg, self.rank, self.device = cfg, rank, device
        self.trace_dir = os.path.join(run_folder, cfg.save_traces_folder)
        self.snapshot_dir = os.path.join(run_folder, cfg.save_memory_snapshot_folder)
        self._prof: torch.profiler.profile | None = None
        self._snapshots = cfg.enable_memory_snapshot and device.type == "cuda"
        self._first_step = first_step + 1  # the global step the profiler's schedule starts at
        self._last_step = first_step
        if cfg.enable_memory_snapshot and not self._snapshots:
            self.messages.append(
                "profiling.enable_memory_snapshot: memory snapshots record the CUDA caching "
                "allocator and this run is on CPU; no snapshots will be written"
            )
        self._start()

    def _start(self) -> None:
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

    def on_step_end(self, step: int, result: Any) -> None:
        """``step`` (1-based) has just finished."""
        self._last_step = step
        if self._prof is not None:
            self._prof.step()
        if self._snapshots and step % self.cfg.profile_freq == 0:
            self._dump_snapshot(f"iteration_{step}")

    def close(self, exc: BaseException | None = None) -> None:
        if self._snapshots:
            if isinstance(exc, torch.OutOfMemoryError):
                self._dump_snapshot(f"iteration_{self._last_step + 1}_oom")
            torch.cuda.memory._record_memory_history(enabled=None)
            self._snapshots = False
        if self._prof is not None:
            self._prof.__exit__(type(exc) if exc is not None else None, exc, None)
            self._prof = None

    def _save_trace(self, prof: torch.profiler.profile) -> None:
        step = self._first_step + prof.step_num - 1
        folder = os.path.join(self.trace_dir, f"iteration_{step}")
        os.makedirs(folder, exist_ok=True)
        with atomic_path(os.path.join(folder, f"rank{self.rank}_trace.json")) as tmp:
            prof.export_chrome_trace(tmp)

    def _dump_snapshot(self, name: str) -> None:
        folder = os.path.join(self.snapshot_dir, name)
        os.makedirs(folder, exist_ok=True)
        with atomic_file(os.path.join(folder, f"rank{self.rank}_memory_snapshot.pickle"), "wb") as f:
            pickle.dump(torch.cuda.memory._snapshot(), f)
