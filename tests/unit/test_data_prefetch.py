"""Background loading (trainer/data/prefetch.py BackgroundLoader), the data-wait metric, and the
``[validation]`` config checks."""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time

import pytest
import torch

from trainer.config import ConfigError, load_config
from trainer.data.batching import PackedDataLoader
from trainer.data.loader import build_validation_dataloader, wrap_loader
from trainer.data.prefetch import BackgroundLoader, SyncLoader
from trainer.data.sources import SyntheticSource
from trainer.data.tokenizer import load_tokenizer
from trainer.reporting.metrics import MetricsLogger

TOK = load_tokenizer()


def make_loader(batch_rank=0, batch_degree=2, global_bs=8, local_bs=2, seed=3, seq=16):
    return PackedDataLoader(
        SyntheticSource(seed=seed),
        TOK,
        seq_len=seq,
        global_batch_size=global_bs,
        local_batch_size=local_bs,
        batch_rank=batch_rank,
        batch_degree=batch_degree,
    )


def steps_of(ld, n):
    return [[(x.clone(), y.clone()) for x, y in ld.next_step()] for _ in range(n)]


def same(a, b):
    return len(a) == len(b) and all(
        len(sa) == len(sb) and all(torch.equal(x, u) and torch.equal(y, v) for (x, y), (u, v) in zip(sa, sb))
        for sa, sb in zip(a, b)
    )


@pytest.mark.parametrize("batch_rank", [0, 1])
def test_background_loading_gives_the_same_samples_and_resume_state(batch_rank):
    """Step by step: identical micro-batches, and after every step the state a checkpoint would
    save is the position of the next step the trainer consumes (not the prefetched one): the
    same dict as the plain loader's, and resuming a fresh loader from it continues identically."""
    plain, bg = make_loader(batch_rank), BackgroundLoader(make_loader(batch_rank))
    assert bg.state_dict() == plain.state_dict()  # before the first step
    with bg:
        for _ in range(5):
            assert same(steps_of(bg, 1), steps_of(plain, 1))
            concurrent.futures.wait([bg._future])  # the next step is prefetched: the thread is ahead ...
            assert bg.loader.state_dict() != plain.state_dict()
            assert bg.state_dict() == plain.state_dict()  # ... the saved position is not
        state = bg.state_dict()
    assert (bg.grad_accum_steps, bg.tokens_per_step) == (plain.grad_accum_steps, plain.tokens_per_step)
    expected = steps_of(plain, 3)
    resumed = BackgroundLoader(make_loader(batch_rank))
    with resumed:
        resumed.load_state_dict(state)
        assert same(steps_of(resumed, 3), expected)
    # resuming after steps were prefetched drops the prefetched step
    again = BackgroundLoader(make_loader(batch_rank))
    with again:
        steps_of(again, 2)
        again.load_state_dict(state)
        assert same(steps_of(again, 3), expected)
    # after close() the prefetched step is kept: nothing is skipped when it goes on
    ref = make_loader(batch_rank)
    paused = BackgroundLoader(make_loader(batch_rank))
    with paused:
        a = steps_of(paused, 2)
    b = steps_of(paused, 2)
    paused.close()
    assert same(a + b, steps_of(ref, 4))


def test_sync_loader_is_the_plain_loader():
    plain, sync = make_loader(), wrap_loader(make_loader(), prefetch=False)
    assert isinstance(sync, SyncLoader) and isinstance(wrap_loader(make_loader(), True), BackgroundLoader)
    assert same(steps_of(sync, 3), steps_of(plain, 3)) and sync.state_dict() == plain.state_dict()


def test_background_error_surfaces_on_the_training_thread():
    """A dataset error raised in the thread comes out of next_step() with its type and message."""

    class Broken(SyntheticSource):
        def read(self, cursor):
            if cursor[0] >= 40:
                raise ValueError("corpus.jsonl (byte 123): invalid JSON line")
            return super().read(cursor)

    ld = PackedDataLoader(
        Broken(seed=1), TOK, seq_len=16, global_batch_size=4, local_batch_size=2, batch_rank=0, batch_degree=1
    )
    with BackgroundLoader(ld) as bg:
        with pytest.raises(ValueError, match=r"corpus.jsonl \(byte 123\): invalid JSON line"):
            for _ in range(100):
                bg.next_step()
        assert threading.current_thread() is threading.main_thread()


class SlowLoader:
    """A fake data source that takes ``delay`` seconds per step."""

    def __init__(self, delay):
        self.delay, self.steps = delay, 0
        self.grad_accum_steps, self.tokens_per_step = 1, 8

    def next_step(self):
        time.sleep(self.delay)
        self.steps += 1
        return [(torch.full((1, 8), self.steps), torch.full((1, 8), self.steps))]

    def state_dict(self):
        return {"steps": self.steps}

    def load_state_dict(self, state):
        self.steps = state["steps"]


def test_slow_data_shows_up_as_data_wait_and_prefetch_hides_it():
    # data slower than the step: the loop waits about (data time - step time) per step
    with BackgroundLoader(SlowLoader(0.06)) as bg:
        waits = []
        for _ in range(4):
            bg.next_step()
            waits.append(bg.wait_s)
            time.sleep(0.01)  # the "training step"
    assert min(waits) > 0.03, waits
    # without prefetching every step waits the whole data time
    sync = SyncLoader(SlowLoader(0.06))
    sync.next_step()
    assert sync.wait_s > 0.05
    # a step longer than the data time hides it (after the first step, which nothing preceded)
    with BackgroundLoader(SlowLoader(0.02)) as bg:
        waits = []
        for _ in range(4):
            batches = bg.next_step()
            waits.append(bg.wait_s)
            time.sleep(0.08)
    assert waits[0] > 0.015 and max(waits[1:]) < 0.015, waits
    assert int(batches[0][0][0, 0]) == 4 and bg.state_dict() == {"steps": 4}


def test_data_wait_is_reported_in_console_jsonl_and_tensorboard(tmp_path, capsys):
    cfg = load_config(["--metrics.enable_tensorboard", "true"])
    with MetricsLogger(str(tmp_path), 0, cfg) as m:
        m.log(1, loss=2.0, grad_norm=1.0, lr=1e-3, num_tokens=100, data_wait_s=0.0123)
        m.log_validation(1, loss=1.5, steps=2, tokens=64, seconds=0.5)
    out = capsys.readouterr().out
    assert "data    12.3ms" in out
    assert "validation at step 1: loss   1.5000  perplexity" in out
    train, val = (json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines())
    assert train["data_wait_s"] == pytest.approx(0.0123) and "validation_loss" not in train
    assert "loss" not in val and val["step"] == 1
    assert val["validation_loss"] == 1.5 and val["validation_perplexity"] == pytest.approx(4.4816890703)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert {"data_wait_s", "validation_loss", "validation_perplexity"} <= set(acc.Tags()["scalars"])


# ------------------------------------------------------------------ [validation] config


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--validation.freq", "0"], "validation.freq must be > 0"),
        (["--validation.steps", "0"], "validation.steps must be > 0, or -1"),
        (["--validation.local_batch_size", "0"], "validation.local_batch_size must be > 0"),
        (["--validation.seq_len", "0"], "validation.seq_len must be > 0"),
        (["--validation.steps", "-1"], "set validation.steps to a number of steps"),
        (["--validation.dataset", "jsonl"], "validation.dataset = 'jsonl' needs validation.dataset_path"),
        (["--validation.dataset", "tokenz"], "did you mean 'tokens'?"),
        (["--validation.global_batch_size", "0"], r"validation.global_batch_size must be > 0 or -1"),
        (
            ["--validation.global_batch_size", "6", "--validation.local_batch_size", "4"],
            r"validation.global_batch_size \(6\) must be a multiple of validation.local_batch_size \(4\)",
        ),
        (["--parallelism.tp", "2", "--validation.seq_len", "33"], r"validation.seq_len \(33\) must be divisible by 2"),
        (
            ["--parallelism.cp", "2", "--parallelism.tp", "2", "--validation.seq_len", "36"],
            r"validation.seq_len \(36\) must be divisible by 8",
        ),
        (
            ["--parallelism.pp", "2", "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"],
            "ZBV schedule has no forward-only",
        ),
        (
            ["--parallelism.pp", "2", "--validation.local_batch_size", "3"],
            r"validation.local_batch_size \(3\) must be divisible by the pipeline microbatch count 2",
        ),
    ],
)
def test_validation_config_errors_name_the_field_and_the_fix(argv, message):
    base = ["--validation.enable", "--validation.steps", "2", "--training.local_batch_size", "4"]
    with pytest.raises(ConfigError, match=message):
        load_config(base + argv)


def test_validation_batch_against_the_layout_is_checked_by_the_job_plan():
    from trainer.plan import plan_job, validation_batch

    argv = ["--validation.enable", "--validation.steps", "2", "--training.local_batch_size", "2"]
    cfg = load_config(argv + ["--validation.global_batch_size", "12", "--validation.local_batch_size", "2"])
    with pytest.raises(
        ConfigError, match=r"validation.global_batch_size \(12\) must be a multiple of batch degree \(4\)"
    ):
        plan_job(cfg, 4, TOK.vocab_size)
    assert validation_batch(cfg, 2) == (12, 3)  # 3 micro-batches per rank per validation step
    cfg = load_config(argv + ["--validation.local_batch_size", "3"])
    assert validation_batch(cfg, 4) == (12, 1)  # -1: local x batch degree
    # the RoPE table covers a validation sequence longer than training's
    cfg = load_config(argv + ["--training.seq_len", "64", "--validation.seq_len", "4096"])
    assert plan_job(cfg, 1, TOK.vocab_size).model_args.max_seq_len == 4096


def test_validation_config_defaults_and_disabled_section_is_not_checked():
    cfg = load_config([])
    v = cfg.validation
    assert (v.enable, v.dataset, v.freq, v.steps, v.local_batch_size, v.seq_len) == (
        False,
        "synthetic",
        10,
        -1,
        8,
        2048,
    )
    assert cfg.training.prefetch is True
    load_config(["--validation.freq", "0"])  # ignored while validation is off


def test_validation_data_is_held_out_and_starts_over(tmp_path):
    cfg = load_config(["--validation.enable", "--validation.steps", "2", "--validation.seq_len", "16"])
    cfg.training.seq_len = 16
    val = build_validation_dataloader(cfg, TOK, batch_rank=0, batch_degree=2)
    assert val.global_batch_size == 2 * cfg.validation.local_batch_size and val.grad_accum_steps == 1
    train = make_loader(global_bs=16, local_bs=8, seed=cfg.training.seed)
    v0, t0 = val.next_step()[0][0], train.next_step()[0][0]
    assert v0.shape == t0.shape and not torch.equal(v0, t0)  # another part of the corpus
    again = build_validation_dataloader(cfg, TOK, batch_rank=0, batch_degree=2)
    assert torch.equal(again.next_step()[0][0], v0)
    missing = load_config(
        ["--validation.enable", "--validation.steps", "1", "--validation.dataset", "text"]
        + ["--validation.dataset_path", str(tmp_path / "nope.txt")]
    )
    with pytest.raises(ConfigError, match="validation.dataset_path .* does not exist"):
        build_validation_dataloader(missing, TOK, batch_rank=0, batch_degree=1)


def test_tokens_validation_data_and_one_pass(tmp_path):
    from tools.tokenize.writer import tokenize_to_shards
    from trainer.validation import one_pass_steps

    index = tokenize_to_shards(["synthetic:7:40"], str(tmp_path / "val"), shard_tokens=500, workers=1, log=None)
    argv = ["--validation.enable", "--validation.dataset", "tokens", "--validation.dataset_path", str(tmp_path / "val")]
    cfg = load_config(argv + ["--validation.seq_len", "16", "--validation.local_batch_size", "2"])
    assert cfg.validation.steps == -1  # allowed for 'tokens': one pass
    val = build_validation_dataloader(cfg, TOK, batch_rank=1, batch_degree=2)
    assert one_pass_steps(cfg, val) == index["total_tokens"] // 17 // 4 >= 1
    x, y = val.next_step()[0]
    assert x.shape == (2, 16) and torch.equal(x[:, 1:], y[:, :-1])
    small = load_config(argv + ["--validation.seq_len", "512", "--validation.local_batch_size", "8"])
    with pytest.raises(ConfigError, match="fewer than one validation batch"):
        one_pass_steps(small, build_validation_dataloader(small, TOK, batch_rank=0, batch_degree=2))
    with pytest.raises(ConfigError, match="validation.dataset_path '.*' was tokenized with"):
        build_validation_dataloader(cfg, load_tokenizer("bytes"), batch_rank=0, batch_degree=1)
