"""Striped reading of parquet and save_to_disk rows (``training.row_reading``,
trainer/data/striped.py): global sample ``s * G + i`` is window s of stripe i (rows
``[i * R // G, (i + 1) * R // G)`` packed on their own), each batch rank reads only the rows of
its own stripes, every batch degree gives the same global batches, and a position saved on one
degree (every rank's stripes merged, as the checkpoint does) continues on another.

The reference for the windows is independent of the striping code: each stripe's rows written
to a .jsonl file of their own and packed by the sequential stream (the path every other text
dataset uses), whose window s must be global sample ``s * G + i``. Negative control: the same
reference with the stripes' rows cut one row off (``i * R // G + 1``) differs."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.chat_data import conversations, write_parquet
from trainer.config import ConfigError, load_config
from trainer.data.loader import build_dataloader
from trainer.data.packing import PackedStream
from trainer.data.rows import RowStripe
from trainer.data.sources import FileSource
from trainer.data.striped import complete_state, merge_states
from trainer.data.tokenizer import load_tokenizer

pytestmark = pytest.mark.unit

G, SEQ = 8, 32


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    import datasets

    folder = tmp_path_factory.mktemp("striped")
    rng = np.random.default_rng(0)
    words = "the cat sat on a mat with some dog and bird".split()
    texts = [" ".join(rng.choice(words, size=rng.integers(3, 40))) for _ in range(203)]  # 203: uneven stripes
    web = write_parquet(folder / "web.parquet", {"text": texts}, row_group_size=16)
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(folder / "disk"))
    chat = write_parquet(folder / "chat.parquet", {"messages": conversations(60, seed=3)}, row_group_size=8)
    return {"texts": texts, "web": web, "disk": str(folder / "disk"), "chat": chat, "folder": folder}


def _cfg(*args):
    return load_config(
        ["--config", "llama3.toml", "--training.seq_len", str(SEQ), "--training.global_batch_size", str(G)]
        + ["--training.local_batch_size", "1"]
        + ["--model.attn_mask_type", "block_causal", *args]
    )


def _loaders(cfg, degree, tok):
    return [build_dataloader(cfg, tok, batch_rank=b, batch_degree=degree) for b in range(degree)]


def _steps(loaders, n):
    """``n`` global batches, each the batch ranks' micro-batches in rank order: (inputs, labels)."""
    out = []
    for _ in range(n):
        parts = [mb for ld in loaders for mb in ld.next_step()]
        out.append((torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])))
    return out


def _recorded(monkeypatch):
    """Every row a stripe reads: (stripe index, stripe count, row number over the files)."""
    seen: list[tuple[int, int, int]] = []  # (stripe index, count, flat row)
    real = RowStripe.read

    def read(self, cursor):
        flat = self._starts[cursor[1]] + cursor[2]
        seen.append((self.index, self.count, flat if flat < self.hi else self.lo))  # past the end: wraps
        return real(self, cursor)

    monkeypatch.setattr(RowStripe, "read", read)
    return seen


@pytest.mark.parametrize("kind", ["web", "disk"])
def test_each_slot_is_its_stripe_packed_alone(data, tmp_path, kind):
    tok = load_tokenizer("")
    (ld,) = _loaders(_cfg("--training.dataset", "hf", "--training.dataset_path", data[kind]), 1, tok)
    assert ld.notes() == "; this rank reads stripes 0-7 of 8"
    steps = 30  # ~3 epochs of each stripe (203 rows, ~12 tokens each, 25 rows a stripe)
    got = torch.stack([x for x, _ in _steps([ld], steps)])  # [step, slot, seq]
    texts, rows = data["texts"], len(data["texts"])

    def reference(i, shift=0):
        path = tmp_path / f"stripe{i}_{shift}.jsonl"
        lo, hi = i * rows // G + shift, (i + 1) * rows // G
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[lo:hi]))
        stream = PackedStream(FileSource(str(path), "jsonl", log_epochs=False), tok, SEQ)
        return stream.take(steps)[:, :-1]

    for i in range(G):
        assert torch.equal(got[:, i], reference(i)), i
    assert not torch.equal(got[:, 3], reference(3, shift=1))  # negative control: one row off


def test_every_batch_degree_reads_its_own_rows_and_the_same_batches(data, monkeypatch):
    tok = load_tokenizer("")
    cfg = _cfg("--training.dataset", "hf", "--training.dataset_path", data["web"])
    ref = _steps(_loaders(cfg, 1, tok), 4)
    rows = len(data["texts"])
    for degree in (2, 4, 8):
        seen = _recorded(monkeypatch)
        loaders = _loaders(cfg, degree, tok)
        got = []
        for _ in range(4):
            parts = []
            for b, ld in enumerate(loaders):
                before = len(seen)
                parts += ld.next_step()
                per = G // degree
                # rank b read rows of its own stripes only (b * per ... (b + 1) * per - 1)
                assert {s for s, _c, _r in seen[before:]} <= set(range(b * per, (b + 1) * per)), (degree, b)
                lo, hi = b * per * rows // G, (b + 1) * per * rows // G
                assert all(lo <= r < hi for _s, _c, r in seen[before:]), (degree, b)
            got.append((torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])))
        assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(ref, got)), degree
        monkeypatch.undo()


def test_a_position_saved_on_one_degree_continues_on_another(data):
    """Steps 1-2 on 4 batch ranks, their states merged as the checkpoint merges them, steps
    3-5 on 2 ranks: the batches of one uninterrupted rank."""
    tok = load_tokenizer("")
    cfg = _cfg("--training.dataset", "hf", "--training.dataset_path", data["web"])
    ref = _steps(_loaders(cfg, 1, tok), 5)
    four = _loaders(cfg, 4, tok)
    _steps(four, 2)
    partial = [ld.state_dict() for ld in four]
    assert [p["slot_range"] for p in partial] == [[0, 2], [2, 4], [4, 6], [6, 8]]
    assert set(partial[1]["sources"]["hf"]["stripes"]) == {"2", "3"}  # a rank knows its own stripes
    state = json.loads(json.dumps(merge_states(partial)))  # what the checkpoint keeps
    assert "slot_range" not in state and set(state["sources"]["hf"]["stripes"]) == {str(i) for i in range(G)}
    assert complete_state(state) is state  # a merged state is left as it is
    two = _loaders(cfg, 2, tok)
    for ld in two:
        ld.load_state_dict(state)
    for a, b in zip(ref[2:], _steps(two, 3)):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    # negative control: the position of another step does not continue it
    other = _loaders(cfg, 2, tok)
    for ld in other:
        ld.load_state_dict(json.loads(json.dumps(merge_states([ld.state_dict() for ld in _loaders(cfg, 2, tok)]))))
    assert not torch.equal(_steps(other, 1)[0][0], ref[2][0])


def test_chat_and_mixture_rows_are_striped_the_same_on_every_degree(data, tmp_path):
    """Chat conversations (packed and padded) and a mixture of striped chat and text parquet with a
    .jsonl source (one stream, read by every rank): the same batches on 1, 2 and 4 batch ranks,
    the chat targets included."""
    tok = load_tokenizer("")
    jsonl = tmp_path / "notes.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in data["texts"][:50]))
    mix = f"chat:1:{data['chat']},hf:2:{data['web']},jsonl:1:{jsonl}"
    for args in (
        ("--training.dataset", "chat", "--training.dataset_path", data["chat"]),
        ("--training.dataset", "chat", "--training.dataset_path", data["chat"], "--training.chat_packing", "padded"),
        ("--training.sources", mix),
    ):
        cfg = _cfg(*args)
        ref = _steps(_loaders(cfg, 1, tok), 3)
        assert (ref[0][1] == -100).any() and (ref[0][1] != -100).any()  # masked labels
        for degree in (2, 4):
            got = _steps(_loaders(cfg, degree, tok), 3)
            assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(ref, got)), (args, degree)
    (ld,) = _loaders(_cfg("--training.sources", mix), 1, tok)
    ld.next_step()
    assert ld.notes().startswith("; this rank reads stripes 0-7 of 8; mixture: chat ")
    assert ld.source_metrics(ld.state_dict())  # tokens per source, from the schedule
    state = ld.state_dict()
    assert set(state["sources"]["chat"]) == {"stripes"} and "cursor" in state["sources"]["jsonl"]


def test_what_striped_reading_refuses(data, tmp_path):
    tok = load_tokenizer("")
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in data["texts"][:20]))
    with pytest.raises(ConfigError, match=r"row_reading = 'striped' needs parquet or save_to_disk rows.*\.jsonl rows"):
        _loaders(
            _cfg(
                "--training.dataset", "hf", "--training.dataset_path", str(jsonl), "--training.row_reading", "striped"
            ),
            1,
            tok,
        )
    small = write_parquet(tmp_path / "small.parquet", {"text": data["texts"][:5]})
    with pytest.raises(ConfigError, match="striped.: .*has 5 rows, fewer than the 8 stripes"):
        _loaders(
            _cfg("--training.dataset", "hf", "--training.dataset_path", small, "--training.row_reading", "striped"),
            1,
            tok,
        )
    # auto: a dataset too small for stripes (or .jsonl) is read as one stream
    for path in (small, str(jsonl)):
        (ld,) = _loaders(
            _cfg("--training.dataset", "hf" if path == small else "jsonl", "--training.dataset_path", path), 1, tok
        )
        assert "stripes" not in ld.state_dict()
    # a position of another global batch, or of the other way of reading, is refused in one line
    cfg = _cfg("--training.dataset", "hf", "--training.dataset_path", data["web"])
    (ld,) = _loaders(cfg, 1, tok)
    ld.next_step()
    state = complete_state(ld.state_dict())
    (wide,) = _loaders(
        _cfg("--training.dataset", "hf", "--training.dataset_path", data["web"], "--training.global_batch_size", "16"),
        1,
        tok,
    )
    with pytest.raises(ValueError, match="global batch of 8 samples.*this run's global batch is 16"):
        wide.load_state_dict(state)
    (seq,) = _loaders(
        _cfg(
            "--training.dataset", "hf", "--training.dataset_path", data["web"], "--training.row_reading", "sequential"
        ),
        1,
        tok,
    )
    with pytest.raises(ValueError, match="written reading the rows in stripes.*row_reading = 'striped'"):
        seq.load_state_dict(state)
    with pytest.raises(ValueError, match="written reading the rows as one stream.*row_reading = 'sequential'"):
        ld.load_state_dict(seq.state_dict())


def test_local_tensor_mode_merges_every_simulated_rank(data):
    """comm.mode = local_tensor: one process holds a loader per batch coordinate
    (trainer/simulation/local_tensor.py PerRankLoader); its state is every coordinate's stripes merged."""
    from trainer.simulation.local_tensor import PerRankLoader

    class Dims:  # 4 simulated ranks: batch degree 2 x tp 2
        def coordinate(self, name, rank):
            return rank // 2

    tok = load_tokenizer("")
    cfg = _cfg("--training.dataset", "hf", "--training.dataset_path", data["web"])
    ref = _steps(_loaders(cfg, 1, tok), 3)
    per = PerRankLoader(lambda c: build_dataloader(cfg, tok, batch_rank=c, batch_degree=2), Dims(), 4)
    for ld in per.loaders.values():
        ld.next_step(), ld.next_step()
    state = per.state_dict()
    assert "slot_range" not in state and set(state["sources"]["hf"]["stripes"]) == {str(i) for i in range(G)}
    (one,) = _loaders(cfg, 1, tok)
    one.load_state_dict(state)
    assert torch.equal(_steps([one], 1)[0][0], ref[2][0])
