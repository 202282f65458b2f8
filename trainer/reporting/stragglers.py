"""Stragglers: every rank's step time, gathered every ``metrics.straggler_interval`` steps
(0: ``metrics.log_freq``) into the metrics row, and a rank slower than the median named in one
line with its host (docs/long_runs.md).

What a rank measures per step, on the host: ``data`` (the time it waited for its batch) and
``compute`` (the train step up to its end: forward, backward, the step's collectives, the
optimizer). Ranks that train in lockstep wait for each other inside the step's collectives, so
a rank slowed *before* a collective makes every rank's compute time longer alike; what tells
the slow rank apart is the time it spends after the last collective (the optimizer step and
anything the host does before the next step: the slowest rank arrives last at the end-of-step
agreement, where the others wait, and that wait is not in their compute) and its data wait (a
rank's own). The figures are the means over the interval; the first step (compilation, first
use of everything) is left out. One all-gather of a few floats per interval over the gloo group
the ranks already agree over (trainer/runtime/stop.py), none per step, none with one rank.

The row gets ``step_s_min``, ``step_s_median``, ``step_s_max``, ``step_s_slowest_rank`` (step =
compute + data), and ``data_wait_s_max``, ``data_wait_s_slowest_rank``; a rank whose step time
is more than ``metrics.straggler_threshold`` above the median (the lower median: one slow rank
of two does not hide in the mean) is named: ``straggler: rank 3 (host-a) took 0.412 s per step
over steps 11-20, 2.05x the median 0.201 s ...``.
"""

from __future__ import annotations

import socket
import statistics
import time

import torch
import torch.distributed as dist

__all__ = ["Stragglers"]


class Stragglers:
    """Per-step timing of this rank and the interval's gather (collective: every rank calls
    :meth:`after_step` at every step). ``m``: the ``[metrics]`` section."""

    def __init__(self, m, group: dist.ProcessGroup | None, world_size: int, first_step: int, log=print):
        self.interval = m.straggler_interval or m.log_freq
        self.threshold = m.straggler_threshold
        self.group = group if world_size > 1 else None
        self.world_size = world_size
        self.log = log
        self.first_step = first_step + 1  # left out of the figures
        self.hosts: list[str] | None = None
        self._t0 = 0.0
        self._sums = [0.0, 0.0]  # compute, data
        self._steps = 0
        self._since = first_step + 2

    def step_start(self) -> None:
        self._t0 = time.perf_counter()

    def step_done(self, step: int, data_wait_s: float) -> float:
        """The rank's step (``step_start`` until now) is over; returns its compute seconds."""
        total = time.perf_counter() - self._t0
        compute = max(total - data_wait_s, 0.0)
        if step > self.first_step:
            self._sums[0] += compute
            self._sums[1] += data_wait_s
            self._steps += 1
        return compute

    def add_compute(self, seconds: float) -> None:
        """Time this rank spent in its step's work outside :meth:`step_done`'s window (a
        ``slow`` fault's sleep: trainer/faults.py)."""
        if self._steps:
            self._sums[0] += seconds

    def after_step(self, step: int) -> dict[str, float | int]:
        """Every ``interval`` steps (collective over the group): the gathered figures for the
        metrics row, and the line naming a straggler; {} at other steps or with one rank."""
        if self.group is None or step % self.interval or not self._steps:
            return {}
        mine = torch.tensor([s / self._steps for s in self._sums], dtype=torch.float64)
        every = [torch.zeros_like(mine) for _ in range(self.world_size)]
        dist.all_gather(every, mine, group=self.group)
        since, self._since = self._since, step + 1
        self._sums, self._steps = [0.0, 0.0], 0
        compute = [float(t[0]) for t in every]
        data = [float(t[1]) for t in every]
        steps = [c + d for c, d in zip(compute, data)]
        median = statistics.median_low(steps)
        slowest = max(range(self.world_size), key=steps.__getitem__)
        data_slowest = max(range(self.world_size), key=data.__getitem__)
        row: dict[str, float | int] = {
            "step_s_min": min(steps),
            "step_s_median": statistics.median(steps),
            "step_s_max": steps[slowest],
            "step_s_slowest_rank": slowest,
            "data_wait_s_max": data[data_slowest],
            "data_wait_s_slowest_rank": data_slowest,
        }
        slow = [r for r in range(self.world_size) if steps[r] > (1 + self.threshold) * median]
        if slow:
            if self.hosts is None:  # once, on the first interval that needs them (every rank takes part)
                self.hosts = [""] * self.world_size
                dist.all_gather_object(self.hosts, socket.gethostname(), group=self.group)
            for r in slow:
                self.log(
                    f"straggler: rank {r} ({self.hosts[r]}) took {steps[r]:.3f} s per step over steps {since}-{step}, "
                    f"{steps[r] / median:.2f}x the median {median:.3f} s (compute {compute[r]:.3f} s, data wait "
                    f"{data[r]:.3f} s; metrics.straggler_threshold = {self.threshold})"
                )
        return row
