"""Defaults that work together (issue 50, item 7), as the config resolves them
(trainer/config/derived.py, trainer/config/loader.py):

* packed chat data picks block-causal masking (``model.attn_mask_type = 'auto'``, the
  default); an explicit ``causal`` is still refused with the fix;
* ``model.hf_path FOLDER`` alone starts from a Hugging Face folder: the family from its
  config.json's architecture (whatever the TOML's ``model.name``), every size, the weights and
  the tokenizer; conflicting keys and unusable folders are one line naming the option;
* ``fsdp`` is ``dp_shard``'s alias (CLI and TOML, written back in full), and every unknown key
  suggests the nearest key or alias.

The end-to-end run from such a folder, under the launcher: tests/e2e/test_dataset_launchers.py.
"""

from __future__ import annotations

import json

import pytest

from tests.chat_data import tokenizer_folder
from trainer.config import ConfigError, format_help, load_config
from trainer.config.derived import attn_mask_type
from trainer.plan import model_overrides

QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 2064, "hidden_size": 48,
    "intermediate_size": 80, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "tie_word_embeddings": True, "hidden_act": "silu", "attention_bias": False,
}  # fmt: skip


def _chat(*extra):
    return load_config(
        ["--config", "llama3.toml", "--training.dataset", "chat", "--training.dataset_path", "x", *extra]
    )


def test_packed_chat_picks_block_causal_masking_by_default():
    cfg = _chat()
    assert cfg.model.attn_mask_type == "auto" and attn_mask_type(cfg) == "block_causal"
    assert model_overrides(cfg, 2048, tokenizer_eos=1)["attn_mask_type"] == "block_causal"  # the model gets it
    mixture = load_config(["--config", "llama3.toml", "--training.sources", "chat:0.5:x,synthetic:0.5:"])
    assert attn_mask_type(mixture) == "block_causal"
    # one conversation per window, or no chat at all: causal, as before
    assert attn_mask_type(_chat("--training.chat_packing", "padded")) == "causal"
    assert attn_mask_type(load_config(["--config", "llama3.toml"])) == "causal"
    assert attn_mask_type(_chat("--model.attn_mask_type", "block_causal")) == "block_causal"
    with pytest.raises(ConfigError, match=r"set model.attn_mask_type = 'block_causal' or 'auto'"):
        _chat("--model.attn_mask_type", "causal")


@pytest.fixture
def qwen_folder(tmp_path):
    folder = tmp_path / "qwen3-tiny"
    tokenizer_folder(folder, "qwen3")
    (folder / "config.json").write_text(json.dumps(QWEN3))
    return folder


def test_one_option_starts_from_a_hugging_face_folder(qwen_folder):
    from trainer.model_spec import config_model_spec

    cfg = load_config(["--config", "llama3.toml", "--model.hf_path", str(qwen_folder)])  # a Llama config
    m, c = cfg.model, cfg.checkpoint
    assert (m.name, m.flavor, m.tokenizer_path) == ("qwen3", "hf", str(qwen_folder))
    assert (c.initial_load_path, c.initial_load_in_hf) == (str(qwen_folder), True)
    args = config_model_spec(cfg).args
    assert (args.dim, args.n_layers, args.n_heads, args.vocab_size) == (48, 2, 4, 2064)
    # the resolved config reads back to the same config (config.toml of the run folder)
    again = load_config(["--config", "llama3.toml", "--model.hf_path", str(qwen_folder),
                         "--checkpoint.initial_load_path", str(qwen_folder)])  # fmt: skip
    assert again == cfg
    # a tokenizer of the user's own choice is kept
    mine = load_config(
        ["--config", "llama3.toml", "--model.hf_path", str(qwen_folder), "--model.tokenizer_path", "bytes"]
    )
    assert mine.model.tokenizer_path == "bytes"


@pytest.mark.parametrize(
    "case, message",
    [
        ("not_a_folder", "model.hf_path: {f}/nope is not a folder"),
        ("no_config", "model.hf_path: {f} holds no config.json"),
        ("bad_json", "model.hf_path: {f}/config.json cannot be read as JSON"),
        ("architecture", "model.hf_path: {f}/config.json: "),
        ("other_start", "model.hf_path starts from {f}, and checkpoint.initial_load_path names another"),
        ("no_tokenizer", "model.hf_path: {f} holds no tokenizer (tokenizer.json, tokenizer.model"),
    ],
)
def test_an_unusable_folder_or_a_conflict_is_one_line(qwen_folder, tmp_path, case, message):
    folder, extra = qwen_folder, []
    if case == "not_a_folder":
        folder = qwen_folder / "nope"
    elif case == "no_config":
        (qwen_folder / "config.json").unlink()
    elif case == "bad_json":
        (qwen_folder / "config.json").write_text('{"architectures": ["Qwen3')
    elif case == "architecture":
        (qwen_folder / "config.json").write_text(json.dumps({**QWEN3, "architectures": ["GPT2LMHeadModel"]}))
    elif case == "other_start":
        extra = ["--checkpoint.initial_load_path", str(tmp_path / "elsewhere")]
    elif case == "no_tokenizer":
        (qwen_folder / "tokenizer.json").unlink()
    with pytest.raises(ConfigError) as exc:
        load_config(["--config", "llama3.toml", "--model.hf_path", str(folder), *extra])
    assert message.format(f=qwen_folder) in str(exc.value) and "\n" not in str(exc.value)


def test_fsdp_is_dp_shards_alias(tmp_path):
    cfg = load_config(["--config", "llama3.toml", "--parallelism.fsdp", "2"])
    assert cfg.parallelism.data_parallel_shard_degree == 2
    toml = tmp_path / "fsdp.toml"
    toml.write_text("[parallelism]\nfsdp = 2\ntp = 2\n")
    cfg = load_config(["--config", str(toml)])
    assert (cfg.parallelism.data_parallel_shard_degree, cfg.parallelism.tensor_parallel_degree) == (2, 2)
    assert "\ndata_parallel_shard_degree = 2\n" in cfg.to_toml() and "\nfsdp =" not in cfg.to_toml()
    assert "--parallelism.fsdp -> data_parallel_shard_degree" in format_help()


@pytest.mark.parametrize(
    "argv, hint",
    [
        (["--parallelism.fsdp_degree", "2"], "did you mean 'parallelism.fsdp'?"),
        (["--parallelism.dp_shard_degree", "2"], "did you mean 'parallelism.data_parallel_shard_degree'?"),
        (["--parallelism.fdsp", "2"], "did you mean 'parallelism.fsdp'?"),
        (["--fsdp", "2"], "did you mean '--parallelism.fsdp'?"),
        (["--model.hfpath", "x"], "did you mean 'model.hf_path'?"),
        (["--trainig.steps", "1"], "did you mean 'training.steps'?"),
        # nothing close: the nearest anyway, and the legal names
        (["--parallelism.zzz", "2"], "did you mean 'parallelism."),
        (["--zzz.steps", "2"], "did you mean 'training.steps'?"),
        (["--optimizer.param_groups", "[{patern = 'x'}]"], "did you mean 'pattern'?"),
    ],
)
def test_every_unknown_key_suggests_the_nearest_key_or_alias(argv, hint):
    with pytest.raises(ConfigError) as exc:
        load_config(["--config", "llama3.toml", *argv])
    assert hint in str(exc.value) and "\n" not in str(exc.value), str(exc.value)


def test_an_unknown_key_of_a_mixture_source_suggests_the_nearest(tmp_path):
    toml = tmp_path / "mix.toml"
    toml.write_text("[[training.sources]]\nkind = 'chat'\npath = 'x'\nweight = 1\nwieght = 2\n")
    with pytest.raises(ConfigError, match=r"unknown key\(s\) wieght; did you mean 'weight'\?"):
        load_config(["--config", str(toml)])
