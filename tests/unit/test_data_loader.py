"""Packing and batching (trainer/data/packing.py, batching.py, loader.py): labels are the inputs
shifted, every layout reads the same global batch, and the resume state is exact on any layout.
(Sources: test_data_sources.py; the synthetic corpus: test_data_synthetic.py.)"""

import json
import re

import pytest
import torch

from trainer.config import ConfigError, load_config
from trainer.data.batching import PackedDataLoader
from trainer.data.loader import build_dataloader
from trainer.data.sources import FileSource, SyntheticSource
from trainer.data.synthetic import synthetic_document
from trainer.data.tokenizer import load_tokenizer

TOK = load_tokenizer()
SEQ = 32


def loader(batch_rank=0, batch_degree=1, global_bs=8, local_bs=2, source=None, tok=TOK, seq=SEQ):
    return PackedDataLoader(
        source or SyntheticSource(seed=3),
        tok,
        seq_len=seq,
        global_batch_size=global_bs,
        local_batch_size=local_bs,
        batch_rank=batch_rank,
        batch_degree=batch_degree,
    )


def global_batches(degree, local_bs, steps, global_bs=8, **kw):
    """Concatenate every batch rank's micro-batches per step into the global batch."""
    loaders = [loader(r, degree, global_bs, local_bs, **kw) for r in range(degree)]
    out = []
    for _ in range(steps):
        xs, ys = [], []
        for ld in loaders:
            for _ in range(ld.grad_accum_steps):
                x, y = next(ld)
                assert x.shape == (local_bs, SEQ) and x.dtype == torch.long and x.device.type == "cpu"
                xs.append(x)
                ys.append(y)
        out.append((torch.cat(xs), torch.cat(ys)))
    return out


def test_labels_are_inputs_shifted_and_stream_is_contiguous():
    ld = loader()
    x1, y1 = next(ld)
    x2, _ = next(ld)
    assert torch.equal(x1[:, 1:], y1[:, :-1])
    # packed stream: window k+1 starts right after window k ends (seq_len + 1 tokens each)
    stream = []
    for i in range(50):
        stream += TOK.encode(synthetic_document(3, i)) + [TOK.eos_id]
    w = SEQ + 1
    assert x1[0].tolist() == stream[:SEQ] and y1[1].tolist() == stream[w + 1 : 2 * w]
    assert x2[0].tolist() == stream[2 * w : 2 * w + SEQ]


def test_determinism():
    a, b = global_batches(1, 2, 3), global_batches(1, 2, 3)
    assert all(torch.equal(p[0], q[0]) and torch.equal(p[1], q[1]) for p, q in zip(a, b))


@pytest.mark.parametrize("degree, local_bs", [(1, 4), (2, 1), (2, 4), (4, 2), (4, 1), (8, 1)])
def test_layout_invariance(degree, local_bs):
    reference = global_batches(1, 8, 3)  # one rank, the whole global batch in one micro-batch
    other = global_batches(degree, local_bs, 3)
    for (rx, ry), (ox, oy) in zip(reference, other):
        assert torch.equal(rx, ox) and torch.equal(ry, oy)


def test_grad_accum_and_divisibility_errors():
    assert loader(0, 2, 8, 2).grad_accum_steps == 2
    assert loader(0, 2, -1, 2).grad_accum_steps == 1
    with pytest.raises(
        ConfigError,
        match=re.escape(
            "training.global_batch_size (8) must be a positive multiple of batch degree (3) x training.local_batch_size (2) = 6"
        ),
    ):
        loader(0, 3, 8, 2)
    with pytest.raises(ConfigError, match=re.escape("batch rank 2 must be in [0, batch degree 2)")):
        loader(2, 2)


@pytest.mark.parametrize("resume_degree, resume_local", [(2, 2), (1, 4), (4, 1)])
def test_resume_continues_exactly_with_any_layout(resume_degree, resume_local):
    reference = global_batches(1, 8, 5)
    first = [loader(r, 2, 8, 2) for r in range(2)]
    for _ in range(2):  # two full steps on 2 ranks
        for ld in first:
            for _ in range(ld.grad_accum_steps):
                next(ld)
    states = [ld.state_dict() for ld in first]
    assert states[0] == states[1] and states[0]["sample_index"] == 16
    resumed = [loader(r, resume_degree, 8, resume_local) for r in range(resume_degree)]
    for ld in resumed:
        ld.load_state_dict(states[0])
    for step in range(2, 5):
        x = torch.cat([next(ld)[0] for ld in resumed for _ in range(ld.grad_accum_steps)])
        assert torch.equal(x, reference[step][0])


def test_mid_step_state_replays_the_unfinished_step():
    ld = loader(0, 1, 8, 2)
    ld.next_step()
    next(ld)  # first micro-batch of step 2 only
    state = ld.state_dict()
    assert state["sample_index"] == 8
    fresh = loader(0, 1, 8, 2)
    fresh.load_state_dict(state)
    ref = loader(0, 1, 8, 2)
    ref.next_step()
    assert all(torch.equal(a[0], b[0]) for a, b in zip(fresh.next_step(), ref.next_step()))


def test_state_rejects_other_dataset(tmp_path):
    (tmp_path / "a.txt").write_text("some text\n")
    state = loader().state_dict()
    other = loader(source=FileSource(str(tmp_path), "text"))
    with pytest.raises(ValueError, match="exclude_from_loading"):
        other.load_state_dict(state)


def test_build_dataloader_from_config(tmp_path):
    (tmp_path / "c.jsonl").write_text(json.dumps({"text": "hello there"}) + "\n")
    cfg = load_config(
        [
            "--config",
            "llama3.toml",
            "--training.dataset",
            "jsonl",
            "--training.dataset_path",
            str(tmp_path),
            "--training.seq_len",
            "8",
        ]
    )
    ld = build_dataloader(cfg, TOK, batch_rank=1, batch_degree=4)
    x, _ = next(ld)
    assert x.shape == (4, 8) and ld.grad_accum_steps == 1 and ld.tokens_per_step == 16 * 8
