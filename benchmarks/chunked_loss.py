"""Chunked cross-entropy (``training.loss_chunk_tokens``): peak memory and time of one forward +
backward of a model with Qwen3's 151,936-token vocabulary at a small width (llama3 shell, 1
block, dim 64), one sequence of ``TOKENS`` tokens, float32 and bf16 parameters, one thread.

Peak: bytes of live tensor storage at the step's peak (``tools/tensor_census.py``: every tensor
the step allocates, parameters and inputs excluded), as the trainer runs it (the logits held
until the backward returns). Reference: the plain head + loss (chunk 0) in the same run.
``predicted``: ``models.common.chunked_loss.chunked_loss_saving_bytes`` (what the planner
prices). Time: CPU seconds of the step (process time; median of ``REPEATS``), outside the
census (its per-op bookkeeping would dominate).
"""

from __future__ import annotations

import json
import statistics
import sys
import time

VOCAB, DIM, TOKENS, REPEATS = 151_936, 64, 1024, 3
CHUNKS = (0, 128, 256, 512, 1024)


def _step(model, inputs, labels, chunk: int) -> None:
    from trainer.forward import cross_entropy_sum, token_loss_sum

    model.zero_grad(set_to_none=True)
    model.loss_chunk_tokens = chunk
    if chunk:
        logits = model(inputs, labels=labels)
        loss = token_loss_sum(logits, labels)
    else:
        logits = model(inputs)
        loss = cross_entropy_sum(logits, labels)
    (loss / labels.numel()).backward()
    del logits, loss


def run() -> list[dict]:
    import torch

    from models.common.chunked_loss import chunked_loss_saving_bytes
    from models.registry import build_model
    from tools.tensor_census import TensorCensus

    torch.set_num_threads(1)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        model = build_model(
            "llama3", "debugmodel", device="cpu", n_layers=1, dim=DIM, n_heads=4, n_kv_heads=2, vocab_size=VOCAB
        )
        model.init_weights(0)
        model.to(dtype)
        g = torch.Generator().manual_seed(1)
        inputs = torch.randint(0, VOCAB, (1, TOKENS), generator=g)
        labels = torch.randint(0, VOCAB, (1, TOKENS), generator=g)
        plain_peak = plain_time = None
        for chunk in CHUNKS if dtype == torch.float32 else (0, 256):
            with TensorCensus() as census:
                _step(model, inputs, labels, chunk)
            times = []
            for _ in range(REPEATS):
                t0 = time.process_time()
                _step(model, inputs, labels, chunk)
                times.append(time.process_time() - t0)
            cpu_s = statistics.median(times)
            if chunk == 0:
                plain_peak, plain_time = census.peak_bytes, cpu_s
            saving = plain_peak - census.peak_bytes
            predicted = chunked_loss_saving_bytes(TOKENS, VOCAB, DIM, chunk, compute_bytes=dtype.itemsize)
            row = {
                "dtype": str(dtype).removeprefix("torch."),
                "tokens": TOKENS,
                "chunk": chunk,
                "peak_MiB": round(census.peak_bytes / 2**20, 1),
                "saving_MiB": round(saving / 2**20, 1),
                "predicted_saving_MiB": round(predicted / 2**20, 1),
                "fp32_logits_MiB": round(TOKENS * VOCAB * 4 / 2**20, 1),
                "cpu_s": round(cpu_s, 3),
                "time_vs_plain": round(cpu_s / plain_time, 3),
            }
            rows.append(row)
            print(f"chunked_loss {json.dumps(row)}", file=sys.stderr)
    return rows


if __name__ == "__main__":
    print(json.dumps(run(), indent=1))
