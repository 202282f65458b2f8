"""What an export holds besides the weights (trainer/checkpoint/hf_extras.py), without a run:
config.json fields carried from the source folder unless the run changed them, the tokenizer
files and chat template (the shipped tokenizer's built-in one as transformers renders it), the
generation ids, PEFT's ``target_modules`` list and portable base name; and a config.json whose
``rope_scaling`` is not a rope setting refused in one line (issue 50, items 2 and 10h)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from models.registry import get_hf_adapter, get_model_spec
from trainer.checkpoint.hf_extras import ModelRecord, carry_config, peft_base_name, tokenizer_ids, write_extras
from trainer.checkpoint.lora_export import hf_weight_modules, target_modules

pytestmark = pytest.mark.unit

# a Qwen3 chat model's config.json as transformers 5 writes it (the fields we do not write, and
# ids / windows / context length that differ from what our adapter writes)
QWEN3_SOURCE = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 2053,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
    "max_position_embeddings": 512,
    "max_window_layers": 28,
    "sliding_window": None,
    "use_sliding_window": False,
    "layer_types": ["full_attention", "full_attention"],
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "tie_word_embeddings": False,
    "transformers_version": "5.0.0",
    "dtype": "bfloat16",
}


def _record(source: dict, **arg_changes) -> tuple[ModelRecord, dict]:
    args = dataclasses.replace(get_model_spec("qwen3", "hf", source).args, **arg_changes)
    ours = get_hf_adapter("qwen3", args).hf_config("float32")
    rec = ModelRecord(model="qwen3", args=dataclasses.asdict(args), flavor="hf", source_config=source, seq_len=64)
    return rec, ours


def test_config_carries_the_source_fields_the_run_did_not_change():
    rec, ours = _record(QWEN3_SOURCE)
    # what the adapter alone writes: the guessed context, windows and no ids (the old export)
    assert ours["max_position_embeddings"] == 40960 and ours["max_window_layers"] == 2 and "eos_token_id" not in ours
    out = carry_config(ours, rec)
    for key in ("max_position_embeddings", "max_window_layers", "eos_token_id", "bos_token_id", "layer_types"):
        assert out[key] == QWEN3_SOURCE[key], key
    assert out["rope_parameters"] == QWEN3_SOURCE["rope_parameters"] and "rope_theta" not in out
    assert out["torch_dtype"] == "float32" and "dtype" not in out and "transformers_version" not in out
    # a longer training sequence than the source's context raises it
    assert carry_config(ours, dataclasses.replace(rec, seq_len=1024))["max_position_embeddings"] == 1024


def test_config_keeps_what_the_run_changed():
    rec, ours = _record(QWEN3_SOURCE, n_layers=1, rope_theta=10000.0)
    out = carry_config(ours, rec)
    assert out["num_hidden_layers"] == 1 and out["max_window_layers"] == 1  # the run's depth
    assert "layer_types" not in out  # one entry per source layer: no longer true
    assert out["rope_theta"] == 10000.0 and "rope_parameters" not in out  # the run's rope
    assert out["eos_token_id"] == 151645  # unchanged by the run: the source's


def test_ids_from_the_tokenizer_only_where_the_source_sets_none():
    rec, ours = _record({**QWEN3_SOURCE, "pad_token_id": None})
    out = carry_config(ours, rec, {"eos_token_id": 7, "pad_token_id": 3})
    assert out["eos_token_id"] == 151645 and out["pad_token_id"] == 3
    assert carry_config(ours, None, {"eos_token_id": [7, 2]})["eos_token_id"] == [7, 2]


def test_shipped_tokenizer_export_renders_the_builtin_template_as_transformers(tmp_path):
    """The shipped tokenizer has no tokenizer_config.json: the export writes one with the
    built-in template, and transformers' apply_chat_template gives our rendering's ids; the
    generation eos is the token ending an assistant turn (<|eos|>)."""
    transformers = pytest.importorskip("transformers")
    from trainer.data.chat_template import load_chat_template
    from trainer.data.tokenizer import DEFAULT_TOKENIZER_PATH, load_tokenizer

    rec = ModelRecord(model="llama3", args={}, tokenizer="")
    ids = tokenizer_ids("")
    config = carry_config({"vocab_size": 2048}, rec, ids)
    names = write_extras(str(tmp_path), rec, config, ids)
    assert sorted(names) == ["generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    ours = load_tokenizer("")
    assert json.loads((tmp_path / "generation_config.json").read_text())["eos_token_id"] == ours.eos_id
    assert config["bos_token_id"] == ours.bos_id and config["pad_token_id"] == ours.pad_id
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "What is 3 plus 4?"}]
    theirs = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    template = load_chat_template(ours, DEFAULT_TOKENIZER_PATH)
    mine, _ = ours.encode_chat(template.render(msgs, add_generation_prompt=True))
    assert theirs == mine and ours.bos_id == mine[0] and len(mine) > 10
    # negative control: the shipped folder alone (no tokenizer_config.json) has no template
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_bytes(open(DEFAULT_TOKENIZER_PATH, "rb").read())
    with pytest.raises(ValueError):
        transformers.AutoTokenizer.from_pretrained(str(bare)).apply_chat_template(msgs, tokenize=False)


def test_peft_target_modules_is_a_name_list_where_peft_can_say_it():
    args = get_model_spec("llama3", "debugmodel").args
    every = hf_weight_modules(get_hf_adapter("llama3", dataclasses.replace(args, n_layers=2)))
    projections = [m for m in every if m.endswith("_proj")]
    assert len(projections) == 14
    assert target_modules(projections, every) == [
        "down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj",
    ]  # fmt: skip
    # one layer only: a list of names would adapt the other layer too, so the exact expression
    layer0 = [m for m in projections if ".layers.0." in m]
    pattern = target_modules(layer0, every)
    assert isinstance(pattern, str) and pattern.startswith("^(") and "layers\\.1" not in pattern


def test_peft_base_name_is_portable():
    rec = ModelRecord(model="qwen3", args={}, source_config={"_name_or_path": "Qwen/Qwen3-0.6B"})
    assert peft_base_name(rec, "/data/models/qwen3-copy") == "Qwen/Qwen3-0.6B"
    rec = ModelRecord(model="qwen3", args={}, source_config={"_name_or_path": "/home/me/models/x"})
    assert peft_base_name(rec, "/data/models/Qwen3-0.6B/") == "Qwen3-0.6B"
    assert peft_base_name(None, "") is None  # the seeded init has no folder


@pytest.mark.parametrize("model", ["llama3", "qwen3"])
@pytest.mark.parametrize("field", ["rope_scaling", "rope_parameters"])
def test_rope_setting_that_is_not_an_object_is_refused(model, field):
    config = get_hf_adapter(model, get_model_spec(model, "debugmodel").args).hf_config("float32")
    config.pop("rope_scaling", None)
    config[field] = "linear"
    for check in (
        lambda: get_model_spec(model, "hf", config),
        lambda: get_hf_adapter(model, get_model_spec(model, "debugmodel").args).check_hf_config(config),
    ):
        with pytest.raises(ValueError) as exc:
            check()
        msg = str(exc.value)
        assert "\n" not in msg and f"{field}='linear' in config.json" in msg and "rope_type" in msg, msg


def test_rope_scaling_beside_default_rope_parameters_is_not_dropped():
    from models.common.hf_config import rope_config

    theta, scaling = rope_config(
        {
            "rope_parameters": {"rope_theta": 1e4, "rope_type": "default"},
            "rope_scaling": {"type": "linear", "factor": 2},
        }
    )
    assert theta == 1e4 and scaling == {"rope_type": "linear", "factor": 2}
    config = get_hf_adapter("qwen3", get_model_spec("qwen3", "debugmodel").args).hf_config("float32")
    config["rope_scaling"] = {"type": "linear", "factor": 2.0}
    config["rope_parameters"] = {"rope_theta": config["rope_theta"], "rope_type": "default"}
    with pytest.raises(ValueError, match="rope_scaling"):
        get_model_spec("qwen3", "hf", config)
