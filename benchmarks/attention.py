"""Block-causal against causal attention on the CPU: forward + backward time of one attention
layer of each model (Llama 3 GQA and DeepSeek-V3 MLA, debug-model dims) on one packed row of
``SEQ`` tokens, at several document lengths.

* ``causal``: the model with ``attn_mask_type = "causal"``: SDPA's ``is_causal`` path (the
  reference every ratio divides by);
* ``block_causal``: the same weights with ``attn_mask_type = "block_causal"``, ``attn_type =
  "sdpa"``: SDPA with the boolean ``[bs, 1, s, s]`` mask ``core.prepare`` builds (the CPU
  reference path).

The row holds documents of exactly ``doc_len`` tokens, each ending with EOS (``doc_len = SEQ``:
one document, so block-causal equals causal and the ratio is the cost of the mask path
itself). The timed step is the attention module (projections, RoPE, core, output projection)
forward and backward with the RoPE rows and mask built beforehand; the mask build
(``Decoder.attention_inputs``, once per micro-batch, shared by every layer) is timed on its own
(``mask_build_s``). Both paths run in this process on one intra-op thread, interleaved, one
warm-up each; the figure per path is the best of ``REPS`` steps (medians recorded too), and
the ratio is the median over the ``REPS`` rounds of each round's block_causal / causal (the two
ran back to back, so load that drifts over the run cancels; a shared 2-core machine moves single
steps by tens of percent).

SDPA with a boolean mask computes every score of the lower triangle whatever the mask says, so
on the CPU block-causal attention costs about what causal does, or more; FlexAttention's block
sparsity on a GPU (``attn_type = "flex"``) is what makes short documents cheaper, and it is not
measured here (``make bench-gpu`` has the row). Each row also records the largest difference of
the block-causal output to the causal one: 0 up to rounding for one document, large otherwise
(documents no longer see each other).
"""

from __future__ import annotations

import statistics
import sys
import time

SEQ = 1024
BS = 1
DOC_LENS = (64, 256, 512, SEQ)
MODELS = ("llama3", "deepseek_v3")
EOS_ID = 0
REPS = 5
THREADS = 1
PATHS = ("causal", "block_causal")
NOTE = (
    "CPU, SDPA: a boolean mask cannot skip masked blocks, so block_causal costs about what causal "
    "does or more; FlexAttention's block sparsity (GPU, attn_type flex) is unmeasured here"
)


def build(model: str, mask_type: str, seq: int = SEQ):
    """A one-layer debug model of ``model`` (fp32, CPU, seeded init) with ``mask_type``."""
    import torch

    from models.registry import build_model

    m = build_model(
        model, "debugmodel", device="cpu", n_layers=1, max_seq_len=seq, attn_mask_type=mask_type, eos_id=EOS_ID
    )
    with torch.no_grad():
        m.init_weights(0)
    return m


def packed_row(doc_len: int, seq: int = SEQ, vocab: int = 2048, seed: int = 0):
    """``[BS, seq]`` token ids: documents of ``doc_len`` tokens, each ending with EOS."""
    import torch

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, vocab, (BS, seq), generator=g)
    tokens[:, doc_len - 1 :: doc_len] = EOS_ID
    return tokens


def _step(model, x, rope, mask):
    """One timed forward+backward of the first layer's attention; returns (seconds, output)."""
    model.zero_grad(set_to_none=True)
    xg = x.detach().requires_grad_()
    attention = model.layers["0"].attention
    start = time.perf_counter()
    out = attention(xg, rope, mask)
    out.square().sum().backward()
    return time.perf_counter() - start, out.detach()


def measure(model_name: str, doc_len: int, seq: int = SEQ, reps: int = REPS) -> dict:
    import torch

    from models.common.documents import document_stats

    models = {p: build(model_name, p, seq) for p in PATHS}
    tokens = packed_row(doc_len, seq, models["causal"].args.vocab_size)
    x = torch.randn(BS, seq, models["causal"].args.dim, generator=torch.Generator().manual_seed(1))
    inputs, build_times = {}, {p: [] for p in PATHS}
    for _ in range(reps):
        for p in PATHS:
            start = time.perf_counter()
            inputs[p] = models[p].attention_inputs(tokens, seq, BS, tokens.device)
            build_times[p].append(time.perf_counter() - start)
    times: dict[str, list[float]] = {p: [] for p in PATHS}
    outs = {}
    for rep in range(reps + 1):  # rep 0 is the warm-up
        order = PATHS if rep % 2 == 0 else PATHS[::-1]
        for p in order:
            seconds, outs[p] = _step(models[p], x, *inputs[p])
            if rep > 0:
                times[p].append(seconds)
    mean_len, docs = document_stats(tokens, EOS_ID)
    best = {p: min(t) for p, t in times.items()}
    return {
        "model": model_name,
        "seq": seq,
        "doc_len": doc_len,
        "mean_doc_len": mean_len,
        "docs_per_window": docs,
        "seconds": {p: round(best[p], 5) for p in PATHS},
        "seconds_median": {p: round(statistics.median(times[p]), 5) for p in PATHS},
        # the median of each round's ratio (the two paths ran back to back): robust to load that
        # drifts over the run; the ratio of the best times alongside
        "block_causal_over_causal": round(
            statistics.median([b / c for c, b in zip(times["causal"], times["block_causal"])]), 3
        ),
        "best_over_best": round(best["block_causal"] / best["causal"], 3),
        # RoPE rows + mask, once per micro-batch (causal: RoPE rows only)
        "mask_build_s": round(min(build_times["block_causal"]), 5),
        "rope_build_s": round(min(build_times["causal"]), 5),
        "max_abs_diff_vs_causal": float((outs["block_causal"] - outs["causal"]).abs().max()),
    }


def run(
    seq: int = SEQ, doc_lens: tuple[int, ...] = DOC_LENS, models: tuple[str, ...] = MODELS, reps: int = REPS
) -> dict:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        rows = [measure(m, d, seq, reps) for m in models for d in doc_lens]
    finally:
        torch.set_num_threads(threads)
    for r in rows:
        s = r["seconds"]
        print(
            f"attention {r['model']:<12} doc {r['doc_len']:5d}: causal {s['causal']:.4f}s  "
            f"block_causal {s['block_causal']:.4f}s  ratio {r['block_causal_over_causal']:.2f}  "
            f"mask build {r['mask_build_s']:.4f}s",
            file=sys.stderr,
        )
    return {
        "config": {"seq": seq, "batch": BS, "threads": THREADS, "reps": reps, "dtype": "float32", "kernel": "sdpa"},
        "note": NOTE,
        "rows": rows,
    }


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=1))
