"""The fake-backend meter (``comm.mode = "fake_backend"``, trainer/simulation/fake_backend.py): per step,
this rank's compute time (the training step's wall time, synchronized on GPU), the CPU time the
process spent in it and its peak memory, in the console, in ``metrics.jsonl``
(``fake_step_time_s``, ``fake_cpu_time_s``, ``fake_peak_memory_gib``, ``fake_memory_kind``) and
in ``<dump_folder>/fake_backend_report.json`` with the rank's parameter, gradient and
optimizer-state bytes."""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from trainer.instruments.base import HookBase
from trainer.runtime.files import atomic_write_json
from trainer.simulation.fake_backend import FAKE_NOTE

__all__ = ["FakeStepMeter"]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _bytes(tensors) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors if t is not None)


def _reset_cpu_peak() -> bool:
    """Reset the kernel's peak-RSS mark of this process (Linux >= 4.0); False if unavailable."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _cpu_peak_bytes() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class FakeStepMeter(HookBase):
    """Times the training step and takes its peak memory; keeps the rank's state bytes and
    writes ``fake_backend_report.json`` after every step. ``model_parts`` and ``optimizer``:
    whose bytes the report counts (after the first step, when the optimizer state exists);
    ``comm``: the ``[comm]`` section (the rank played, the recorded step); the report is written
    into ``dump_folder``."""

    def __init__(
        self, comm, dump_folder: str, device: torch.device, degrees: dict[str, int], model_parts=(), optimizer=None
    ) -> None:
        super().__init__()
        self.model_parts, self.optimizer = model_parts, optimizer
        self.record_step = comm.record_step
        self.device = device
        self.world_size = comm.fake_world_size
        self.rank = comm.fake_rank
        self.degrees = degrees
        self.path = os.path.join(dump_folder, "fake_backend_report.json")
        self.steps: list[dict[str, Any]] = []
        self.state: dict[str, int] = {}
        self._t0 = 0.0
        self._cpu0 = 0.0
        self._cpu_peak_ok = False

    @property
    def memory_kind(self) -> str:
        return "cuda_max_alloc" if self.device.type == "cuda" else "cpu_peak_rss"

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._cpu_peak_ok = _reset_cpu_peak()
        self._cpu0 = time.process_time()
        self._t0 = time.perf_counter()

    def stop(self, step: int, *, recorded: bool = False) -> dict[str, Any]:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - self._t0
        cpu_seconds = time.process_time() - self._cpu0
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            peak = _cpu_peak_bytes() if self._cpu_peak_ok else None
        entry = {
            "step": step,
            "step_time_s": seconds,
            "cpu_time_s": cpu_seconds,
            "peak_memory_gib": None if peak is None else peak / 2**30,
            "memory_kind": self.memory_kind,
        }
        if recorded:
            entry["comm_recorded"] = True  # the recorder slowed this step
        self.steps.append(entry)
        peak_text = "n/a" if peak is None else f"{peak / 2**30:.3f} GiB"
        print(
            f"fake_backend rank {self.rank} of {self.world_size}: step {step} compute {seconds:.3f}s, "
            f"peak memory {peak_text} ({self.memory_kind})" + (" [collectives recorded]" if recorded else ""),
            flush=True,
        )
        return entry

    def note_grads(self, params) -> None:
        self.state["grad_bytes"] = _bytes([p.grad for p in params])

    def note_state(self, model_parts, optimizer) -> None:
        params = [p for part in model_parts for p in part.parameters()]
        self.state["local_params"] = sum(_local(p).numel() for p in params)
        self.state["param_bytes"] = _bytes(params)
        optimizers = getattr(optimizer, "optimizers", [optimizer])  # trainer.optim.optimizers.Optimizers: one per part
        states = [s[k] for opt in optimizers for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq") if k in s]
        self.state["optimizer_bytes"] = _bytes(states)

    def metrics(self, entry: dict[str, Any]) -> dict[str, float | str]:
        """The fields this step adds to the metrics record."""
        out: dict[str, float | str] = {
            "comm_mode": "fake_backend",
            "fake_world_size": float(self.world_size),
            "fake_rank": float(self.rank),
            "fake_step_time_s": entry["step_time_s"],
            "fake_cpu_time_s": entry["cpu_time_s"],
            "fake_memory_kind": entry["memory_kind"],
        }
        if entry["peak_memory_gib"] is not None:
            out["fake_peak_memory_gib"] = entry["peak_memory_gib"]
        return out

    def write(self) -> None:
        report = {
            "comm_mode": "fake_backend",
            "world_size": self.world_size,
            "rank": self.rank,
            "degrees": self.degrees,
            "device": str(self.device),
            "note": FAKE_NOTE,
            **self.state,
            "steps": self.steps,
        }
        atomic_write_json(self.path, report)

    # ------------------------------------------------------------------ the step hook
    def on_step_start(self, step: int) -> None:
        self.start()

    def on_grads_ready(self, params) -> None:
        self.note_grads(params)

    def on_step_end(self, step: int, result: Any) -> dict[str, float | str]:
        entry = self.stop(step, recorded=step == self.record_step)
        if not self.state.get("param_bytes"):
            self.note_state(self.model_parts, self.optimizer)
        self.write()
        return self.metrics(entry)
