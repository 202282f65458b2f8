"""Per-step training metrics: console line, TensorBoard scalars, ``metrics.jsonl`` and, with
``metrics.enable_wandb``, a Weights & Biases run (trainer/reporting/wandb_log.py).

Validation results are records of their own in the same file (``validation_loss``,
``validation_perplexity``, no ``loss`` key), written after the training record of their step.

Only rank 0 writes (the trainer reduces loss/grad-norm across ranks before logging), so
N ranks do not produce N copies. The JSONL file is flushed after every line: when a run
crashes or is killed, the file still holds every step logged so far and stays parseable.

Throughput is reported per device (global tokens / world size / seconds: ``tps`` in the
records, ``tok/s/dev`` on the console line), the number that is comparable across cluster sizes;
MFU = achieved model FLOP/s per device / peak FLOP/s. Times in a record: ``interval_s``, the
training seconds of the interval since the previous step record (what ``tps`` divides by;
checkpoint saves and validation left out), and ``elapsed_s``, wall seconds since this launch's
logger started (everything included; it restarts at 0 in a resumed launch).
"""

from __future__ import annotations

import json
import math
import os
import re
import resource
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from models.common.flops import model_flops_per_token  # noqa: F401 - part of this module's API
from trainer.config import JobConfig
from trainer.config import Metrics as MetricsConfig
from trainer.runtime.precision import cuda_tf32_enabled, matmul_precision

# ----------------------------------------------------------------------------- peak FLOP/s
#
# MFU divides the achieved model FLOP/s per device by the peak of the precision the model's
# matmuls actually run in (trainer/runtime/precision.py ``matmul_precision``):
#   "float32"  IEEE fp32 on the CUDA cores: a float32 run with training.enable_tf32 = false
#   "tf32"     float32 tensors on TF32 tensor cores: a float32 run with enable_tf32 = true
#   "bfloat16" / "float16"  mixed precision (parallelism.mixed_precision_param)
#   "float8"   for a later float8 path; parts without FP8 tensor cores (A100) have no entry
# Dense figures (no 2:4 sparsity). NVIDIA's datasheets print the tensor-core rates with
# sparsity (marked * below); the dense rate is half of that, for bf16/fp16/fp8 rounded down to a
# whole TFLOP/s (H100 SXM bf16 1,979* -> 989, the Hopper whitepaper's dense 989.4 and the figure
# torchtitan's table uses; likewise 756 and 835). IEEE fp32 is the datasheet's "FP32" (CUDA cores).
PRECISIONS = ("float32", "tf32", "bfloat16", "float16", "float8")


@dataclass(frozen=True)
class GpuPeak:
    """One GPU part: the words of its ``torch.cuda.get_device_name()`` that identify it, and
    its dense peak FLOP/s per precision (:data:`PRECISIONS`)."""

    part: str
    words: tuple[str, ...]
    flops: dict[str, float] = field(hash=False)


def _tf(fp32: float, tf32: float, bf16: float, fp16: float, fp8: float | None = None) -> dict[str, float]:
    """Dense TFLOP/s per precision -> FLOP/s keyed by :data:`PRECISIONS`."""
    table = {"float32": fp32, "tf32": tf32, "bfloat16": bf16, "float16": fp16, "float8": fp8}
    return {k: v * 1e12 for k, v in table.items() if v is not None}


GPU_PEAKS: tuple[GpuPeak, ...] = (
    # NVIDIA H100 datasheet (SXM column): FP32 67 TF, TF32 989*, BF16/FP16 1,979*, FP8 3,958*.
    # Hopper whitepaper (SXM5 dense): TF32 494.7, BF16/FP16 989.4, FP8 1,978.9. Device names
    # "NVIDIA H100 80GB HBM3", "NVIDIA H100".
    GpuPeak("H100 SXM", ("h100",), _tf(fp32=67, tf32=494.5, bf16=989, fp16=989, fp8=1979)),
    # Same datasheet, PCIe column (80 GB): FP32 51, TF32 756*, BF16/FP16 1,513*, FP8 3,026*.
    GpuPeak("H100 PCIe", ("h100", "pcie"), _tf(fp32=51, tf32=378, bf16=756, fp16=756, fp8=1513)),
    # Same datasheet, H100 NVL column (per GPU, 94 GB): FP32 60, TF32 835*, BF16/FP16 1,671*,
    # FP8 3,341*. Less certain than the SXM/PCIe rows: the 2023 launch sheet quoted the NVL *pair*
    # (188 GB, FP32 134, BF16 3,958*); these are the later per-card (94 GB) figures.
    GpuPeak("H100 NVL", ("h100", "nvl"), _tf(fp32=60, tf32=417.5, bf16=835, fp16=835, fp8=1670)),
    # NVIDIA H200 datasheet, SXM column: FP32 67, TF32 989*, BF16/FP16 1,979*, FP8 3,958*
    # (the H100 SXM's compute with more, faster memory). Device name "NVIDIA H200".
    GpuPeak("H200 SXM", ("h200",), _tf(fp32=67, tf32=494.5, bf16=989, fp16=989, fp8=1979)),
    # H200 datasheet, NVL column: FP32 60, TF32 835*, BF16/FP16 1,671*, FP8 3,341*.
    GpuPeak("H200 NVL", ("h200", "nvl"), _tf(fp32=60, tf32=417.5, bf16=835, fp16=835, fp8=1670)),
    # NVIDIA GH200 datasheet: FP32 67, TF32 494 | 989*, BF16/FP16 990 | 1,979*, FP8 1,979 |
    # 3,958*: the H100 SXM's figures. "NVIDIA GH200 480GB" (its own word: "gh200" is not "h200").
    GpuPeak("GH200", ("gh200",), _tf(fp32=67, tf32=494.5, bf16=989, fp16=989, fp8=1979)),
    # NVIDIA A100 datasheet: FP32 19.5, TF32 156 | 312*, BF16/FP16 312 | 624*; no FP8. The same
    # figures for SXM4 and PCIe, 40 GB and 80 GB ("NVIDIA A100-SXM4-80GB", "NVIDIA A100-PCIE-40GB",
    # "NVIDIA A100 80GB PCIe"); the PCIe cards' lower power limit shows in achieved, not peak, rates.
    GpuPeak("A100 SXM", ("a100",), _tf(fp32=19.5, tf32=156, bf16=312, fp16=312)),
    GpuPeak("A100 PCIe", ("a100", "pcie"), _tf(fp32=19.5, tf32=156, bf16=312, fp16=312)),
    # NVIDIA HGX B200 datasheet (8 GPUs): FP32 600 TF, TF32 18 PF*, FP16/BF16 36 PF*, FP8 72 PF*
    # -> per GPU FP32 75, TF32 1,125, BF16/FP16 2,250, FP8 4,500 dense. Less certain than the
    # Hopper rows: NVIDIA has revised the Blackwell sheets, and a B200 inside a GB200 (higher
    # power) is rated higher; a GB200's name ("gb200") does not match this row.
    GpuPeak("B200", ("b200",), _tf(fp32=75, tf32=1125, bf16=2250, fp16=2250, fp8=4500)),
    # NVIDIA L40S datasheet: FP32 91.6, TF32 183 | 366*, BF16/FP16 362.05 | 733*, FP8 733 | 1,466*.
    GpuPeak("L40S", ("l40s",), _tf(fp32=91.6, tf32=183, bf16=362.05, fp16=362.05, fp8=733)),
)

# part -> {precision: dense FLOP/s}, the table the layout planner (tools/planner/hardware.py) reads
PEAK_FLOPS: dict[str, dict[str, float]] = {p.part: dict(p.flops) for p in GPU_PEAKS}


def _name_words(device_name: str) -> set[str]:
    return set(re.split(r"[^a-z0-9]+", device_name.lower())) - {""}


def find_gpu(device_name: str) -> GpuPeak | None:
    """The :data:`GPU_PEAKS` row of a CUDA device name: every word of the row is a word of the
    name, the row with the most words wins ("NVIDIA H100 NVL" is the NVL part, "NVIDIA H100
    80GB HBM3" the SXM one); None for a part the table lacks."""
    words = _name_words(device_name)
    best: GpuPeak | None = None
    for row in GPU_PEAKS:
        if set(row.words) <= words and (best is None or len(row.words) > len(best.words)):
            best = row
    return best


def peak_flops(device_name: str, dtype: str = "bfloat16") -> float | None:
    """Dense peak FLOP/s of a CUDA device name (``torch.cuda.get_device_name()``) at a matmul
    precision (:data:`PRECISIONS`: "float32" is IEEE fp32, "tf32" float32 on TF32 tensor cores),
    or None when the part or that precision on it is unknown: MFU is then omitted rather than
    computed against a guess."""
    if dtype not in PRECISIONS:
        raise ValueError(f"unknown matmul precision {dtype!r}; one of {', '.join(PRECISIONS)}")
    row = find_gpu(device_name)
    return row.flops.get(dtype) if row is not None else None


def mfu_basis(device_name: str, precision: str, peak: float | None) -> str:
    """One line saying what MFU is computed against (or why it is left out)."""
    row = find_gpu(device_name)
    if peak is None:
        where = f"the {row.part} has no {precision} entry" if row else "the GPU is not in the table"
        return f"mfu: omitted for {device_name} at {precision} ({where}: trainer/reporting/metrics.py GPU_PEAKS)"
    line = f"mfu: against the {row.part} dense {precision} peak, {peak / 1e12:g} TFLOP/s ({device_name})"
    if precision == "float32":
        line += (
            f"; float32 matmuls run in IEEE fp32: --training.enable_tf32 true runs them on TF32 tensor "
            f"cores ({row.flops['tf32'] / 1e12:g} TFLOP/s peak), bfloat16 mixed precision at "
            f"{row.flops['bfloat16'] / 1e12:g}"
        )
    return line


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
        param_dtype: str = "bfloat16",
        resumed: bool = False,
    ):
        """``resumed``: the trainer continues from a checkpoint (W&B then continues the run
        whose id the checkpoint folder holds)."""
        mcfg = cfg.metrics if isinstance(cfg, JobConfig) else cfg
        self.cfg, self.rank, self.world_size = mcfg, rank, world_size
        self.total_steps = total_steps
        # (step, time) of every log call since the logger started, for the time left
        self._marks: list[tuple[int, float]] = []
        self.run_folder = run_folder
        self.flops_per_token = flops_per_token
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        # what MFU divides by, in words, for the start-up log (None on CPU or with a given peak)
        self.peak_note: str | None = None
        if peak_flops_per_device is None and self.device.type == "cuda" and torch.cuda.is_available():
            # the precision the matmuls run in: the FSDP compute dtype (``param_dtype``, the job
            # plan's), float32 split by the TF32 flag as it stands now (the trainer applied
            # training.enable_tf32 at start-up)
            precision = matmul_precision(param_dtype, cuda_tf32_enabled())
            name = torch.cuda.get_device_name(self.device)
            peak_flops_per_device = peak_flops(name, precision)
            self.peak_note = mfu_basis(name, precision, peak_flops_per_device)
        # MFU on CPU is meaningless (no meaningful peak), so it is only shown for GPUs.
        self.peak_flops = peak_flops_per_device if self.device.type == "cuda" else None
        self._tb = None
        self._jsonl = None
        self._wandb = None
        self._last_time = self._started = time.perf_counter()
        self._excluded = 0.0  # seconds to leave out of the interval being timed (checkpoint saves)
        self._committed = False  # the writers open at the first record (:meth:`commit`)
        if rank != 0:
            return
        os.makedirs(run_folder, exist_ok=True)
        if mcfg.enable_wandb:  # first: a run W&B refuses to start opens nothing else
            from trainer.reporting.wandb_log import start_wandb_run

            self._wandb = start_wandb_run(mcfg, run_folder, cfg if isinstance(cfg, JobConfig) else None, resumed)

    def commit(self) -> None:
        """The run goes on (the trainer calls it after its first step; the first record calls it
        too): metrics.jsonl and TensorBoard's event file are opened and a new W&B run's id is
        stored. Until then the logger has written nothing into the run folder, so a run that
        fails at start-up leaves the folder it resumed byte-identical. Rank 0 only writes."""
        if self._committed or self.rank != 0:
            return
        self._committed = True
        mcfg = self.cfg
        if self._wandb is not None:
            self._wandb.commit()
        if mcfg.enable_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            tb_dir = mcfg.save_tb_folder
            self._tb = SummaryWriter(log_dir=tb_dir if os.path.isabs(tb_dir) else os.path.join(self.run_folder, tb_dir))
        if mcfg.enable_jsonl:
            self._jsonl = open(self.jsonl_path, "a", buffering=1)

    @property
    def jsonl_path(self) -> str:
        return os.path.join(self.run_folder, "metrics.jsonl")

    def should_log(self, step: int) -> bool:
        return step == 1 or step % self.cfg.log_freq == 0

    def reset_timer(self) -> None:
        """Exclude non-training time (checkpoint saves, evaluation) from throughput."""
        self._last_time = time.perf_counter()
        self._excluded = 0.0

    def exclude(self, seconds: float) -> None:
        """Leave ``seconds`` spent since the last log (a checkpoint save) out of the next logged
        interval's time."""
        self._excluded += seconds

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
        elapsed = max(now - self._last_time - self._excluded, 1e-9)
        self._last_time, self._excluded = now, 0.0
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
            "interval_s": elapsed,
            "elapsed_s": now - self._started,
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
            # counts (epoch, tokens_ and targets_ per source) stay integers
            record.update({k: v if isinstance(v, (str, int)) else float(v) for k, v in extra.items()})

        if eta is not None:
            record["eta_s"] = eta
        if self.total_steps is not None:
            width = len(str(self.total_steps))
            where = f"step {step:{width}d}/{self.total_steps}"
        else:
            where = f"step {step:6d}"
        line = (
            f"{where}  loss {record['loss']:8.4f}  grad_norm {record['grad_norm']:8.4f}  "
            f"lr {record['lr']:.3e}  tok/s/dev {tps:10,.0f}  {mem_name} {mem:6.2f}GiB"
        )
        if "mtp_loss" in record:
            line += f"  mtp_loss {record['mtp_loss']:8.4f}"
        if "epoch" in record:  # complete passes over the data (trainer/reporting/data_progress.py)
            line += f"  epoch {record['epoch']}"
        if "data_wait_s" in record:
            line += f"  data {1e3 * record['data_wait_s']:7.1f}ms"
        if "tflops" in record:
            line += f"  tflops {record['tflops']:7.2f}"
        if "mfu_pct" in record:
            line += f"  mfu {record['mfu_pct']:5.2f}%"
        if "checkpoint_stall_s" in record:
            line += f"  ckpt stall {record['checkpoint_stall_s']:.2f}s"
        if "checkpoint_write_s" in record:
            line += f"  ckpt write {record['checkpoint_write_s']:.2f}s"
        if "hf_export_s" in record:
            line += f"  hf export {record['hf_export_s']:.2f}s"
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

    def log_checkpoint(self, step: int, values: dict[str, float]) -> dict[str, Any] | None:
        """Checkpoint metrics that come after the step's line (the last save, finished at the
        end of training): a metrics.jsonl record and TensorBoard scalars, no console line (the
        checkpoint manager printed one). Returns the record on rank 0."""
        if self.rank != 0:
            return None
        record: dict[str, Any] = {"step": step, **{k: float(v) for k, v in values.items()}, "time": time.time()}
        self._write(step, record)
        return record

    def log_event(self, step: int, values: dict[str, Any]) -> dict[str, Any] | None:
        """A row of its own for something that happened at ``step`` (a rollback:
        trainer/bad_steps.py), no console line. Returns the record on rank 0."""
        if self.rank != 0:
            return None
        record: dict[str, Any] = {"step": step, **values, "time": time.time()}
        self._write(step, record)
        return record

    def _write(self, step: int, record: dict[str, Any]) -> None:
        self.commit()
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
        if self._wandb is not None:
            self._wandb.log(step, record)

    def close(self, exit_code: int = 0) -> None:
        """Close every writer; W&B's run ends with ``exit_code`` (non-zero: failed) and its
        service process is shut down."""
        if self._wandb is not None:
            self._wandb.finish(exit_code)
            self._wandb = None
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        self.close(exit_code=0 if exc_type is None else 1)
