"""Framework overhead: tokens/s of the llama3 debug model through train.py (1 process) vs a bare
PyTorch loop over the same model, data, optimizer and clipping, measured in the same run.

Both run in fresh processes with the same thread count, in ABBA order; the first steps are
warm-up and are not timed; the best run of each is compared. Goal: train.py >= 0.95 of the bare loop.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS, WARMUP = 30, 5
ARGS = [
    "--config",
    "llama3.toml",
    "--training.seq_len",
    "128",
    "--training.global_batch_size",
    "8",
    "--training.local_batch_size",
    "8",
    "--metrics.log_freq",
    "1",
    "--metrics.enable_tensorboard",
    "false",
    "--checkpoint.enable",
    "false",
    "--parallelism.dp_shard",
    "1",
]


def bare_loop(steps: int, warmup: int) -> float:
    """The reference: what a user would write by hand, with the same pieces of work."""
    import torch
    import torch.nn.functional as F

    from models.registry import build_model
    from trainer.config import load_config
    from trainer.data.loader import build_dataloader
    from trainer.data.tokenizer import load_tokenizer

    cfg = load_config([*ARGS, "--training.steps", str(steps)])
    torch.manual_seed(cfg.training.seed)
    tok = load_tokenizer(cfg.model.tokenizer_path)
    model = build_model("llama3", "debugmodel", device="cpu", vocab_size=2048, max_seq_len=2048)
    model.init_weights(cfg.training.seed)
    data = build_dataloader(cfg, tok, batch_rank=0, batch_degree=1)
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=cfg.optimizer.lr,
        betas=tuple(cfg.optimizer.betas),
        weight_decay=cfg.optimizer.weight_decay,
    )
    tokens = data.tokens_per_step
    for step in range(steps):
        if step == warmup:
            start = time.perf_counter()
        for inputs, labels in data.next_step():
            logits = model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum") / tokens
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.training.max_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()  # the framework logs the loss every step: same host sync here
    return (steps - warmup) * tokens / (time.perf_counter() - start)


def interleaved_step_ratio(steps: int = 12, warmup: int = 3) -> float:
    """Same process, same model and data: the Trainer's ``train_step`` vs the bare step,
    alternating step by step, so machine noise hits both equally. Isolates the step's own
    overhead from everything else a separate process run includes."""
    import torch
    import torch.nn.functional as F

    from trainer.config import load_config
    from trainer.trainer import Trainer

    with tempfile.TemporaryDirectory() as d:
        cfg = load_config([*ARGS, "--training.steps", str(4 * steps), "--job.dump_folder", d])
        trainer = Trainer(cfg)
        model = trainer.model_parts[0]
        opt = torch.optim.AdamW(
            model.parameters(),
            lr=cfg.optimizer.lr,
            betas=tuple(cfg.optimizer.betas),
            weight_decay=cfg.optimizer.weight_decay,
        )
        tokens = trainer.data.tokens_per_step

        def bare_step(microbatches):
            for inputs, labels in microbatches:
                loss = F.cross_entropy(model(inputs).flatten(0, 1).float(), labels.flatten(), reduction="sum") / tokens
                loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.training.max_norm)
            opt.step()
            opt.zero_grad(set_to_none=True)
            loss.item()

        t_framework = t_bare = 0.0
        for i in range(steps):
            for fn, is_framework in ((trainer.train_step, True), (bare_step, False)):
                batch = trainer.data.next_step()
                start = time.perf_counter()
                fn(batch)
                if i >= warmup:
                    elapsed = time.perf_counter() - start
                    t_framework += elapsed if is_framework else 0.0
                    t_bare += 0.0 if is_framework else elapsed
        return t_bare / t_framework


def framework(steps: int, warmup: int) -> float:
    with tempfile.TemporaryDirectory() as d:
        subprocess.run(
            [sys.executable, "train.py", *ARGS, "--training.steps", str(steps), "--job.dump_folder", d],
            cwd=ROOT,
            check=True,
            capture_output=True,
            env=_env(),
        )
        records = [json.loads(line) for line in open(os.path.join(d, "metrics.jsonl"))]
    timed = [r for r in records if r["step"] > warmup]
    tokens = sum(r["tps"] * r["interval_s"] for r in timed)
    return tokens / sum(r["interval_s"] for r in timed)


def _env():
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(os.cpu_count() or 1)
    return env


def run() -> dict:
    results = {"bare_loop_tps": [], "train_py_tps": []}
    code = f"from benchmarks.throughput import bare_loop; print(bare_loop({STEPS}, {WARMUP}))"

    def measure_bare():
        out = subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True, text=True, env=_env()
        )
        results["bare_loop_tps"].append(float(out.stdout.strip().splitlines()[-1]))

    def measure_framework():
        results["train_py_tps"].append(framework(STEPS, WARMUP))

    # ABBA order, twice: whichever runs first or second in a pair gets no systematic advantage
    for first, second in [(measure_bare, measure_framework), (measure_framework, measure_bare)] * 2:
        first()
        second()
    code_step = "from benchmarks.throughput import interleaved_step_ratio; print(interleaved_step_ratio())"
    out = subprocess.run(
        [sys.executable, "-c", code_step], cwd=ROOT, check=True, capture_output=True, text=True, env=_env()
    )
    results["interleaved_step_ratio_train_step_over_bare"] = round(float(out.stdout.strip().splitlines()[-1]), 3)
    bare, fw = max(results["bare_loop_tps"]), max(results["train_py_tps"])
    results["ratio_train_py_over_bare"] = round(fw / bare, 3)
    results["goal"] = ">= 0.95"
    print(
        f"throughput: train.py {fw:,.0f} tok/s vs bare loop {bare:,.0f} tok/s -> ratio "
        f"{results['ratio_train_py_over_bare']}; same-process interleaved train_step/bare step: "
        f"{results['interleaved_step_ratio_train_step_over_bare']}",
        file=sys.stderr,
    )
    return results


if __name__ == "__main__":
    print(json.dumps(run(), indent=1))
