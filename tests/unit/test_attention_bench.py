"""Issue 26's measurements and what docs/attention.md claims from them: the `make bench` section
``attention`` (block-causal against causal SDPA on the CPU), its committed results, the
trainer's ``data:`` startup line, and the RoPE claim (restarting positions per document changes
only rounding when masking is block-causal)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import attention, report, run
from models.common.documents import document_ids, document_stats, positions_in_document
from models.registry import build_model
from trainer.data.doc_stats import document_stats_line

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def test_attention_section_times_both_paths_on_one_run():
    """Tiny shapes (seq 128): both paths timed, the ratio is of figures of this run, the document
    structure is what the row says, and the outputs are what the masks imply: one document ->
    block-causal equals causal up to rounding (two SDPA kernels on the same math: fp32 sums of
    128 terms, 1e-5 is ~100 ulps of outputs of size ~1); 16-token documents -> they differ by
    far more (documents no longer see each other: the negative control)."""
    result = attention.run(seq=128, doc_lens=(16, 128), reps=1)  # one round: the ratio is its own
    assert all(r["block_causal_over_causal"] == r["best_over_best"] for r in result["rows"])
    rows = result["rows"]
    assert [(r["model"], r["doc_len"]) for r in rows] == [
        ("llama3", 16),
        ("llama3", 128),
        ("deepseek_v3", 16),
        ("deepseek_v3", 128),
    ]
    for r in rows:
        s = r["seconds"]
        assert s["causal"] > 0 and s["block_causal"] > 0 and r["mask_build_s"] > 0
        # of this run's best times (rounded to 10 us in the JSON: 0.1% of a 10 ms step)
        assert r["best_over_best"] == pytest.approx(s["block_causal"] / s["causal"], rel=5e-3)
        assert r["block_causal_over_causal"] > 0
        assert r["mean_doc_len"] == r["doc_len"] and r["docs_per_window"] == 128 / r["doc_len"]
        if r["doc_len"] == 128:
            assert r["max_abs_diff_vs_causal"] < 1e-5, r
        else:
            assert r["max_abs_diff_vs_causal"] > 1e-3, r
    assert result["config"]["kernel"] == "sdpa" and "unmeasured" in result["note"]


def test_attention_section_is_registered_and_its_results_committed():
    assert "attention" in run.SECTIONS and "attention" in report.SECTION_IDS
    data = json.loads((ROOT / "bench_results" / "attention.json").read_text())
    rows = data["attention"]["rows"]
    assert {(r["model"], r["doc_len"]) for r in rows} == {(m, d) for m in attention.MODELS for d in attention.DOC_LENS}
    assert all(r["block_causal_over_causal"] > 0 for r in rows)
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    assert "## Block-causal attention on CPU" in page and "block_causal_over_causal" in page


def test_packed_row_places_eos_at_each_document_end():
    tokens = attention.packed_row(4, seq=12, vocab=50)
    assert tokens[0, 3::4].eq(attention.EOS_ID).all() and (tokens == attention.EOS_ID).sum() == 3
    assert document_stats(tokens, attention.EOS_ID) == (4.0, 3.0)


# ------------------------------------------------------------------ the trainer's startup line


def test_document_stats_line_counts_cut_documents_once():
    eos = 1
    a = torch.tensor([[5, 5, 1, 6, 6, 6, 1, 7]])  # 3 documents (the last is cut by the edge)
    b = torch.tensor([[5, 5, 5, 5, 5, 5, 5, 5]])  # 1 document
    line = document_stats_line([(a, a), (b, b)], eos, "block_causal")
    # 2 windows of 8 tokens, 4 documents: 2 per window, mean length 8 / 2 = 4
    assert line == (
        "data: mean document length 4.0 tokens, 2.0 documents per 8-token window "
        "(attn_mask_type=block_causal; first step's batch, 2 windows)"
    )
    assert "no EOS token" in document_stats_line([(a, a)], None, "causal")


def test_trainer_logs_the_data_line_of_its_first_batch(tmp_path):
    """train.py prints the line once, with the figures of the windows its first step trains on
    (recomputed here from the same packed stream)."""
    from trainer.config import load_config
    from trainer.data.loader import build_source
    from trainer.data.packing import PackedStream
    from trainer.data.tokenizer import load_tokenizer

    args = ["--config", "llama3.toml", "--training.seq_len", "64", "--training.global_batch_size", "4",
            "--training.local_batch_size", "2", "--training.steps", "2", "--model.n_layers", "1",
            "--model.attn_mask_type", "block_causal", "--metrics.enable_tensorboard", "false",
            "--checkpoint.enable", "false", "--job.dump_folder", str(tmp_path)]  # fmt: skip
    res = subprocess.run(
        [sys.executable, "train.py", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    lines = [line for line in res.stdout.splitlines() if line.startswith("data: ")]
    assert len(lines) == 1, res.stdout[-3000:]
    cfg = load_config(args)
    tokenizer = load_tokenizer(cfg.model.tokenizer_path)
    windows = torch.as_tensor(PackedStream(build_source(cfg), tokenizer, 64).take(4))[:, :-1]
    mean_len, docs = document_stats(windows, tokenizer.eos_id)
    m = re.match(r"data: mean document length ([\d.]+) tokens, ([\d.]+) documents per 64-token window", lines[0])
    assert m and (m.group(1), m.group(2)) == (f"{mean_len:.1f}", f"{docs:.1f}"), lines[0]
    assert "attn_mask_type=block_causal" in lines[0] and docs > 1  # the synthetic documents are short


# ------------------------------------------------------------------ docs/attention.md's RoPE claim


def _model(name: str, **kw):
    m = build_model(name, "debugmodel", device="cpu", n_layers=2, max_seq_len=128, eos_id=1, **kw)
    with torch.no_grad():
        m.init_weights(0)
    return m


@pytest.mark.parametrize("name", ["llama3", "deepseek_v3"])
def test_document_positions_change_only_rounding_under_block_causal(name):
    """RoPE scores depend on q - k offsets only, and under block_causal every offset is within
    one document, where restarting positions shifts q and k alike: on and off agree to fp32
    rounding of the RoPE tables at positions < 128 (measured ~1.2e-6 on logits of size ~5;
    bound 2e-5). Negative control: under causal masking the later documents see earlier ones,
    whose offsets restarting does change: restarted positions (fed by hand; the config refuses
    this combination) move their logits by ~2e-3, 100x the bound."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(2, 2048, (2, 128), generator=g)
    tokens[:, 39] = tokens[:, 90] = 1
    with torch.no_grad():
        off = _model(name, attn_mask_type="block_causal")(tokens)
        on = _model(name, attn_mask_type="block_causal", document_positions=True)(tokens)
        causal = _model(name)
        plain = causal(tokens)
        h = causal.tok_embeddings(tokens)
        rope = causal.rope(positions_in_document(document_ids(tokens, 1)))
        for layer in causal.layers.values():
            h = layer(h, rope, None)
        restarted = causal.output(causal.norm(h))
    assert (on - off).abs().max() < 2e-5
    assert (restarted[:, 40:] - plain[:, 40:]).abs().max() > 1e-3
    assert torch.equal(restarted[:, :40], plain[:, :40])  # the first document's positions are the same
