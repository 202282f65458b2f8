"""Real run or one rank on the fake backend: the one place the trainer asks which.

A run is either real (every rank a process, collectives move data) or, with ``comm.mode =
"fake_backend"``, one process playing rank ``comm.fake_rank`` of ``comm.fake_world_size``
(trainer/simulation/fake_backend.py): shapes, memory and compute are the real rank's, values are not. The
trainer builds one :class:`RunMode` from the config and asks it the few questions whose answer
differs; nothing else in the loop tests the mode.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.config import JobConfig
from trainer.simulation.fake_backend import prepare_fake_config
from trainer.simulation.local_tensor import prepare_local_tensor_config

__all__ = ["RunMode"]


@dataclass(frozen=True)
class RunMode:
    fake: bool  # one rank of a larger job on torch's fake backend
    local: bool = False  # every rank of the job in this process (trainer/simulation/local_tensor.py)

    @classmethod
    def from_config(cls, cfg: JobConfig) -> RunMode:
        return cls(fake=cfg.comm.mode == "fake_backend", local=cfg.comm.mode == "local_tensor")

    def prepare(self, cfg: JobConfig) -> list[str]:
        """Adjust ``cfg`` in place before anything is built (a fake run writes to its own folder;
        neither a fake nor a local_tensor run saves checkpoints); the notes to log."""
        if self.local:
            return prepare_local_tensor_config(cfg)
        return prepare_fake_config(cfg) if self.fake else []

    @property
    def checks_divergence(self) -> bool:
        """Whether a non-finite loss or gradient norm stops the run (fake values are meaningless)."""
        return not self.fake

    def metrics_rank(self, rank: int) -> int:
        """The rank whose metrics this process writes: a fake run logs as the rank it plays."""
        return 0 if self.fake else rank

    def has_peers(self, world_size: int) -> bool:
        """Whether other processes take part (a step can hang on one): the step watchdog's case.
        A local_tensor run simulates its peers in this process: nothing can hang on another."""
        return not self.fake and not self.local and world_size > 1

    @property
    def meters_steps(self) -> bool:
        """Whether each step's compute time and peak memory are measured (the fake meter)."""
        return self.fake
