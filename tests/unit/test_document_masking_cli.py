"""Bad block-causal attention settings through train.py's ``main(argv)`` in process (issue 26):
an unknown ``model.attn_type``, ``flex`` and ``varlen`` on CPU, ``document_positions`` without
``block_causal``, ``block_causal`` with a tokenizer that has no EOS token. Each ends with exit
code 2, one ``error:`` line on stderr and no traceback (trainer/runtime/cli_errors.py). ``varlen`` with
cp = 2 is checked through ``trainer.plan.plan_job`` (no launch needed), as is the plan's own EOS
refusal, which the shipped tokenizer loaders never reach."""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist

from trainer.config import ConfigError, load_config
from trainer.plan import plan_job

# small and fast if a check ever let the run through (it would then fail on the exit code)
FAST = [
    "--model.name", "llama3", "--model.flavor", "debugmodel", "--model.n_layers", "1",
    "--training.seq_len", "32", "--training.global_batch_size", "2", "--training.local_batch_size", "2",
    "--training.steps", "1", "--checkpoint.enable", "false", "--metrics.enable_tensorboard", "false",
    "--parallelism.data_parallel_shard_degree", "1",
]  # fmt: skip


@pytest.fixture(autouse=True)
def _clean_world(monkeypatch):
    # main() makes a one-process gloo group and sets these for it; undo both afterwards
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _main_error(capsys, tmp_path, *argv: str) -> str:
    from trainer.lifecycle.rank import run_rank as main

    rc = main([*FAST, "--job.dump_folder", str(tmp_path / "run"), *argv])
    err = capsys.readouterr().err
    assert rc == 2, f"exit {rc}\n{err[-3000:]}"
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err[-3000:]
    return lines[0]


def test_unknown_attn_type(capsys, tmp_path):
    line = _main_error(capsys, tmp_path, "--model.attn_type", "bogus")
    assert "model.attn_type" in line and "bogus" in line and "sdpa" in line, line


@pytest.mark.parametrize("kernel", ["flex", "varlen"])
def test_cuda_kernels_refused_on_cpu(capsys, tmp_path, kernel):
    line = _main_error(capsys, tmp_path, "--model.attn_mask_type", "block_causal", "--model.attn_type", kernel)
    assert f"model.attn_type='{kernel}'" in line and "CUDA" in line and "'sdpa'" in line, line


def test_document_positions_needs_block_causal(capsys, tmp_path):
    line = _main_error(capsys, tmp_path, "--model.document_positions", "true")
    assert "document_positions" in line and "block_causal" in line, line


def _tokenizer_without_eos(folder) -> str:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tok = Tokenizer(WordLevel({"<|bos|>": 0, "a": 1, "b": 2, "[UNK]": 3}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    folder.mkdir()
    path = folder / "tokenizer.json"
    tok.save(str(path))
    assert "<|eos|>" not in json.loads(path.read_text())["model"]["vocab"]
    return str(path)


def test_block_causal_with_a_tokenizer_without_eos(capsys, tmp_path):
    """The Hugging Face tokenizer loader already refuses a tokenizer without EOS (every
    tokenizer the trainer loads has one), with its own one line."""
    path = _tokenizer_without_eos(tmp_path / "tok")
    line = _main_error(capsys, tmp_path, "--model.attn_mask_type", "block_causal", "--model.tokenizer_path", path)
    assert path in line and "no eos token" in line and "tokenizer_config.json" in line, line


def _cfg(tmp_path, *argv: str):
    return load_config([*FAST, "--job.dump_folder", str(tmp_path / "run"), *argv])


def test_plan_refuses_block_causal_without_eos(tmp_path):
    """The plan's own check, for a tokenizer object without an EOS id (tokenizer_eos None)."""
    cfg = _cfg(tmp_path, "--model.attn_mask_type", "block_causal")
    with pytest.raises(ConfigError) as info:
        plan_job(cfg, 1, 2048, tokenizer_eos=None)
    assert "EOS" in str(info.value) and "block_causal" in str(info.value) and "\n" not in str(info.value)
    # control: with the EOS id it plans, and the model args carry it
    assert plan_job(cfg, 1, 2048, tokenizer_eos=1).model.args.eos_id == 1


def test_plan_refuses_varlen_with_context_parallelism(tmp_path):
    cp2 = ("--model.attn_mask_type", "block_causal", "--parallelism.context_parallel_degree", "2")
    cfg = _cfg(tmp_path, *cp2, "--model.attn_type", "varlen")
    with pytest.raises(ConfigError) as info:
        plan_job(cfg, 2, 2048, tokenizer_eos=1, device_type=None)
    message = str(info.value)
    assert "varlen" in message and "cp=2" in message and "\n" not in message, message
    # controls: sdpa with cp = 2, and varlen without cp (device unchecked), plan
    plan_job(_cfg(tmp_path, *cp2), 2, 2048, tokenizer_eos=1, device_type=None)
    varlen = _cfg(tmp_path, "--model.attn_mask_type", "block_causal", "--model.attn_type", "varlen")
    assert plan_job(varlen, 1, 2048, tokenizer_eos=1, device_type=None).model.args.attn_type == "varlen"
