"""bf16 optimizer state against float32 over a long run (``make bench`` section ``bf16_state``;
also ``python -m benchmarks.bf16_state --out bench_results/bf16_state.json``).

Each run is ``train.py`` in one process (its own subprocess): the llama3 debug model (6 blocks,
dim 256), the synthetic corpus, batch 4 x 128 tokens, 200 steps, lr 8e-4 with the shipped
cosine schedule and 20 warmup steps, the same seed and batches for every run; AdamW, and Muon
(hidden matrices; AdamW for the rest), each with ``optimizer.state_dtype`` float32 and bfloat16
(trainer/optim/low_precision.py: stochastically rounded moments); ``--n-layers N`` cuts the model
to N blocks (Muon's recorded pair ran with 2: its Newton-Schulz step is the cost on a CPU). Per
pair:

- the relative loss gap ``|L_bf16 - L_fp32| / L_fp32`` of the loss averaged over 10-step windows
  (one step's loss on a 4-row batch is noisy), its maximum over the run and at the last window,
  against the stated bound (BOUND_MAX, BOUND_FINAL): two runs that differ by a rounding of the
  moments drift apart like runs with another reduction order, not systematically;
- the optimizer state bytes of the trainer's real optimizers after the first step (every state
  tensor: moments and step counts), and their ratio bf16 / fp32 (1/2 up to the step counts);
- the median optimizer step time (bf16 state runs meshtrain's per-parameter kernel; float32
  AdamW torch's foreach kernel on CPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = 200
SEQ_LEN = 128
WINDOW = 10
BOUND_MAX = 0.02  # max relative gap of the 10-step mean loss over the run
BOUND_FINAL = 0.01  # at the last window
DTYPES = ("float32", "bfloat16")
OPTIMIZERS = {"AdamW": ["--optimizer.name", "AdamW"], "Muon": ["--optimizer.name", "Muon"]}


def train_argv(steps: int, dump: Path, seq_len: int = SEQ_LEN, n_layers: int | None = None) -> list[str]:
    blocks = ["--model.n_layers", str(n_layers)] if n_layers else []  # None: the debug model's 6
    return [*blocks,
        "--config", "llama3.toml", "--training.steps", str(steps), "--training.seq_len", str(seq_len),
        "--training.global_batch_size", "4", "--training.local_batch_size", "4",
        "--parallelism.data_parallel_shard_degree", "1", "--optimizer.lr", "8e-4",
        "--lr_scheduler.warmup_steps", "20", "--checkpoint.enable", "false",
        "--metrics.enable_tensorboard", "false", "--metrics.log_freq", "1", "--job.dump_folder", str(dump),
    ]  # fmt: skip


def _record(out_path: str) -> None:
    """Wrap the trainer's optimizer step: its wall time per step, and the state bytes after step 1."""
    from trainer.optim import optimizers as optim
    from trainer.optim.low_precision import state_bytes

    rec: dict = {"step_s": []}
    step = optim.Optimizers.step

    def recording_step(self, found_inf=None):
        t0 = time.perf_counter()
        step(self, found_inf)
        rec["step_s"].append(time.perf_counter() - t0)
        if "state_bytes" not in rec:
            rec["state_bytes"] = sum(state_bytes(o) for o in self.optimizers)
            rec["params"] = sum(p.numel() for g in self.param_groups for p in g["params"])
        Path(out_path).write_text(json.dumps(rec))

    optim.Optimizers.step = recording_step


def run_one(flags: list[str], steps: int, seq_len: int = SEQ_LEN, n_layers: int | None = None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cmd = [sys.executable, "-m", "benchmarks.bf16_state", "--train", str(tmp / "rec.json"), "--"]
        t0 = time.perf_counter()
        out = subprocess.run(
            [*cmd, *train_argv(steps, tmp / "dump", seq_len, n_layers), *flags],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        if out.returncode != 0:
            return {"error": (out.stderr.strip().splitlines() or ["?"])[-1]}
        loss = {}
        for line in (tmp / "dump" / "metrics.jsonl").read_text().splitlines():
            row = json.loads(line)
            if "loss" in row:
                loss[row["step"]] = row["loss"]
        rec = json.loads((tmp / "rec.json").read_text())
        return {
            "loss": [loss[s] for s in range(1, steps + 1)],
            "state_bytes": rec["state_bytes"],
            "params": rec["params"],
            "optimizer_step_ms": round(1000 * statistics.median(rec["step_s"][1:]), 2),
            "seconds": round(time.perf_counter() - t0, 1),
        }


def windows(loss: list[float]) -> list[float]:
    return [sum(loss[i : i + WINDOW]) / WINDOW for i in range(0, len(loss) - WINDOW + 1, WINDOW)]


def run(
    steps: int = STEPS, seq_len: int = SEQ_LEN, optimizers: list[str] | None = None, n_layers: int | None = None
) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    rows = []
    for name in optimizers or list(OPTIMIZERS):
        flags = OPTIMIZERS[name]
        print(f"bf16_state: {name}, state_dtype float32 and bfloat16 side by side ({steps} steps)", file=sys.stderr)
        with ThreadPoolExecutor(2) as pool:  # the two runs at once (one process each)
            futures = {
                d: pool.submit(run_one, [*flags, "--optimizer.state_dtype", d], steps, seq_len, n_layers)
                for d in DTYPES
            }
            r = {d: f.result() for d, f in futures.items()}
        if any("error" in v for v in r.values()):
            rows.append({"optimizer": name, **{f"error_{k}": v.get("error") for k, v in r.items()}})
            continue
        a, b = windows(r["float32"]["loss"]), windows(r["bfloat16"]["loss"])
        gaps = [abs(y - x) / x for x, y in zip(a, b)]
        rows.append(
            {
                "optimizer": name,
                "loss_fp32_final": round(a[-1], 4),
                "loss_bf16_final": round(b[-1], 4),
                "max_rel_gap": round(max(gaps), 5),
                "final_rel_gap": round(gaps[-1], 5),
                "mean_rel_gap": round(statistics.fmean(gaps), 6),
                "within_bound": max(gaps) <= BOUND_MAX and gaps[-1] <= BOUND_FINAL,
                "state_bytes_fp32": r["float32"]["state_bytes"],
                "state_bytes_bf16": r["bfloat16"]["state_bytes"],
                "state_ratio": round(r["bfloat16"]["state_bytes"] / r["float32"]["state_bytes"], 4),
                "params": r["float32"]["params"],
                "optimizer_step_ms_fp32": r["float32"]["optimizer_step_ms"],
                "optimizer_step_ms_bf16": r["bfloat16"]["optimizer_step_ms"],
                "seconds": round(r["float32"]["seconds"] + r["bfloat16"]["seconds"], 1),
                # the curves themselves: the 10-step mean loss, float32 / bfloat16 state
                "window_loss": f"{' '.join(f'{x:.4f}' for x in a)} / {' '.join(f'{y:.4f}' for y in b)}",
            }
        )
    return {
        "summary": f"train.py, one process, llama3 debug model ({n_layers or 6} blocks, dim 256), batch 4 x {seq_len} tokens, {steps} "
        f"steps, lr 8e-4 cosine: optimizer.state_dtype bfloat16 against float32, relative gap of the {WINDOW}-step "
        f"mean loss (bound: max {BOUND_MAX}, final {BOUND_FINAL}), optimizer state bytes, optimizer step time.",
        "bound_max": BOUND_MAX,
        "bound_final": BOUND_FINAL,
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bf16_state", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="write {'bf16_state': result} with the host here")
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--seq-len", type=int, default=SEQ_LEN)
    p.add_argument("--optimizers", nargs="*", choices=list(OPTIMIZERS), help="default: all")
    p.add_argument("--n-layers", type=int, help="blocks of the debug model (default: its 6)")
    p.add_argument("--train", metavar="REC_JSON", help=argparse.SUPPRESS)  # one run: train.py's argv after --
    args, rest = p.parse_known_args(argv)
    if args.train:
        _record(args.train)
        from trainer.lifecycle.main import main as train_main

        return train_main(rest[1:] if rest[:1] == ["--"] else rest) or 0
    started = time.strftime("%Y-%m-%dT%H:%M:%S")
    result = run(args.steps, args.seq_len, args.optimizers, args.n_layers)
    print(json.dumps(result, indent=1))
    if args.out:
        import os
        import platform

        import torch

        from models.common.cpu_info import describe_cpu

        host = {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count()}
        data = {"host": {**host, "cpu": describe_cpu()}, "started": started, "bf16_state": result}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(data, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
