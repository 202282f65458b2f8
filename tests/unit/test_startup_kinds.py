"""Every dataset kind is accepted the same way by every launcher (issue 50, item 1).

``python train.py --nproc_per_node N`` checks a job before any worker starts
(trainer/lifecycle/launch.py -> :func:`trainer.startup.preflight`); a worker (one process, torchrun, the
launcher's) starts with :func:`trainer.startup.plan_startup` and builds its loader with
:func:`trainer.data.loader.build_dataloader`. The pre-start check once built the data source
without the chat branch (``FileSource kind must be 'text' or 'jsonl', got 'chat'``) and never
looked at a mixture. Here, in this process, for each kind (text, jsonl, tokens, hf, chat and preference from
.jsonl and parquet, a mixture of all but preference, and ``auto`` striped parquet reading), x each world size
of the matrix (1 process; 2 and 4 ranks):

* the launcher's pre-start check accepts it;
* every batch rank's worker start accepts it and reads its first step's micro-batches;
* a missing data file is the same one line from the pre-start check as from the worker's start.

Real launches, one per launcher, are in tests/e2e/test_dataset_launchers.py. Shapes: the debug
Llama, seq_len 32, global batch 8 (no model is built: the checks stop before weights).
"""

from __future__ import annotations

import json

import pytest

from tests.chat_data import conversations, write_jsonl, write_parquet
from tests.preference_data import preference_rows, write_parquet_rows
from tests.preference_data import write_jsonl as write_pairs
from trainer.config import load_config
from trainer.data.loader import build_dataloader
from trainer.lifecycle.launch import main as launch_main
from trainer.startup import plan_startup, preflight

BASE = ["--config", "llama3.toml", "--training.seq_len", "32", "--training.global_batch_size", "8",
        "--training.local_batch_size", "2"]  # fmt: skip
WORLDS = (1, 2, 4)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """One file (or folder) per kind, each with more rows than the global batch has samples."""
    from tools.tokenize.writer import tokenize_to_shards

    folder = tmp_path_factory.mktemp("kinds")
    texts = [f"document {i}: " + " ".join(["alpha beta gamma delta"] * (1 + i % 5)) for i in range(40)]
    (folder / "corpus.txt").write_text("\n\n".join(texts))
    with open(folder / "corpus.jsonl", "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    write_parquet(folder / "web.parquet", {"text": texts})
    convs = conversations(40)
    write_jsonl(folder / "chat.jsonl", convs)
    write_parquet(folder / "chat.parquet", {"messages": convs})
    pairs = preference_rows(40, form="strings")
    write_pairs(folder / "pairs.jsonl", pairs)
    write_parquet_rows(folder / "pairs.parquet", pairs)
    tokenize_to_shards(["synthetic:42:60"], str(folder / "tokens"), shard_tokens=1000, workers=1, log=None)
    return folder


def _kinds(d) -> dict[str, list[str]]:
    one = lambda kind, path: ["--training.dataset", kind, "--training.dataset_path", str(d / path)]  # noqa: E731
    mixture = f"chat:0.4:{d / 'chat.parquet'},hf:0.2:{d / 'web.parquet'},jsonl:0.2:{d / 'corpus.jsonl'},"
    mixture += f"text:0.1:{d / 'corpus.txt'},tokens:0.1:{d / 'tokens'}"
    return {
        "text": one("text", "corpus.txt"),
        "jsonl": one("jsonl", "corpus.jsonl"),
        "tokens": one("tokens", "tokens"),
        "hf": one("hf", "web.parquet"),
        "hf_sequential": [*one("hf", "web.parquet"), "--training.row_reading", "sequential"],
        "chat_jsonl": one("chat", "chat.jsonl"),
        "chat_parquet": one("chat", "chat.parquet"),
        "preference_jsonl": one("preference", "pairs.jsonl"),
        "preference_parquet": one("preference", "pairs.parquet"),
        "mixture": ["--training.sources", mixture],
    }


KINDS = ("text", "jsonl", "tokens", "hf", "hf_sequential", "chat_jsonl", "chat_parquet", "preference_jsonl")
KINDS += ("preference_parquet", "mixture")


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_passes_the_launchers_check_and_every_ranks_start(data, kind):
    cfg = load_config([*BASE, *_kinds(data)[kind]])
    for world in WORLDS:
        preflight(cfg, world, "cpu")  # python train.py --nproc_per_node world (trainer/lifecycle/launch.py)
        startup = plan_startup(cfg, world, "cpu")  # every worker: one process, torchrun, the launcher's
        batch = startup.plan.batch
        for rank in range(batch.batch_degree):
            loader = build_dataloader(cfg, startup.tokenizer, batch_rank=rank, batch=batch, log_epochs=False)
            micro = loader.next_step()
            assert sum(x.shape[0] for x, _ in micro) == batch.global_batch_size // batch.batch_degree
            assert all(x.shape[1] == 32 for x, _ in micro)


def _missing(d, kind: str) -> list[str]:
    """The kind's arguments with its (first) path replaced by one that does not exist."""
    args = list(_kinds(d)[kind])
    if kind == "mixture":
        args[1] = args[1].replace(str(d / "chat.parquet"), str(d / "gone.parquet"))
    else:
        args[args.index("--training.dataset_path") + 1] = str(d / "gone")
    return args


@pytest.mark.parametrize("kind", KINDS)
def test_a_missing_path_is_the_same_line_before_and_after_the_workers_start(data, kind):
    cfg = load_config([*BASE, *_missing(data, kind)])
    with pytest.raises(ValueError) as before:
        preflight(cfg, 2, "cpu")
    with pytest.raises(ValueError) as worker:
        startup = plan_startup(cfg, 2, "cpu")
        build_dataloader(cfg, startup.tokenizer, batch_rank=1, batch=startup.plan.batch, log_epochs=False)
    assert str(before.value) == str(worker.value)
    assert "gone" in str(before.value) and "\n" not in str(before.value)


def test_the_launcher_refuses_a_missing_chat_file_in_one_line_and_starts_no_worker(data, capsys):
    """The form docs/fine_tuning.md shows, through the launcher's entry (what `python train.py`
    runs first): one `error:` line naming the option, exit code 2, nothing else printed."""
    code = launch_main(["--nproc_per_node", "2", *BASE, *_missing(data, "chat_parquet")])
    out = capsys.readouterr()
    assert code == 2
    assert out.out == "" and out.err.count("\n") == 1 and out.err.startswith("error: ")
    assert "training.dataset_path" in out.err and "gone" in out.err
