"""Does AdamW's learning rate carry over to Muon? Loss curves of the real trainer with AdamW and
with Muon at AdamW's lr, at two model widths (``make bench`` section ``muon_lr``; the full
measurement of docs/optimizers.md is ``python -m benchmarks.muon_lr --full``).

Each run is ``train.py`` in one process (its own subprocess): the llama3 debug model with its
width set through ``model.flavor = "hf"`` and a config.json written from the debug model's
arguments with another ``dim`` (heads, KV heads, vocabulary, RoPE as the debug model; the SwiGLU
width from Llama's sizing rule), the synthetic corpus, ``optimizer.lr = 8e-4`` (the shipped
llama3.toml's), a WSD schedule (``lr_scheduler.decay_style = "wsd"``, 10% decay, 1-sqrt), the
same seed and batches for every run. Variants: AdamW; Muon with ``optimizer.muon_update_rms``
0.2 (Moonlight's RMS matching, the default: trainer/optim/muon.py) and 1.0 (the RMS of AdamW's first
update, what docs/optimizers.md recommends for small models at AdamW's lr). Per run: the loss averaged over the 10 steps ending at each checkpoint step
(one step's loss on a 4-row batch is noisy), and the update RMS of the hidden matrices (the
parameters Muon takes, measured for AdamW too): ``(W_new - W_old (1 - lr wd)) / lr``, mean over
the run after the first 10% of steps, and at step 1. The reference is AdamW in the same run:
``muon_minus_adamw`` is each Muon run's loss minus AdamW's at the last checkpoint (negative:
Muon ahead).

Sizes: ``make bench`` runs widths 128 and 256 with 2 blocks, 64-token rows, 120 steps (6 runs);
``--full`` runs the docs' table, widths 256 and 512 with the debug model's 6 blocks, 128-token
rows, 200 steps (6 runs of 1-7 minutes each on a shared 2-core host).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MOONLIGHT_RMS = 0.2
FIRST_ADAMW_RMS = 1.0  # the RMS of AdamW's first (sign) update
REDUCED = {"widths": [128, 256], "n_layers": 2, "seq_len": 64, "steps": 120}
FULL = {"widths": [256, 512], "n_layers": 6, "seq_len": 128, "steps": 200}
WINDOW = 10  # steps averaged per reported loss


def _default_rms() -> float:
    from trainer.config.optim_schema import Optimizer

    return Optimizer().muon_update_rms


def variants() -> dict[str, list[str]]:
    """Name -> the run's optimizer flags."""
    out = {"AdamW": ["--optimizer.name", "AdamW"]}
    for rms in dict.fromkeys([MOONLIGHT_RMS, _default_rms(), FIRST_ADAMW_RMS]):
        out[f"Muon rms {rms:g}"] = ["--optimizer.name", "Muon", "--optimizer.muon_update_rms", str(rms)]
    return out


def write_hf_config(folder: Path, dim: int, n_layers: int) -> None:
    """A config.json of the llama3 debug model at width ``dim`` with ``n_layers`` blocks."""
    from models.registry import get_hf_adapter, get_model_spec

    debug = get_model_spec("llama3", "debugmodel").args  # through the registry, as every shared module asks
    args = dataclasses.replace(debug, dim=dim, n_layers=n_layers)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(get_hf_adapter("llama3", args).hf_config("float32")))


def train_argv(hf_folder: Path, seq_len: int, steps: int, dump: Path) -> list[str]:
    return [
        "--config", "llama3.toml", "--model.flavor", "hf", "--model.hf_config", str(hf_folder),
        "--training.steps", str(steps), "--training.seq_len", str(seq_len),
        "--training.global_batch_size", "4", "--training.local_batch_size", "4",
        "--parallelism.data_parallel_shard_degree", "1", "--optimizer.lr", "8e-4",
        "--lr_scheduler.decay_style", "wsd", "--lr_scheduler.warmup_steps", str(max(1, steps // 20)),
        "--checkpoint.enable", "false", "--metrics.enable_tensorboard", "false", "--metrics.log_freq", "1",
        "--job.dump_folder", str(dump),
    ]  # fmt: skip


def _record_update_rms(out_path: str) -> None:
    """Wrap the trainer's optimizer step: after each step, the RMS of the hidden matrices' update
    divided by their lr, decoupled weight decay taken out (one number per step, over all of them)."""
    import torch

    from models.common.init import canonical_fqn
    from trainer.optim.groups import is_hidden_matrix
    from trainer.optim.optimizers import Optimizers

    per_step: list[float] = []
    step = Optimizers.step

    def recording_step(self, found_inf=None):
        hidden = {
            id(p)
            for part in self.model_parts
            for name, p in part.named_parameters()
            if is_hidden_matrix(canonical_fqn(name), p.ndim)
        }
        before = [
            (p, p.detach().clone(), g["lr"], g["weight_decay"])
            for opt in self.optimizers
            for g in opt.param_groups
            for p in g["params"]
            if id(p) in hidden
        ]
        step(self, found_inf)
        with torch.no_grad():
            sq = sum(((p - w * (1 - lr * wd)) / lr).double().pow(2).sum().item() for p, w, lr, wd in before)
        per_step.append(math.sqrt(sq / sum(w.numel() for _, w, _, _ in before)))
        Path(out_path).write_text(json.dumps(per_step))

    Optimizers.step = recording_step


def summarize(metrics: Path, rms_file: Path, steps: int) -> dict:
    loss = {}
    for line in metrics.read_text().splitlines():
        row = json.loads(line)
        if "loss" in row:
            loss[row["step"]] = row["loss"]
    points = sorted({n for n in (30, steps // 2, steps) if WINDOW <= n <= steps})
    rms = json.loads(rms_file.read_text())
    settled = rms[steps // 10 :]
    return {
        "loss": {str(n): round(sum(loss[s] for s in range(n - WINDOW + 1, n + 1)) / WINDOW, 3) for n in points},
        "update_rms_step1": round(rms[0], 3),
        "update_rms_mean": round(sum(settled) / len(settled), 3),
    }


def run_one(dim: int, size: dict, flags: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        write_hf_config(tmp / "hf", dim, size["n_layers"])
        argv = train_argv(tmp / "hf", size["seq_len"], size["steps"], tmp / "dump") + flags
        t0 = time.perf_counter()
        cmd = [sys.executable, "-m", "benchmarks.muon_lr", "--train", str(tmp / "rms.json"), "--", *argv]
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if out.returncode != 0:
            return {"error": (out.stderr.strip().splitlines() or ["?"])[-1]}
        row = summarize(tmp / "dump" / "metrics.jsonl", tmp / "rms.json", size["steps"])
        row["seconds"] = round(time.perf_counter() - t0, 1)
        return row


def run(size: dict | None = None) -> dict:
    size = size or REDUCED
    rows = []
    for dim in size["widths"]:
        results = {}
        for name, flags in variants().items():
            print(f"muon_lr: dim {dim}, {name} ({size['steps']} steps)", file=sys.stderr)
            results[name] = run_one(dim, size, flags)
        last = str(size["steps"])
        for name, r in results.items():
            row = {"dim": dim, "optimizer": name, **r}
            if name != "AdamW" and "loss" in r and "loss" in results["AdamW"]:
                row["muon_minus_adamw"] = round(r["loss"][last] - results["AdamW"]["loss"][last], 3)
            rows.append(row)
    return {
        "summary": f"train.py, one process, llama3 debug model at widths {size['widths']} with {size['n_layers']} "
        f"blocks, batch 4 x {size['seq_len']} tokens, {size['steps']} steps, lr 8e-4 WSD, synthetic corpus: loss "
        f"(mean of the {WINDOW} steps ending at each step) of AdamW and of Muon at AdamW's lr, for "
        "optimizer.muon_update_rms 0.2 (Moonlight's, the default) and 1.0; update RMS of the hidden matrices per lr.",
        "muon_update_rms_default": _default_rms(),
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.muon_lr", description=__doc__.split("\n\n")[0])
    p.add_argument("--full", action="store_true", help="the docs' measurement (widths 256, 512; 6 blocks)")
    p.add_argument("--out", help="write {'muon_lr' or 'muon_lr_full': result} with the host here")
    p.add_argument("--train", metavar="RMS_JSON", help=argparse.SUPPRESS)  # one run: train.py's argv after --
    args, rest = p.parse_known_args(argv)
    if args.train:
        _record_update_rms(args.train)
        from trainer.lifecycle.rank import run_rank

        return run_rank(rest[1:] if rest[:1] == ["--"] else rest)
    started = time.strftime("%Y-%m-%dT%H:%M:%S")
    result = run(FULL if args.full else REDUCED)
    print(json.dumps(result, indent=1))
    if args.out:
        import platform

        import torch

        from models.common.cpu_info import describe_cpu

        host = {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count()}
        data = {"host": {**host, "cpu": describe_cpu()}, "started": started}
        data["muon_lr_full" if args.full else "muon_lr"] = result
        Path(args.out).write_text(json.dumps(data, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
