"""train.py on a model sized by a Hugging Face folder, no flavor of ours (``model.flavor = 'hf'``,
issue 40), end to end (fp32, CPU, one process).

A random ``LlamaForCausalLM`` of a size no preset has (hidden 64, 2 layers, FFN 96, rms_norm_eps
1e-6, RoPE theta 1e4 without scaling) is saved with ``save_pretrained``; the run takes every
size from its config.json and starts from its weights (``initial_load_in_hf``):

* its step-1 loss is transformers' loss on the same batch (rtol 1e-5): the sizes, the eps and
  the weights all came through;
* its Hugging Face export (``last_save_in_hf``) writes the same sizes back (config.json);
* bad input: ``model.flavor = 'hf'`` with no folder to size it, a folder of an unsupported
  architecture, and a config.json whose ``rope_scaling`` is the string ``"linear"``: one
  ``error:`` line, exit 2, no traceback.
"""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
import torch.nn.functional as F

from tests.hf_models import hf_model

from .helpers import FAST, read_metrics, run_forked

RTOL = 1e-5
LLAMA = ["--config", "llama3.toml", *FAST]
HF = ["--model.flavor", "hf", "--checkpoint.initial_load_in_hf", "true", "--checkpoint.initial_load_path"]


def _hf_llama():
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=2048, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=256,
    )  # fmt: skip
    return hf_model(config)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf") / "tiny-llama"
    _hf_llama().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def hf_run(hf_dir, tmp_path_factory):
    run = tmp_path_factory.mktemp("runs") / "hf_sized"
    res = run_forked(
        1, *LLAMA, "--training.steps", "2", "--job.dump_folder", str(run), *HF, str(hf_dir),
        "--checkpoint.last_save_in_hf", "true",
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert "training llama3/hf" in res.stdout and "loaded initial weights from Hugging Face folder" in res.stdout
    return run


def test_step1_loss_equals_transformers(hf_dir, hf_run):
    from trainer.config import load_config
    from trainer.data.loader import build_dataloader
    from trainer.data.tokenizer import load_tokenizer

    cfg = load_config([*LLAMA, "--training.steps", "2", *HF, str(hf_dir)])
    micro = build_dataloader(cfg, load_tokenizer(cfg.model.tokenizer_path), batch_rank=0, batch_degree=1).next_step()
    inputs, labels = torch.cat([x for x, _ in micro]), torch.cat([y for _, y in micro])
    with torch.no_grad():
        logits = _hf_llama()(input_ids=inputs, use_cache=False).logits
    expected = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()).item()
    got = read_metrics(hf_run)[1]["loss"]
    assert abs(got - expected) <= RTOL * abs(expected), (got, expected)


def test_export_has_the_folder_sizes(hf_dir, hf_run):
    ours = json.loads((hf_run / "checkpoint" / "step-2-hf" / "config.json").read_text())
    theirs = json.loads((hf_dir / "config.json").read_text())
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "rms_norm_eps", "vocab_size"):  # fmt: skip
        assert ours[key] == theirs[key], key


def _train(*args: str) -> subprocess.CompletedProcess:
    """train.py on LLAMA + args in one forked process (the bad-input cases: their claim is the
    line and the exit code, which a forked rank gives through the same exit path,
    trainer/lifecycle/shutdown.py; a fresh ``python train.py`` stopping on bad input is
    tests/e2e/test_exit.py's; issue 49)."""
    return run_forked(1, *LLAMA, *args, timeout=300)


def _one_clean_line(res, *needles) -> None:
    assert res.returncode == 2, f"exit {res.returncode}\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    errors = [line for line in res.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, res.stderr[-3000:]
    for needle in needles:
        assert needle in errors[0], errors[0]


def test_bad_input_is_one_line(hf_dir, tmp_path):
    res = _train("--model.flavor", "hf", "--job.dump_folder", str(tmp_path / "a"))
    _one_clean_line(res, "model.flavor = 'hf'", "model.hf_config")
    other = tmp_path / "mistral"
    other.mkdir()
    config = json.loads((hf_dir / "config.json").read_text())
    (other / "config.json").write_text(
        json.dumps({**config, "architectures": ["MistralForCausalLM"], "model_type": "mistral"})
    )
    res = _train("--model.flavor", "hf", "--model.hf_config", str(other), "--job.dump_folder", str(tmp_path / "b"))
    _one_clean_line(res, "MistralForCausalLM", "LlamaForCausalLM (model 'llama3')")
    # a rope_scaling that is not a rope setting (a string) is refused, not trained as plain RoPE
    linear = tmp_path / "linear"
    linear.mkdir()
    (linear / "config.json").write_text(json.dumps({**config, "rope_scaling": "linear"}))
    res = _train("--model.flavor", "hf", "--model.hf_config", str(linear), "--job.dump_folder", str(tmp_path / "c"))
    _one_clean_line(res, "rope_scaling='linear' in config.json", "rope_type")
