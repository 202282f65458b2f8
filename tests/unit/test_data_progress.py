"""The data's progress beside the step count (trainer/reporting/data_progress.py), in process on the
loaders the trainer builds: the global epoch (complete passes; the step a pass completes counted
from the rows, the same on every batch degree, striped and sequential, and kept by a saved
position), each source kind's passes, the per-source target counts of the step's one all-reduce
(trainer/step.py) and their totals kept with the data position, ``training.epochs`` refused on
synthetic data, chat validation data without any target refused at start-up, and the summary's
rows. The launches (the run stopping at that step on 1 and 2 ranks, a resume keeping the epoch)
are in tests/e2e/test_chat_train.py."""

from __future__ import annotations

import pytest
import torch

from tests.chat_data import conversations, write_jsonl, write_parquet
from trainer.config import ConfigError, load_config
from trainer.data.loader import build_dataloader
from trainer.data.packing import IGNORE_INDEX
from trainer.data.prefetch import BackgroundLoader, SyncLoader
from trainer.data.striped import merge_states
from trainer.data.tokenizer import load_tokenizer
from trainer.reporting.data_progress import DataProgress, epoch_of

pytestmark = pytest.mark.unit

R, G = 24, 8  # rows, and stripes (the global batch): 3 rows per stripe


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("progress")
    rows = conversations(R, seed=5)
    texts = [" ".join(m["content"] for m in conv) for conv in rows]
    return {
        "parquet": write_parquet(folder / "chat.parquet", {"messages": rows}, row_group_size=5),
        "jsonl": write_jsonl(folder / "chat.jsonl", rows),
        "web": write_parquet(folder / "web.parquet", {"text": texts}, row_group_size=7),
        "folder": folder,
    }


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def _cfg(*args):
    return load_config(
        ["--config", "llama3.toml", "--training.seq_len", "32", "--training.global_batch_size", str(G)]
        + ["--training.local_batch_size", "2", "--training.chat_packing", "padded", *args]
    )


def _global_epoch(loaders) -> int | None:
    """The epoch the ranks agree on: each source's fewest passes over the ranks (what the stop
    agreement's max over negated counts gives), then the most among the finite sources."""
    per_rank = [ld.passes(ld.state_dict()) for ld in loaders]
    agreed = [None if any(p is None for p in col) else min(col) for col in zip(*per_rank)]
    return epoch_of(agreed)


@pytest.mark.parametrize("reading", ["striped", "sequential"])
def test_the_epoch_completes_at_the_step_that_reads_the_last_row_on_every_degree(files, tok, reading):
    """Padded chat windows, one conversation (row) each: pass p completes at the step whose
    samples reach p * R rows, i.e. step 3 and 6 of 8 samples: epochs [0, 0, 1, 1, 1, 2] after
    steps 1-6, on batch degrees 1, 2 and 4 (striped: the fewest over the ranks' own stripes).
    A position saved at step 4 (every rank's stripes merged, as the checkpoint holds it) gives
    epoch 1 again on another degree."""
    path = files["parquet"] if reading == "striped" else files["jsonl"]
    cfg = _cfg("--training.dataset", "chat", "--training.dataset_path", path, "--training.row_reading", reading)
    for degree in (1, 2, 4):
        loaders = [build_dataloader(cfg, tok, batch_rank=b, batch_degree=degree) for b in range(degree)]
        assert all(ld.passes_agree == (reading == "striped") for ld in loaders)
        epochs = []
        for step in range(1, 7):
            for ld in loaders:
                ld.next_step()
            epochs.append(_global_epoch(loaders))
            if step == 4:
                saved = _position(loaders)
        assert epochs == [step * G // R for step in range(1, 7)] == [0, 0, 1, 1, 1, 2], (degree, epochs)
        for other in (1, 2):
            again = [build_dataloader(cfg, tok, batch_rank=b, batch_degree=other) for b in range(other)]
            for ld in again:
                ld.load_state_dict(saved)
            assert _global_epoch(again) == 1


def _position(loaders):
    """The position a checkpoint holds: every rank's stripes merged (one stream: any rank's)."""
    states = [ld.state_dict() for ld in loaders]
    return merge_states(states) if "slot_range" in states[0] else states[0]


def test_each_kind_counts_its_passes(files, tok, tmp_path):
    """Sequential streams: a pass is complete once its last token is in a consumed window (a
    .jsonl file with trailing blank lines included; parquet rows, 'hf'); token shards by their
    position; synthetic data has none; in a mixture the epoch is the most passes among the
    finite sources. Negative control: one window short of the data, the pass is not complete."""
    text = tmp_path / "t.jsonl"
    text.write_text('{"text": "a b c d e f g h"}\n{"text": "i j k l"}\n\n  \n')
    n_tokens = sum(len(tok.encode(t)) + 1 for t in ("a b c d e f g h", "i j k l"))
    for kind, path in (("jsonl", str(text)), ("hf", files["web"])):
        cfg = _cfg("--training.dataset", kind, "--training.dataset_path", path, "--training.row_reading", "sequential")
        cfg.training.global_batch_size = cfg.training.local_batch_size = 1
        ld = build_dataloader(cfg, tok, batch_rank=0, batch_degree=1)
        total = n_tokens if kind == "jsonl" else None
        seen = 0
        while ld.passes(ld.state_dict()) == [0]:
            ld.next_step()
            seen += 33
        if total is not None:  # the step that took the last token (windows of 33 tokens)
            assert seen - 33 < total <= seen, (seen, total)
    synthetic = build_dataloader(_cfg(), tok, batch_rank=0, batch_degree=1)
    synthetic.next_step()
    assert synthetic.passes(synthetic.state_dict()) == [None] and epoch_of([None]) is None
    assert epoch_of([None, 0, 3, 1]) == 3
    mix = _cfg(
        "--training.sources", f"chat:1:{files['jsonl']},hf:3:{files['web']},synthetic:1:",
        "--training.row_reading", "sequential",
    )  # fmt: skip
    ld = build_dataloader(mix, tok, batch_rank=0, batch_degree=1)
    steps = 0
    while epoch_of(ld.passes(ld.state_dict())) == 0:
        ld.next_step()
        steps += 1
    assert sorted(p for p in ld.passes(ld.state_dict()) if p is not None) == [0, 1] and steps > 1
    assert ld.passes(ld.state_dict())[2] is None  # synthetic: never ends


def test_token_shards_count_passes_by_position():
    from trainer.data.token_shards import TokenStream

    stream = TokenStream(type("D", (), {"__len__": lambda self: 100})(), 9)
    assert stream.passes({"position": 99}) == 0 and stream.passes({"position": 100}) == 1
    assert stream.passes({"position": 250}) == 2


def test_per_source_target_counts_sum_to_the_count_and_survive_a_saved_position(files, tok):
    """The step's per-source counts (each sample's source carried as ``step_sources``) sum to
    the scalar count, a pre-training source's equal its window positions; the totals travel with
    the position through both loader wrappers (saved, restored on another degree)."""
    from trainer.step import global_target_count

    class OneProcess:
        def get_optional_mesh(self, name):
            return None

    cfg = _cfg("--training.sources", f"chat:1:{files['parquet']},hf:1:{files['web']}")
    totals = {}
    for wrap in (SyncLoader, BackgroundLoader):
        data = wrap(build_dataloader(cfg, tok, batch_rank=0, batch_degree=1))
        assert data.masked and data.source_names == ["chat", "hf"]
        progress = DataProgress(data, epochs=0, peers=False)
        for _ in range(3):
            mbs = data.next_step()
            labels = [y for _x, y in mbs]
            per = global_target_count(labels, OneProcess(), torch.device("cpu"), sources=data.step_sources, n_sources=2)
            whole = global_target_count(labels, OneProcess(), torch.device("cpu"), at_least_one=False)
            assert int(per.sum()) == int(whole) and per.shape == (2,)
            progress.add_targets(per.tolist())
        assert sum(int((y != IGNORE_INDEX).sum()) for y in labels) == int(whole)
        tokens = data.source_metrics(data.state_dict())
        row = {**tokens, **progress.metrics(tokens)}
        assert row["targets"] == row["targets_chat"] + row["targets_hf"] and row["targets_hf"] == row["tokens_hf"]
        assert 0 < row["targets_chat"] < row["tokens_chat"]
        totals[wrap.__name__] = dict(data.targets)
        state = data.state_dict()
        data.close()
        other = SyncLoader(build_dataloader(cfg, tok, batch_rank=1, batch_degree=2))
        other.load_state_dict(state)
        assert other.targets == data.targets and "targets" not in other.loader.state_dict()
    assert totals["SyncLoader"] == totals["BackgroundLoader"]


def test_epochs_refused_on_synthetic_data_and_negative():
    with pytest.raises(ConfigError, match=r"^training.epochs = 2 counts passes over the data, but synthetic data"):
        load_config(["--config", "llama3.toml", "--training.epochs", "2"])
    with pytest.raises(ConfigError, match=r"synthetic data never ends"):
        load_config(["--config", "llama3.toml", "--training.epochs", "1", "--training.sources", "synthetic:1:"])
    with pytest.raises(ConfigError, match=r"training.epochs must be >= 0"):
        load_config(["--config", "llama3.toml", "--training.epochs", "-1"])
    load_config(["--config", "llama3.toml", "--training.epochs", "1", "--training.sources", "synthetic:1:,jsonl:1:x"])


def test_chat_validation_without_targets_is_refused_at_start_up(files, tok, tmp_path):
    """Validation conversations with no assistant turn would report a loss of 0: one line that
    names validation.dataset_path. The same check passes on conversations with assistant turns."""
    from trainer.validation import check_validation_targets

    bare = [[{"role": "user", "content": "hello there"}] for _ in range(6)]
    path = write_jsonl(tmp_path / "val.jsonl", bare)
    cfg = _cfg(*"--validation.enable true --validation.steps 1 --validation.dataset chat".split(),
               "--validation.dataset_path", path)  # fmt: skip
    with pytest.raises(ConfigError, match=r"^validation.dataset_path '.*val.jsonl': the 8 windows an evaluation reads"):
        check_validation_targets(cfg, tok, 8)
    cfg.validation.dataset_path = files["jsonl"]
    check_validation_targets(cfg, tok, 8)


def test_the_summary_says_why_the_run_stopped():
    from trainer.reporting.run_summary import RunTotals, summary_lines

    t = RunTotals(0.0)
    t.begin(3, 100, {"chat": 10})
    t.step(6, 1.0)
    t.epoch, t.epochs, t.epochs_reached, t.targets = 2, 2, True, {"chat": 40, "hf": 60}
    lines = summary_lines(t, run_folder="r", total_steps=50, checkpoint_folder=None, metrics_file=None, now=1.0)
    assert (
        "  targets      90 target tokens this launch (100 since step 0); since step 0 per source: chat 40, hf 60"
        in lines
    )
    assert any("epoch 2 (complete passes over the data); stopped: training.epochs = 2 reached at step 6, before "
               "training.steps = 50" in line for line in lines), lines  # fmt: skip
    t.epochs_reached, t.last_step = False, 50
    lines = summary_lines(t, run_folder="r", total_steps=50, checkpoint_folder=None, metrics_file=None, now=1.0)
    assert any("stopped: training.steps = 50 reached before training.epochs = 2" in line for line in lines), lines
