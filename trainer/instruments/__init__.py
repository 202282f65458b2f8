"""Instruments: what a run can measure about its own steps, as step hooks (base.py).

:func:`build_instruments` is the one place that turns the config into the list of hooks the
trainer loop calls: the fake-backend meter (comm.mode = "fake_backend", fake_meter.py), the
collective recorder (``comm.record_step``, comm_record.py), the matmul census
(``profiling.matmul_census_step``, matmul_census.py) and the profiler (``[profiling]``,
profiler.py). Every file they write goes through trainer/runtime/files.py.

It may import ``trainer.config``, ``trainer.runtime`` (files) and ``trainer.simulation`` (the
run mode decides whether the fake meter runs), ``models`` and ``parallel_dims``; the loop
builds and calls it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from trainer.config import JobConfig
from trainer.instruments.base import HookBase, Instruments, StepHook
from trainer.simulation.run_mode import RunMode

__all__ = ["HookBase", "Instruments", "StepHook", "build_instruments"]


def build_instruments(
    cfg: JobConfig,
    mode: RunMode,
    *,
    parallel_dims,
    rank: int,
    world_size: int,
    device: torch.device,
    model_parts: Sequence[nn.Module],
    optimizer,
    first_step: int,
    log: Callable[[str], None],
) -> Instruments:
    """The hooks ``cfg`` asks for, in the order they wrap a step (outermost first): the profiler
    (its step boundary comes after everything else of the step), the fake meter (its time
    includes the recorder's and the census's work, marked in its report), the collective
    recorder, the matmul census. Built as the loop starts: the profiler starts recording."""
    from trainer.instruments.comm_record import CommRecordHook
    from trainer.instruments.fake_meter import FakeStepMeter
    from trainer.instruments.matmul_census import MatmulCensusHook
    from trainer.instruments.profiler import StepProfiler

    folder = cfg.job.dump_folder
    degrees = parallel_dims.degrees.as_dict()
    meta = {"rank": rank, "world_size": world_size, "comm_mode": cfg.comm.mode, "degrees": degrees}
    hooks: list[StepHook] = [StepProfiler(cfg.profiling, folder, rank, device, first_step=first_step)]
    if mode.meters_steps:
        hooks.append(FakeStepMeter(cfg.comm, folder, device, degrees, model_parts, optimizer))
    if cfg.comm.record_step:
        hooks.append(CommRecordHook(cfg.comm.record_step, parallel_dims, folder, meta, log))
    if cfg.profiling.matmul_census_step:
        hooks.append(MatmulCensusHook(cfg.profiling.matmul_census_step, folder, meta, log))
    return Instruments(hooks)
