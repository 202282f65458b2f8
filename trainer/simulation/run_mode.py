"""Real run or simulation: the one place the trainer asks which.

A run is real (every rank a process, collectives move data) or simulated in one process:
``comm.mode = "fake_backend"`` plays rank ``comm.fake_rank`` of ``comm.fake_world_size``
(trainer/simulation/fake_backend.py: shapes, memory and compute are the real rank's, values are
not), ``comm.mode = "local_tensor"`` runs every rank of the layout with real values
(trainer/simulation/local_tensor.py). Each mode is one object, built once from the config
(:meth:`RunMode.from_config`): :class:`RunMode` is the real run, :class:`FakeBackendRun` and
:class:`LocalTensorRun` override what they change. The trainer asks it the questions whose
answer differs; nothing else reads ``comm.mode`` (the config's own checks aside), and code
without the config asks :meth:`RunMode.simulating` of the process.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from trainer.config import ConfigError, JobConfig
from trainer.simulation.fake_backend import init_fake_process_group, is_fake_backend, prepare_fake_config
from trainer.simulation.local_tensor import (
    PerRankLoader,
    check_all_local,
    enter_local_tensor_mode,
    prepare_local_tensor_config,
)

__all__ = ["FakeBackendRun", "LocalTensorRun", "RunMode"]


class RunMode:
    """A real run: every rank is a process of the job. The simulated modes subclass it."""

    fake = False  # one rank of a larger job on torch's fake backend
    local = False  # every rank of the job in this process

    def __init__(self, world_size: int | None = None, rank: int = 0):
        self.world_size, self.rank = world_size, rank  # the simulated job's (comm.fake_*)

    @staticmethod
    def from_config(cfg: JobConfig) -> RunMode:
        c = cfg.comm
        mode = {"fake_backend": FakeBackendRun, "local_tensor": LocalTensorRun}.get(c.mode, RunMode)
        return mode(c.fake_world_size, c.fake_rank)

    @staticmethod
    def simulating() -> bool:
        """Whether this process simulates its job (its default group is the fake backend:
        ``fake_backend`` or ``local_tensor``): one process, which prints as rank 0 and has no
        peer to wait for. For code that has no config to ask."""
        return is_fake_backend()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(world_size={self.world_size}, rank={self.rank})"

    def prepare(self, cfg: JobConfig) -> list[str]:
        """Adjust ``cfg`` in place before anything is built (a fake run writes to its own folder;
        neither a fake nor a local_tensor run saves checkpoints); the notes to log."""
        return []

    def start_process_group(self) -> None:
        """Create the default process group of a simulated run; a real run joins its job
        instead (trainer/runtime/distributed_init.py), so nothing here."""

    @property
    def checks_divergence(self) -> bool:
        """Whether a non-finite loss or gradient norm stops the run (fake values are meaningless)."""
        return True

    @property
    def skips_on_device(self) -> bool:
        """Whether an optimizer that can skip a non-finite step on the device may (the step's one
        host read then comes after the update is queued)."""
        return self.checks_divergence

    def metrics_rank(self, rank: int) -> int:
        """The rank whose metrics this process writes: a fake run logs as the rank it plays."""
        return rank

    def has_peers(self, world_size: int) -> bool:
        """Whether other processes take part (a step can hang on one): the step watchdog's case."""
        return world_size > 1

    @property
    def meters_steps(self) -> bool:
        """Whether each step's compute time and peak memory are measured (the fake meter)."""
        return False

    def loader(self, build: Callable[[int], Any], parallel_dims, world_size: int) -> Any:
        """The training loader: ``build(batch_coordinate)`` of this rank."""
        return build(parallel_dims.coordinate("batch"))

    def check_step(self, model_parts, optimizer) -> None:
        """After the optimizer step: what must hold of the weights and optimizer state."""


class FakeBackendRun(RunMode):
    """``comm.mode = "fake_backend"``: this process plays one rank of a larger job."""

    fake = True

    def prepare(self, cfg: JobConfig) -> list[str]:
        return prepare_fake_config(cfg)

    def start_process_group(self) -> None:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ConfigError(
                f"comm.mode = 'fake_backend' runs one process that plays rank comm.fake_rank of "
                f"comm.fake_world_size ranks, but this launch started {os.environ['WORLD_SIZE']} "
                f"processes: use python train.py (or torchrun --nproc_per_node=1)"
            )
        init_fake_process_group(self.world_size, self.rank)

    @property
    def checks_divergence(self) -> bool:
        return False

    def metrics_rank(self, rank: int) -> int:
        return 0

    def has_peers(self, world_size: int) -> bool:
        return False

    @property
    def meters_steps(self) -> bool:
        return True


class LocalTensorRun(RunMode):
    """``comm.mode = "local_tensor"``: every rank of the job in this process, real values."""

    local = True

    def prepare(self, cfg: JobConfig) -> list[str]:
        return prepare_local_tensor_config(cfg)

    def start_process_group(self) -> None:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ConfigError(
                f"comm.mode = 'local_tensor' simulates all comm.fake_world_size ranks in one process, but "
                f"this launch started {os.environ['WORLD_SIZE']} processes: use python train.py"
            )
        enter_local_tensor_mode(self.world_size)

    @property
    def skips_on_device(self) -> bool:
        return False  # the step's values are read on the host, reduced over every simulated rank

    def has_peers(self, world_size: int) -> bool:
        return False  # the simulated peers are in this process: nothing can hang on another

    def loader(self, build: Callable[[int], Any], parallel_dims, world_size: int) -> Any:
        """Every simulated rank's slice, as one LocalTensor per micro-batch."""
        return PerRankLoader(build, parallel_dims, world_size)

    def check_step(self, model_parts, optimizer) -> None:
        """Every parameter, gradient and optimizer state holds every rank's value."""
        check_all_local(model_parts, optimizer)
