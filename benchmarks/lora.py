"""LoRA against full fine-tuning of the same model in the same run: per-rank parameter, gradient
and AdamW-state bytes and the peak memory of a training step (``make bench`` section ``lora``;
also ``python -m benchmarks.lora``).

Each variant is the real trainer (``train.py``) on one rank (rank 0) of an fsdp=2 job through
``comm.mode = fake_backend`` (trainer/simulation/fake_backend.py: the rank's real shards, optimizer and
step; collectives move no data), llama3 debugmodel (6 layers), seq_len 64, local batch 2,
2 steps, reading the run's ``fake_backend_report.json``: ``param_bytes``, ``grad_bytes``,
``optimizer_bytes`` (the rank's local shards) and the step's peak memory (on CPU the process's
peak RSS, which includes the Python and torch runtime: compare the differences). Variants: full
and LoRA (rank 8, default targets) in fp32, and in bf16 mixed precision, LoRA with its frozen
base stored in bf16 (``lora.frozen_dtype``). Reference: the full fine-tune of the same precision.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMON = [
    "--config", "llama3.toml", "--training.seq_len", "64", "--training.global_batch_size", "4",
    "--training.local_batch_size", "2", "--training.steps", "2", "--metrics.enable_tensorboard", "false",
    "--comm.mode", "fake_backend", "--comm.fake_world_size", "2", "--parallelism.dp_shard", "2",
    "--checkpoint.enable", "false",
]  # fmt: skip
VARIANTS = {
    "full fp32": [],
    "lora fp32": ["--model.converters", "lora"],
    "full bf16": ["--parallelism.mixed_precision_param", "bfloat16"],
    "lora bf16, frozen bf16": [
        "--parallelism.mixed_precision_param", "bfloat16", "--model.converters", "lora",
        "--lora.frozen_dtype", "bfloat16",
    ],
}  # fmt: skip


def _one(name: str, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "train.py", *COMMON, *extra, "--job.dump_folder", tmp]
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if out.returncode != 0:
            return {"variant": name, "error": (out.stderr.strip().splitlines() or ["?"])[-1]}
        report = json.loads(next(Path(tmp).rglob("fake_backend_report.json")).read_text())
    return {
        "variant": name,
        "param_bytes": report["param_bytes"],
        "grad_bytes": report["grad_bytes"],
        "optimizer_bytes": report["optimizer_bytes"],
        "state_bytes": report["param_bytes"] + report["grad_bytes"] + report["optimizer_bytes"],
        "peak_memory_mib": round(max(s["peak_memory_gib"] for s in report["steps"]) * 1024, 1),
        "memory_kind": report["steps"][-1]["memory_kind"],
    }


def run() -> list[dict]:
    rows = [_one(name, extra) for name, extra in VARIANTS.items()]
    by = {r["variant"]: r for r in rows}
    for lora, full in (("lora fp32", "full fp32"), ("lora bf16, frozen bf16", "full bf16")):
        a, b = by[lora], by[full]
        if "error" in a or "error" in b:
            continue
        a["optimizer_over_full"] = round(a["optimizer_bytes"] / b["optimizer_bytes"], 4)
        a["state_over_full"] = round(a["state_bytes"] / b["state_bytes"], 4)
        a["peak_saved_mib"] = round(b["peak_memory_mib"] - a["peak_memory_mib"], 1)
    for r in rows:
        print(
            f"lora {r['variant']:24s} "
            + (
                f"params {r['param_bytes'] / 2**20:6.2f} MiB, grads {r['grad_bytes'] / 2**20:6.2f}, "
                f"AdamW {r['optimizer_bytes'] / 2**20:6.2f}, peak {r['peak_memory_mib']:7.1f} MiB ({r['memory_kind']})"
                if "error" not in r
                else r["error"]
            ),
            file=sys.stderr,
        )
    return rows


if __name__ == "__main__":
    print(json.dumps(run(), indent=1))
