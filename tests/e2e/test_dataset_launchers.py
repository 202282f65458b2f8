"""A user's fine-tuning start, as typed, under each launcher (issue 50, items 1 and 7): a small
Hugging Face Qwen3 folder (weights, config.json, tokenizer with its chat template) and chat
data, started with one option (``--model.hf_path``) from the Llama debug config, with no
masking flag (packed chat picks block-causal masking):

* ``python train.py --nproc_per_node 2 ... --training.dataset chat --training.dataset_path
  X.parquet``, the form docs/fine_tuning.md shows, which the launcher's pre-start check used
  to refuse (``FileSource kind must be 'text' or 'jsonl', got 'chat'``);
* torchrun with a mixture (chat .jsonl + pre-training .jsonl);
* one process (``python train.py``) with the same parquet file;
* a bad row that only rank 1 reads (striped): rank 1's one line is what the user sees, rank 0
  (whose collective then fails on the gone peer) ends quietly (issue 50, item 10a).

Each run trains one step and says what it trains (qwen3 sized by the folder, its weights,
block-causal masking). Every kind x every launcher's start-up, in-process:
tests/unit/test_startup_kinds.py; the config resolution: tests/unit/test_config_defaults.py.
Shapes: 2 layers, hidden 48, seq_len 32, global batch 4, one step.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.chat_data import conversations, tokenizer_folder, write_jsonl, write_parquet

from .helpers import ROOT, _env, run_train

QWEN3 = dict(
    vocab_size=2064, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=True,
)  # fmt: skip
SMALL = ["--config", "llama3.toml", "--training.seq_len", "32", "--training.global_batch_size", "4",
         "--training.local_batch_size", "2", "--training.steps", "1", "--metrics.log_freq", "1",
         "--metrics.enable_tensorboard", "false"]  # fmt: skip


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    d = tmp_path_factory.mktemp("user")
    folder = d / "qwen3-tiny"
    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(**QWEN3)).save_pretrained(folder)
    tokenizer_folder(folder, "qwen3")  # tokenizer.json + tokenizer_config.json with the chat template
    write_parquet(d / "chat.parquet", {"messages": conversations(16)})
    bad = conversations(16)
    bad[12] = [{"role": "wizard", "content": "x"}, {"role": "assistant", "content": "y"}]  # rank 1's stripe 3
    write_parquet(d / "bad_row.parquet", {"messages": bad})
    write_jsonl(d / "chat.jsonl", conversations(16, seed=1))
    with open(d / "web.jsonl", "w") as f:
        for i in range(16):
            f.write(json.dumps({"text": f"document {i} alpha beta gamma delta echo"}) + "\n")
    return d


def _check(res: subprocess.CompletedProcess) -> str:
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    assert "training qwen3/hf" in out and "loaded initial weights from Hugging Face folder" in out, out[-3000:]
    assert "attn_mask_type=block_causal" in out, out[-3000:]
    assert "step 1/1" in out and "error" not in out.lower() and "Traceback" not in out, out[-3000:]
    return out


def test_chat_parquet_from_a_hugging_face_folder_under_the_launcher(files, tmp_path):
    cmd = [sys.executable, "train.py", "--nproc_per_node", "2", *SMALL, "--model.hf_path", str(files / "qwen3-tiny"),
           "--training.dataset", "chat", "--training.dataset_path", str(files / "chat.parquet"),
           "--job.dump_folder", str(tmp_path / "run")]  # fmt: skip
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=_env())
    _check(res)


def test_a_chat_mixture_under_torchrun(files, tmp_path):
    mixture = f"chat:0.5:{files / 'chat.jsonl'},jsonl:0.5:{files / 'web.jsonl'}"
    res = run_train(2, *SMALL, "--model.hf_path", str(files / "qwen3-tiny"), "--training.sources", mixture,
                    "--job.dump_folder", str(tmp_path / "run"), timeout=300)  # fmt: skip
    _check(res)


def test_chat_parquet_in_one_process(files, tmp_path):
    res = run_train(1, *SMALL, "--model.hf_path", str(files / "qwen3-tiny"), "--training.dataset", "chat",
                    "--training.dataset_path", str(files / "chat.parquet"), "--job.dump_folder", str(tmp_path / "run"),
                    timeout=300)  # fmt: skip
    _check(res)


def test_a_bad_row_only_one_rank_reads_is_that_ranks_line(files, tmp_path):
    """Striped reading (16 rows, 4 stripes): row 12 opens stripe 3, which only rank 1 of 2
    reads. Rank 1 stops on it (one line, after rank 0's grace: trainer/runtime/console.py); rank 0,
    waiting in the step's all-reduce, then fails on gloo's "Connection closed by peer" and ends
    quietly (exit code 4, no traceback), and the launcher ends with rank 1's exit code 2."""
    cmd = [sys.executable, "train.py", "--nproc_per_node", "2", *SMALL, "--training.dataset", "chat",
           "--training.dataset_path", str(files / "bad_row.parquet"), "--job.dump_folder", str(tmp_path / "run")]  # fmt: skip
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=_env())
    out = res.stdout + res.stderr
    assert res.returncode == 2, out[-3000:]
    errors = [line for line in out.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("error: rank 1: "), out[-3000:]
    assert "(row 12)" in errors[0] and "wizard" in errors[0], out[-3000:]
    assert "Traceback" not in out and "Connection closed" not in out and out.rstrip().endswith(errors[0]), out[-3000:]
