"""Per-step training metrics: console line, TensorBoard scalars and ``metrics.jsonl``.

Validation results are records of their own in the same file (``validation_loss``,
``validation_perplexity``, no ``loss`` key), written after the training record of their step.

Only rank 0 writes (the trainer reduces loss/grad-norm across ranks before logging), so
N ranks do not produce N copies. The JSONL file is flushed after every line: when a run
crashes or is killed, the file still holds every step logged so far and stays parseable.

Throughput is reported per device (global tokens / world size / seconds), the number that
is comparable across cluster sizes; MFU = achieved model FLOP/s per device / peak FLOP/s.
"""

from __future__ import annotations

import json
import math
import os
import resource
import time
from typing import Any

import torch

from models.common.flops import model_flops_per_token  # noqa: F401 - part of this module's API
from trainer.config import JobConfig
from trainer.config import Metrics as MetricsConfig

# Dense peak FLOP/s per device (no sparsity). float32 matmuls run as TF32 on these parts.
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "H200": {"bfloat16": 989e12, "float32": 494.5e12},
    "H100 PCIe": {"bfloat16": 756e12, "float32": 378e12},
    "H100": {"bfloat16": 989e12, "float32": 494.5e12},  # SXM; checked after "H100 PCIe"
    "A100": {"bfloat16": 312e12, "float32": 156e12},
    "L40S": {"bfloat16": 362e12, "float32": 183e12},
    "B200": {"bfloat16": 2250e12, "float32": 1125e12},
}


def peak_flops(device_name: str, dtype: str = "bfloat16") -> float | None:
    """Peak FLOP/s for a CUDA device name (e.g. ``torch.cuda.get_device_name()``), or None
    when unknown - MFU is then omitted rather than computed against a guess."""
    for key, table in PEAK_FLOPS.items():
        if key.lower() in device_name.lower():
            return table.get(dtype)
    return None


def format_duration(seconds: float) -> str:
    """``42s``, ``3m05s``, ``2h07m``: what a person reads at a glance."""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def training_flops_per_token(model: torch.nn.Module, seq_len: int) -> float:
    """:func:`model_flops_per_token` of one of our models (whole, unsharded; meta is fine):
    its active parameters (MoE: shared experts plus top-k of the routed ones) and the attention
    width of its queries and keys, as the model contract states them
    (``models/common/decoder.Decoder.flops_per_token``)."""
    return model.flops_per_token(seq_len)


def memory_gib(device: torch.device | str | None = None) -> tuple[str, float]:
    """('cuda_max_alloc', GiB) since the last reset on GPU, else ('cpu_rss', GiB) now."""
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda" and torch.cuda.is_available():
        value = torch.cuda.max_memory_allocated(device) / 2**30
        torch.cuda.reset_peak_memory_stats(device)
        return "cuda_max_alloc", value
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return "cpu_rss", pages * os.sysconf("SC_PAGE_SIZE") / 2**30
    except (OSError, ValueError):  # non-Linux: peak RSS (KiB on Linux, bytes on macOS)
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return "cpu_rss", rss / (2**30 if os.uname().sysname == "Darwin" else 2**20)


class MetricsLogger:
    """Call ``log`` on every rank at the steps ``should_log`` selects; non-zero ranks only
    reset their timer, so the interval timing stays aligned across ranks."""

    def __init__(
        self,
        run_folder: str,
        rank: int,
        cfg: JobConfig | MetricsConfig,
        *,
        world_size: int = 1,
        flops_per_token: float | None = None,
        device: torch.device | str | None = None,
        peak_flops_per_device: float | None = None,
        total_steps: int | None = None,
    ):
        mcfg = cfg.metrics if isinstance(cfg, JobConfig) else cfg
        self.cfg, self.rank, self.world_size = mcfg, rank, world_size
        self.total_steps = total_steps
        # (step, time) of every log call since the logger started, for the time left
        self._marks: list[tuple[int, float]] = []
        self.run_folder = run_folder
        self.flops_per_token = flops_per_token
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        if peak_flops_per_device is None and self.device.type == "cuda" and torch.cuda.is_available():
            dtype = cfg.parallelism.mixed_precision_param if isinstance(cfg, JobConfig) else "bfloat16"
            peak_flops_per_device = peak_flops(torch.cuda.get_device_name(self.device), dtype)
        # MFU on CPU is meaningless (no meaningful peak), so it is only shown for GPUs.
        self.peak_flops = peak_flops_per_device if self.device.type == "cuda" else None
        self._tb = None
        self._jsonl = None
        self._last_time = time.perf_counter()
        if rank != 0:
            return
        os.makedirs(run_folder, exist_ok=True)
        if mcfg.enable_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            tb_dir = mcfg.save_tb_folder
            self._tb = SummaryWriter(log_dir=tb_dir if os.path.isabs(tb_dir) else os.path.join(run_folder, tb_dir))
        if mcfg.enable_jsonl:
            self._jsonl = open(os.path.join(run_folder, "metrics.jsonl"), "a", buffering=1)

    @property
    def jsonl_path(self) -> str:
        return os.path.join(self.run_folder, "metrics.jsonl")

    def should_log(self, step: int) -> bool:
        return step == 1 or step % self.cfg.log_freq == 0

    def reset_timer(self) -> None:
        """Exclude non-training time (checkpoint saves, evaluation) from throughput."""
        self._last_time = time.perf_counter()

    def eta_seconds(self, step: int, now: float) -> float | None:
        """Time left to ``total_steps`` at the pace since the first logged step (which carries
        start-up and compilation, so it is left out once there is a later one)."""
        if self.total_steps is None or not self._marks:
            return None
        (first_step, first_time) = self._marks[0]
        if step <= first_step:
            return None
        per_step = (now - first_time) / (step - first_step)
        return max(self.total_steps - step, 0) * per_step

    def log(
        self,
        step: int,
        *,
        loss: float,
        grad_norm: float,
        lr: float,
        num_tokens: int,
        data_wait_s: float | None = None,
        extra: dict[str, float | str] | None = None,
    ) -> dict[str, Any] | None:
        """``num_tokens``: global tokens trained since the previous ``log`` call (all ranks,
        e.g. steps_since_last_log * global_batch_size * seq_len). ``data_wait_s``: seconds the
        training loop waited for data per step (mean since the previous ``log`` call; rank 0's),
        shown as ``data X ms``: when it is a large part of the step, data is the bottleneck.
        Returns the record on rank 0."""
        now = time.perf_counter()
        elapsed = max(now - self._last_time, 1e-9)
        self._last_time = now
        eta = self.eta_seconds(step, now)
        self._marks.append((step, now))
        if self.rank != 0:
            return None
        tps = num_tokens / self.world_size / elapsed
        mem_name, mem = memory_gib(self.device)
        record: dict[str, Any] = {
            "step": step,
            "loss": float(loss),
            "grad_norm": float(grad_norm),
            "lr": float(lr),
            "tps": tps,
            "elapsed_s": elapsed,
            mem_name + "_gib": mem,
            "time": time.time(),
        }
        if data_wait_s is not None:
            record["data_wait_s"] = float(data_wait_s)
        if self.flops_per_token is not None:
            record["tflops"] = self.flops_per_token * tps / 1e12
            if self.peak_flops:
                record["mfu_pct"] = 100.0 * self.flops_per_token * tps / self.peak_flops
        if extra:
            record.update({k: v if isinstance(v, str) else float(v) for k, v in extra.items()})

        if eta is not None:
            record["eta_s"] = eta
        if self.total_steps is not None:
            width = len(str(self.total_steps))
            where = f"step {step:{width}d}/{self.total_steps}"
        else:
            where = f"step {step:6d}"
        line = (
            f"{where}  loss {record['loss']:8.4f}  grad_norm {record['grad_norm']:8.4f}  "
            f"lr {record['lr']:.3e}  tps {tps:10,.0f}  {mem_name} {mem:6.2f}GiB"
        )
        if "data_wait_s" in record:
            line += f"  data {1e3 * record['data_wait_s']:7.1f}ms"
        if "tflops" in record:
            line += f"  tflops {record['tflops']:7.2f}"
        if "mfu_pct" in record:
            line += f"  mfu {record['mfu_pct']:5.2f}%"
        if eta is not None:
            line += f"  eta {format_duration(eta)}"
        print(line, flush=True)
        self._write(step, record)
        return record

    def log_validation(
        self, step: int, *, loss: float, steps: int, tokens: int, seconds: float
    ) -> dict[str, Any] | None:
        """One evaluation after training step ``step``: its loss (token-weighted mean over
        ``steps`` validation steps of ``tokens`` tokens in all) and perplexity = exp(loss).
        Its own metrics.jsonl record (``validation_loss``, ``validation_perplexity``, no
        ``loss``), TensorBoard scalars of the same names, and a console line. Returns the
        record on rank 0."""
        if self.rank != 0:
            return None
        perplexity = math.exp(loss) if math.isfinite(loss) and loss < 700 else math.inf
        record: dict[str, Any] = {
            "step": step,
            "validation_loss": float(loss),
            "validation_perplexity": perplexity,
            "validation_steps": int(steps),
            "validation_tokens": int(tokens),
            "validation_s": float(seconds),
            "time": time.time(),
        }
        print(
            f"validation at step {step}: loss {loss:8.4f}  perplexity {perplexity:10.4f}  "
            f"({steps} steps, {tokens:,} tokens, {seconds:.2f}s)",
            flush=True,
        )
        self._write(step, record)
        return record

    def _write(self, step: int, record: dict[str, Any]) -> None:
        if self._jsonl is not None:
            self._jsonl.write(
                json.dumps(
                    {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
                )
                + "\n"
            )
            self._jsonl.flush()
        if self._tb is not None:
            for k, v in record.items():
                if k not in ("step", "time") and isinstance(v, (int, float)):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
