"""Data mixtures (trainer/data/mixture.py, ``[[training.sources]]``) and row datasets read by the
trainer (``training.dataset = "hf"``: parquet files, save_to_disk folders).

The schedule's proportions are checked against the binomial bound they must obey (and a wrong
weight shown to break it), the schedule against itself cut any way (layout independence), resume
on another batch degree, the per-source token counts against the total; the 'hf' kind gives the
token stream of the same texts as a .jsonl file."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.chat_data import conversations, write_parquet
from trainer.config import ConfigError, load_config
from trainer.data.batching import PackedDataLoader
from trainer.data.loader import build_dataloader, mixture_stream
from trainer.data.mixture import BLOCK, MixtureStream
from trainer.data.tokenizer import load_tokenizer

pytestmark = pytest.mark.unit


def _schedule(weights, seed=0):
    return MixtureStream([type("S", (), {"window": 9})()] * len(weights), [], weights, seed, masked=False)


def test_proportions_within_five_sigma_and_a_wrong_weight_breaks_the_bound():
    """Each sample is an independent draw, so over n samples a source's count is Binomial(n, p):
    |count - n p| <= 5 sqrt(n p (1 - p)) fails with probability < 6e-7 per source. The counts
    of a 0.5 / 0.3 / 0.2 mixture over 200,000 samples stay inside; the same counts judged
    against swapped weights (0.3 / 0.5 / 0.2: what a schedule mixing up its sources would
    give) are hundreds of sigma off."""
    n, weights = 200_000, [5.0, 3.0, 2.0]
    counts = np.array(_schedule(weights).counts(n))
    assert counts.sum() == n

    def sigmas(w):
        p = np.array(w) / sum(w)
        return np.abs(counts - n * p) / np.sqrt(n * p * (1 - p))

    print(f"counts {counts.tolist()}, deviations {sigmas(weights).round(2).tolist()} sigma")
    assert (sigmas(weights) <= 5).all()
    assert sigmas([3.0, 5.0, 2.0]).max() > 100  # negative control


def test_schedule_is_the_same_however_it_is_cut():
    """Global sample k's source depends on (seed, k) only: read in any pieces (a rank's slice,
    a resumed run's continuation), across block edges, the schedule is the same."""
    s = _schedule([1.0, 1.0, 2.0], seed=7)
    whole = s.choices(0, 3 * BLOCK + 17)
    pieces = np.concatenate([s.choices(a, b - a) for a, b in [(0, 5), (5, BLOCK + 3), (BLOCK + 3, 3 * BLOCK + 17)]])
    assert np.array_equal(whole, pieces)
    assert s.counts(2 * BLOCK + 5) == np.bincount(whole[: 2 * BLOCK + 5], minlength=3).tolist()
    assert not np.array_equal(whole, _schedule([1.0, 1.0, 2.0], seed=8).choices(0, len(whole)))  # seeded


@pytest.fixture(scope="module")
def mixture_cfg(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mix")
    chat = write_parquet(folder / "chat.parquet", {"messages": conversations(60, seed=1)})
    rng = np.random.default_rng(0)
    words = "the cat sat on a mat with some dog and bird".split()
    texts = [" ".join(rng.choice(words, size=rng.integers(3, 30))) for _ in range(200)]
    web = write_parquet(folder / "web.parquet", {"text": texts}, row_group_size=32)

    def cfg(*extra):
        return load_config(
            ["--config", "llama3.toml", "--training.seq_len", "32", "--model.attn_mask_type", "block_causal"]
            + ["--training.sources", f"chat:1:{chat},hf:3:{web},synthetic:1:", *extra]
        )

    return cfg, texts, folder


def test_resume_on_another_batch_degree_continues_the_same_samples(mixture_cfg):
    cfg_of, _texts, _ = mixture_cfg
    cfg = cfg_of()
    tok = load_tokenizer("")

    def loader(rank, degree):
        kw = dict(seq_len=32, global_batch_size=8, local_batch_size=8 // degree, batch_rank=rank, batch_degree=degree)
        mix = mixture_stream(cfg, tok, 32)
        return PackedDataLoader(mix, tok, stream=mix, **kw)

    ref = loader(0, 1)
    assert ref.masked and ref.source_name == "mixture"
    steps = [ref.next_step()[0] for _ in range(5)]
    first = loader(0, 1)
    first.next_step(), first.next_step()
    state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint keeps
    assert set(state["sources"]) == {"chat", "hf", "synthetic"}
    parts = [loader(r, 2) for r in range(2)]
    for p in parts:
        p.load_state_dict(state)
    for inputs, labels in steps[2:]:
        got = [p.next_step()[0] for p in parts]
        assert torch.equal(torch.cat([x for x, _ in got]), inputs) and torch.equal(
            torch.cat([y for _, y in got]), labels
        )
    metrics = ref.source_metrics(ref.state_dict())
    assert sum(metrics.values()) == 5 * 8 * 32 and set(metrics) == {"tokens_chat", "tokens_hf", "tokens_synthetic"}
    assert metrics["tokens_hf"] > 0 and metrics["tokens_chat"] > 0
    other = cfg_of("--training.sources", "hf:1:" + cfg.training.sources[1]["path"])
    with pytest.raises(ValueError, match="state is for the mixture"):
        mixture_stream(other, tok, 32).restore(state)


def test_hf_rows_give_the_jsonl_token_stream(mixture_cfg, tmp_path):
    """``dataset = "hf"`` read as one stream (``row_reading = "sequential"``; parquet with several
    row groups; a save_to_disk folder) packs the same texts into the same windows as a .jsonl file
    of them (the existing streaming path). Striped reading: tests/unit/test_striped_rows.py."""
    import datasets

    _cfg, texts, folder = mixture_cfg
    jsonl = tmp_path / "web.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "disk"))
    tok = load_tokenizer("")
    windows = {}
    for kind, path in (("jsonl", jsonl), ("hf", folder / "web.parquet"), ("hf", tmp_path / "disk")):
        cfg = load_config(
            ["--config", "llama3.toml", "--training.seq_len", "32", "--training.dataset", kind]
            + ["--training.dataset_path", str(path), "--training.global_batch_size", "8"]
            + ["--training.row_reading", "sequential"]
        )
        loader = build_dataloader(cfg, tok, batch_rank=0, batch_degree=1)
        windows[str(path)] = torch.cat([x for _ in range(3) for x, _y in loader.next_step()])
    first, *rest = windows.values()
    assert all(torch.equal(first, w) for w in rest)


def test_bad_mixture_entries_are_one_line_config_errors(tmp_path):
    def err(value):
        with pytest.raises(ConfigError) as info:
            load_config(["--config", "llama3.toml", "--training.sources", value])
        assert "\n" not in str(info.value)
        return str(info.value)

    assert err("chat:0:a.jsonl") == "training.sources[0].weight must be a finite number > 0, got '0'"
    assert "training.sources[1].weight must be a finite number > 0, got '-1'" in err("hf:1:a,hf:-1:b")
    assert "training.sources[0].kind must be one of" in err("parquet:1:a")
    assert "must be kind:weight:path" in err("chat:a.jsonl")
    toml = tmp_path / "mix.toml"
    toml.write_text(
        '[training]\ndataset = "hf"\ndataset_path = "b"\n[[training.sources]]\npath = "a"\nkind = "hf"\nweight = 1\n'
    )
    with pytest.raises(ConfigError, match="training.sources .a mixture. replaces training.dataset"):
        load_config(["--config", str(toml)])
    toml.write_text('[[training.sources]]\npath = "a"\nkind = "hf"\nweight = 1\nwieght = 2\n')
    with pytest.raises(ConfigError, match=r"training.sources\[0\] has unknown key\(s\) wieght"):
        load_config(["--config", str(toml)])


def test_missing_parquet_column_names_the_file(tmp_path):
    from trainer.data.sources import RowTextSource

    path = write_parquet(tmp_path / "x.parquet", {"body": ["a", "b"]})
    with pytest.raises(ConfigError, match=r"x.parquet has no column 'text' \(columns: body\)"):
        RowTextSource(path)
