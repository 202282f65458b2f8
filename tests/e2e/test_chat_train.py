"""Chat fine-tuning through train.py (``training.dataset = "chat"``): the loss over assistant
tokens only is the same on every layout; kill-and-resume of a mixture of chat and text parquet
rows continues bitwise (one launch pair proves chat, parquet and mixture state); bad rows end the
run with one line and exit 2; resumed on another layout, the mixture continues the same samples
(lr = 0, bitwise; at loader level also tests/unit/test_chat_data.py, test_mixture.py).

Layout invariance: one ``tools.compare_loss`` launch (forked ranks) over single, fsdp=2, tp=2,
cp=2, pp=2 and dp_replicate=2 x fsdp=2, validation on chat data included, with the MATRIX shapes
of tests/e2e/test_compare_loss.py (2 blocks, seq_len 64, global batch 8 of local batch 2:
gradient accumulation of 1 to 4 micro-batches, 3 steps). The data is built so that the claim
has teeth (:func:`_check_chat_windows` measures it on the runs' own loader): packed windows of
several conversations under block-causal masking, a minority of positions being targets (a loss
over positions would differ by a factor), truncated long conversations, and windows and whole
micro-batches where the cp=2 rank 0 chunk (positions [0, 16) and [48, 64)) holds no target, so
one cp rank's loss sum is 0 while its attention still serves the other's targets. The shipped
tokenizer and its built-in template (the model's vocabulary fits it).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.chat_data import conversations, write_jsonl, write_parquet

from .helpers import FAST, metric_records, run_compare_loss, run_forked, validation_records
from .test_compare_loss import MATRIX, STEPS, _explain

CHAT_LAYOUTS = ["single", "fsdp=2", "tp=2", "cp=2", "pp=2", "dp_replicate=2,fsdp=2"]


def _data(n: int) -> list[list[dict]]:
    """Rows i % 6 < 4: one tiny exchange (22 tokens with the built-in template, targets at
    positions 19-21: two per packed window, both in the cp=2 rank 1 chunk); the others: up to
    three exchanges, mostly longer than a window (truncated)."""
    long = conversations(n, seed=11)
    tiny = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    return [tiny if i % 6 < 4 else long[i] for i in range(n)]


@pytest.fixture(scope="module")
def chat_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("chat")
    rows = _data(120)
    texts = [" ".join(m["content"] for m in conv) for conv in conversations(80, seed=12)]
    return {
        "jsonl": write_jsonl(folder / "train.jsonl", rows),
        "parquet": write_parquet(folder / "train.parquet", {"messages": rows}),
        "web": write_parquet(folder / "web.parquet", {"text": texts}, row_group_size=16),
    }


def _chat_args(path: str) -> list[str]:
    return ["--training.dataset", "chat", "--training.dataset_path", path]


def _validation_args(path: str) -> list[str]:
    return [
        "--validation.enable", "true", "--validation.dataset", "chat", "--validation.dataset_path", path,
        "--validation.seq_len", "64", "--validation.local_batch_size", "2", "--validation.global_batch_size", "8",
        "--validation.steps", "1", "--validation.freq", str(STEPS),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def chat_comparison(tmp_path_factory, chat_files):
    out = tmp_path_factory.mktemp("chatcmp") / "cmp"
    proc = run_compare_loss(
        "--config", "train_configs/llama3.toml", "--steps", str(STEPS), "--out", str(out), "--timeout", "300",
        "--launcher", "fork", "--layouts", *CHAT_LAYOUTS,
        "--", *MATRIX, *_chat_args(chat_files["jsonl"]), *_validation_args(chat_files["jsonl"]),
    )  # fmt: skip
    return proc, out


def _check_chat_windows(folder) -> None:
    """The runs' data, read by the trainer's loader from a run's saved config."""
    import torch

    from models.common.sequence import load_balanced_shard
    from trainer.config import load_config
    from trainer.data.loader import build_dataloader, document_separator
    from trainer.data.packing import IGNORE_INDEX
    from trainer.data.tokenizer import load_tokenizer

    cfg = load_config(["--config", str(folder / "config.toml")])
    assert (cfg.training.dataset, cfg.training.chat_packing, cfg.model.attn_mask_type) == (
        "chat",
        "packed",
        "block_causal",
    )
    tokenizer = load_tokenizer(cfg.model.tokenizer_path)
    loader = build_dataloader(cfg, tokenizer, batch_rank=0, batch_degree=1)
    steps = [loader.next_step() for _ in range(STEPS)]
    inputs = torch.cat([x for step in steps for x, _ in step])
    labels = torch.cat([y for step in steps for _, y in step])
    targets = labels != IGNORE_INDEX
    sep = document_separator(cfg, tokenizer)
    assert sep == tokenizer.pad_id != tokenizer.eos_id  # the built-in template ends turns with eos
    print(
        f"chat data: {targets.float().mean():.3f} of positions are targets, "
        f"{(inputs == sep).sum(1).float().mean():.2f} conversation ends per window; {loader.notes()}"
    )
    assert 0.05 < targets.float().mean() < 0.5
    assert (inputs == sep).sum(1).max() >= 2  # several conversations in a window
    assert loader._stream.truncated > 0
    chunk0 = load_balanced_shard(targets, 1, 0, 2)  # what cp=2 rank 0 holds of each window
    assert (~chunk0.any(1)).sum() >= 4  # windows ...
    micro = chunk0.view(-1, 2, chunk0.size(1)).any(2).any(1)
    assert not micro.all()  # ... and a whole 2-window micro-batch without a target on that rank
    # why a wrong denominator could not pass: the two fsdp=2 ranks' halves of each step (measured:
    # 45/41, 29/43, 44/34 targets), and the two cp chunks, hold different numbers of targets, so a
    # per-rank mean would weight their token losses by ratios a few percent to 20% apart (the
    # tolerance is 1e-5), and a loss over positions would be off by 1 / the target share
    per_step = targets.view(STEPS, 2, 4, -1).flatten(2).sum(2)
    assert (per_step[:, 0] != per_step[:, 1]).all(), per_step
    chunk1 = load_balanced_shard(targets, 1, 1, 2)
    assert (chunk0.sum() - chunk1.sum()).abs() > 0.1 * targets.sum()


def test_chat_layouts_match_one_process(chat_comparison):
    """Every layout gives the one-process loss, grad norm and validation loss within
    compare_loss's default tolerance on every step (no tolerance loosened)."""
    proc, out = chat_comparison
    assert proc.returncode == 0, _explain(proc)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["passed"] and (summary["rtol"], summary["atol"], summary["grad_norm_rtol"]) == (1e-5, 1e-5, 1e-4)
    assert [r["layout"] for r in summary["runs"]] == CHAT_LAYOUTS
    for run in summary["runs"]:
        assert run["status"] in ("ok", "baseline") and run["first_step_beyond"] is None, run
        print(
            f"{run['layout']:<24} max rel loss diff {run['max_rel_diff']:.2e}  grad-norm rel diff "
            f"{run['grad_norm_max_rel_diff']:.2e}  validation steps {run.get('validation_steps')}"
        )
        folder = Path(run["folder"])
        log = (folder / "train.log").read_text()
        d = run["degrees"]
        mesh = (
            f"world={run['nproc']} pp={d['pp']} dp_replicate={d['dp_replicate']} dp_shard={d['dp_shard']} cp={d['cp']}"
        )
        assert f"mesh: {mesh} tp={d['tp']}" in log
        assert "chat conversations in" in log and "truncated and 0 dropped" in log
        assert [r["step"] for r in metric_records(folder)] == list(range(1, STEPS + 1))
        assert sorted(validation_records(folder)) == [STEPS]  # the validation loss was compared too
    _check_chat_windows(Path(summary["runs"][0]["folder"]))


RESUME = [
    "--config", "llama3.toml", *FAST, "--model.n_layers", "2", "--parallelism.dp_shard", "2",
    "--model.attn_mask_type", "block_causal", "--training.steps", "4", "--lr_scheduler.warmup_steps", "2",
    "--checkpoint.enable", "true", "--checkpoint.interval", "2",
]  # fmt: skip


def test_kill_after_a_save_and_resume_is_bitwise(tmp_path, chat_files):
    """A 2-rank run on a mixture of chat rows (parquet) and text rows (parquet, 'hf') saves at
    steps 2 and 4; the step-4 checkpoint and the later metrics removed leave what a kill
    between the two saves leaves; the same command resumes at step 2 and logs steps 3-4
    bitwise as the uninterrupted run (weights, optimizer, the schedule and both sources'
    positions restored). Every row's per-source token counts add up to the tokens trained; its
    target counts (trainer/reporting/data_progress.py) are the text source's window positions and fewer than
    the chat source's, sum to ``targets``, and continue across the resume."""
    run = tmp_path / "run"
    mix = f"chat:1:{chat_files['parquet']},hf:1:{chat_files['web']}"
    args = [*RESUME, "--training.sources", mix, "--job.dump_folder", str(run)]
    res = run_forked(2, *args)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert "dataset: mixture of chat (chat, " in res.stdout and "mixture: chat " in res.stdout, res.stdout[-3000:]
    rows = metric_records(run)
    full = [(r["step"], r["loss"], r["grad_norm"], r["targets_chat"], r["targets_hf"]) for r in rows]
    assert [s for s, *_ in full] == [1, 2, 3, 4]
    for r in rows:  # global batch 8 x seq_len 64 per step
        assert r["tokens_chat"] + r["tokens_hf"] == r["step"] * 8 * 64 and r["tokens_chat"] > 0 < r["tokens_hf"]
        assert r["targets"] == r["targets_chat"] + r["targets_hf"] and r["targets_hf"] == r["tokens_hf"]
        assert 0 < r["targets_chat"] < r["tokens_chat"] and r["epoch"] == 0
    # 32 samples at p = 1/2 each: the chat count within 5 sigma (sqrt(32 / 4)) of 16
    assert abs(rows[-1]["tokens_chat"] / 64 - 16) <= 5 * 8**0.5
    shutil.rmtree(run / "checkpoint" / "step-4")
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("".join(l + "\n" for l in lines if json.loads(l)["step"] <= 2))
    res = run_forked(2, *args)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert f"resumed from {run / 'checkpoint'} at step 2" in res.stdout, res.stdout[-2000:]
    again = [(r["step"], r["loss"], r["grad_norm"], r["targets_chat"], r["targets_hf"]) for r in metric_records(run)]
    assert again == full  # bitwise


def test_bad_chat_row_is_one_line_exit_2(tmp_path):
    path = tmp_path / "bad.jsonl"
    good = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    path.write_text(json.dumps(good) + "\n" + json.dumps({"messages": [{"role": "robot", "content": "x"}]}) + "\n")
    res = run_forked(
        1, "--config", "llama3.toml", *FAST, "--model.n_layers", "1", "--parallelism.dp_shard", "1",
        "--training.steps", "1", "--checkpoint.enable", "false", "--model.attn_mask_type", "block_causal",
        *_chat_args(str(path)), "--job.dump_folder", str(tmp_path / "run"),
    )  # fmt: skip
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-3000:]
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    errors = [line for line in res.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, res.stderr[-3000:]
    assert "bad.jsonl (byte " in errors[0] and "unknown role 'robot'" in errors[0], errors


def test_mixture_resumed_on_another_layout_continues_the_same_samples(tmp_path, chat_files):
    """Steps 1-2 on fsdp=2 (batch degree 2), checkpoint, steps 3-4 on tp=2 (batch degree 1),
    against tp=2 all the way, on the chat + text mixture. With lr = 0 the weights stay the
    initial ones bitwise under both layouts (tests/e2e/test_tokens_train.py's argument), so the
    losses after the resume depend only on the samples: equal bitwise iff the resumed run reads
    exactly the uninterrupted run's samples, from both sources, in the same order. The per-source
    target counts (global, kept with the data position) continue on the other degree too."""
    mix = f"chat:1:{chat_files['parquet']},hf:1:{chat_files['web']}"
    args = [*RESUME, "--training.sources", mix, "--optimizer.lr", "0", "--checkpoint.interval", "2"]
    ref, resumed = tmp_path / "ref", tmp_path / "resumed"
    for folder, extra in ((ref, ["--parallelism.dp_shard", "1", "--parallelism.tp", "2"]), (resumed, [])):
        res = run_forked(
            2, *args, *extra, "--training.steps", "4" if folder == ref else "2", "--job.dump_folder", str(folder)
        )
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    res = run_forked(
        2, *args, "--parallelism.dp_shard", "1", "--parallelism.tp", "2", "--job.dump_folder", str(resumed)
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert f"resumed from {resumed / 'checkpoint'} at step 2" in res.stdout, res.stdout[-2000:]
    expected = [(r["step"], r["loss"], r["targets_chat"], r["targets_hf"]) for r in metric_records(ref)]
    assert len({loss for _s, loss, *_ in expected}) == 4  # lr = 0: the losses differ only by their samples
    got = [(r["step"], r["loss"], r["targets_chat"], r["targets_hf"]) for r in metric_records(resumed) if r["step"] > 2]
    assert got == expected[2:]


def test_training_epochs_stops_where_the_rows_are_read_on_any_degree_and_a_resume_keeps_the_epoch(tmp_path):
    """``training.epochs`` (trainer/reporting/data_progress.py) on 24 chat rows, one per padded window,
    read in 8 stripes of 3 rows (the global batch of 8): pass p is complete at the step whose
    samples reach 24 p rows. One rank with epochs = 2 stops at step 6 of training.steps = 50,
    epoch [0, 0, 1, 1, 1, 2] after steps 1-6 (each stripe's rows counted: 8 samples a step);
    2 batch ranks (each knows only its own stripes; they agree on the stop agreement's all-reduce)
    with epochs = 1 stop at step 3, saving there; the same folder with epochs = 2 resumes at
    epoch 1 (not 0), stops at step 6 with the 1-rank run's target count (global, carried by the
    checkpoint); once more, it has nothing to train."""
    path = write_parquet(tmp_path / "rows.parquet", {"messages": conversations(24, seed=4)})
    args = [
        "--config", "llama3.toml", *FAST, "--model.n_layers", "1", "--training.steps", "50",
        *_chat_args(path), "--training.chat_packing", "padded", "--checkpoint.enable", "true",
        "--checkpoint.interval", "100",
    ]  # fmt: skip
    one, two = tmp_path / "one", tmp_path / "two"
    res = run_forked(1, *args, "--parallelism.dp_shard", "1", "--training.epochs", "2", "--job.dump_folder", str(one))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    rows = metric_records(one)
    assert [(r["step"], r["epoch"]) for r in rows] == [(s, s * 8 // 24) for s in range(1, 7)]
    assert "epoch 1 complete after step 3 (all of 'chat' read once); the data starts over" in res.stdout
    assert "stopped: training.epochs = 2 reached at step 6, before training.steps = 50" in res.stdout
    assert "stripe 0 of 8" not in res.stdout + res.stderr  # the one global epoch line instead
    res = run_forked(2, *args, "--training.epochs", "1", "--job.dump_folder", str(two))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert [(r["step"], r["epoch"]) for r in metric_records(two)] == [(1, 0), (2, 0), (3, 1)]
    assert "training.epochs = 1 reached: the run stops" in res.stdout and (two / "checkpoint" / "step-3").is_dir()
    res = run_forked(2, *args, "--training.epochs", "2", "--job.dump_folder", str(two))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert f"resumed from {two / 'checkpoint'} at step 3" in res.stdout, res.stdout[-2000:]
    resumed = metric_records(two)
    assert [(r["step"], r["epoch"]) for r in resumed] == [(s, s * 8 // 24) for s in range(1, 7)]
    assert resumed[-1]["targets"] == rows[-1]["targets"] > 0
    res = run_forked(2, *args, "--training.epochs", "2", "--job.dump_folder", str(two))
    assert res.returncode == 0 and "nothing to train: the data has been read training.epochs = 2 times" in res.stdout
    assert len(metric_records(two)) == 6
