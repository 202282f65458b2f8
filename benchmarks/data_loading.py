"""Data loading at scale: one rank's data time per step against the number of batch ranks D
(1, 8, 64, 512) at a fixed global batch, for the streaming path (``training.dataset =
jsonl``: every rank reads and tokenizes the whole global batch and keeps its 1/D) and the
tokens path (``training.dataset = tokens``: the rank reads its own samples from the shards);
plus the offline tokenizer's throughput (``scripts/tokenize_dataset.py``) with 1 and N workers.

Only batch coordinate 0 is simulated (one ``PackedDataLoader`` in this process per D): the
figure is what that rank spends on data per step. The corpus is the debug corpus (synthetic
documents, seed 0) written as jsonl, tokenized with the shipped tokenizer; both paths give the
same samples. Per D: one warm-up step, then the median of the timed steps (the streaming path
is timed on fewer steps: each costs a whole global batch of tokenization). The page cache is
warm (the shards were just written), as on a node that has read its shards once.

Expected shape: the streaming path's time per step is flat in D (the whole global batch each
time), so its time per *own* token grows as D; the tokens path's time is proportional to the
rank's own tokens (G/D samples), so its time per own token is flat.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

GLOBAL_BATCH = 512  # samples per step
SEQ_LEN = 1024
DEGREES = (1, 8, 64, 512)
STREAM_STEPS = 2  # timed steps per D (after one warm-up)
TOKENS_STEPS = 10
CORPUS_STEPS = 3  # the corpus holds this many global batches (the streaming path's warm-up + timed steps)


def _corpus(folder: str, tokenizer) -> tuple[str, int]:
    """A jsonl file of synthetic documents holding at least CORPUS_STEPS global batches."""
    from trainer.data.synthetic import synthetic_document
    from trainer.runtime.files import atomic_file

    need = CORPUS_STEPS * GLOBAL_BATCH * (SEQ_LEN + 1)
    path = os.path.join(folder, "corpus.jsonl")
    tokens, i = 0, 0
    with atomic_file(path, "w") as f:
        while tokens < need:
            docs = [synthetic_document(0, i + k) for k in range(1000)]
            tokens += sum(len(ids) + 1 for ids in tokenizer.encode_batch(docs))
            f.write("".join(json.dumps({"text": d}) + "\n" for d in docs))
            i += 1000
    return path, tokens


def _time_steps(loader, steps: int) -> tuple[float, float]:
    t0 = time.perf_counter()
    loader.next_step()  # warm-up: opens files / maps shards
    cold = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        loader.next_step()
        times.append(time.perf_counter() - t0)
    return cold, statistics.median(times)


def _loader(source, tokenizer, degree: int):
    from trainer.data.batching import PackedDataLoader

    return PackedDataLoader(
        source,
        tokenizer,
        seq_len=SEQ_LEN,
        global_batch_size=GLOBAL_BATCH,
        local_batch_size=1,
        batch_rank=0,
        batch_degree=degree,
    )


def run() -> dict:
    from tools.tokenize.writer import tokenize_to_shards
    from trainer.data.sources import FileSource
    from trainer.data.token_shards import TokenDataset
    from trainer.data.tokenizer import load_tokenizer

    started = time.perf_counter()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    tok = load_tokenizer()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_data_") as tmp:
        corpus, corpus_tokens = _corpus(tmp, tok)
        throughput = {}
        for workers in sorted({1, cores}):
            out = os.path.join(tmp, f"tokens_w{workers}")
            t0 = time.perf_counter()
            index = tokenize_to_shards([corpus], out, workers=workers, shard_tokens=1 << 20, log=None)
            seconds = time.perf_counter() - t0
            rate = index["total_tokens"] / seconds
            throughput[workers] = {
                "workers": workers,
                "seconds": round(seconds, 3),
                "tokens_per_s": round(rate),
                "tokens_per_s_per_core": round(rate / workers),
            }
        shards = os.path.join(tmp, "tokens_w1")
        for d in DEGREES:
            own_tokens = GLOBAL_BATCH // d * SEQ_LEN
            s_cold, stream = _time_steps(_loader(FileSource(corpus, "jsonl"), tok, d), STREAM_STEPS)
            ds = TokenDataset(shards)
            t_cold, tokens = _time_steps(_loader(ds, tok, d), TOKENS_STEPS)
            rows.append(
                {
                    "batch_degree": d,
                    "own_samples": GLOBAL_BATCH // d,
                    "own_tokens": own_tokens,
                    "streaming_s_per_step": stream,
                    "tokens_s_per_step": tokens,
                    "streaming_us_per_own_token": stream / own_tokens * 1e6,
                    "tokens_us_per_own_token": tokens / own_tokens * 1e6,
                    "streaming_over_tokens": stream / tokens,
                    "tokens_read_per_step": ds.tokens_read // (TOKENS_STEPS + 1),
                    "first_step_s": {"streaming": s_cold, "tokens": t_cold},
                }
            )
    print(f"data loading: global batch {GLOBAL_BATCH} x {SEQ_LEN} tokens, batch coordinate 0", file=sys.stderr)
    print(
        f"{'D':>5} {'own tok':>8} {'stream s/step':>14} {'tokens s/step':>14} {'stream us/own tok':>18} "
        f"{'tokens us/own tok':>18} {'stream/tokens':>14}",
        file=sys.stderr,
    )
    for r in rows:
        print(
            f"{r['batch_degree']:>5} {r['own_tokens']:>8} {r['streaming_s_per_step']:>14.4f} "
            f"{r['tokens_s_per_step']:>14.6f} {r['streaming_us_per_own_token']:>18.3f} "
            f"{r['tokens_us_per_own_token']:>18.4f} {r['streaming_over_tokens']:>14.0f}",
            file=sys.stderr,
        )
    for t in throughput.values():
        print(
            f"offline tokenizer, {t['workers']} worker(s): {t['tokens_per_s']:,} tokens/s "
            f"({t['tokens_per_s_per_core']:,} per core)",
            file=sys.stderr,
        )
    wall = time.perf_counter() - started
    print(f"data loading benchmark wall time {wall:.1f} s", file=sys.stderr)
    return {
        "config": {
            "global_batch_size": GLOBAL_BATCH,
            "seq_len": SEQ_LEN,
            "batch_rank": 0,
            "degrees": list(DEGREES),
            "tokenizer": "shipped (assets/tokenizer, 2048 BPE)",
            "corpus_tokens": corpus_tokens,
            "streaming_timed_steps": STREAM_STEPS,
            "tokens_timed_steps": TOKENS_STEPS,
            "statistic": "median",
            "cores": cores,
        },
        "rows": rows,
        "offline_tokenizer": list(throughput.values()),
        "wall_seconds": round(wall, 1),
    }


if __name__ == "__main__":
    print(json.dumps(run(), indent=1))
