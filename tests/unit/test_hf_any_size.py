"""Any size of a supported architecture from its ``config.json``, no flavor of ours (issue 40):
``HFStateDictAdapter.args_from_hf_config`` / ``get_model_spec(name, "hf", config)`` /
``scripts/convert_hf.py`` without ``--flavor``.

* published config.json files, whole (tests/hf_published.py: Llama 3.2 1B, Qwen3 0.6B, Qwen3
  30B-A3B, DeepSeek-V3): they size the model exactly as our preset of the same name (same
  exported config.json), build on the meta device with the published parameter count, and
  DeepSeek-V3's FP8 ``quantization_config`` is refused by name until removed;
* sizes no preset has: transformers' default ``LlamaConfig()`` (rms_norm_eps 1e-6, 32000
  vocabulary, Llama 2 7B shapes) and a TinyLlama-sized model build with transformers' own
  parameter count;
* tiny custom sizes of each family (Llama, a tied Qwen3 with head_dim != hidden / heads,
  Qwen3-MoE without top-k renormalisation, DeepSeek-V3 with a q LoRA and grouped routing),
  written by ``save_pretrained`` and sized from that config.json alone: our logits equal
  transformers' in fp32 within rtol/atol 1e-5 (the two differ in summation order: SDPA vs eager
  attention, our sorted-expert combine vs a per-expert loop), the negative control (the same
  model with the norm eps config.json does not say, x10) fails that tolerance, and HF -> ours ->
  HF is bitwise with our exported config.json sizing the same args again (measured: max
  |ours - theirs| 3.9e-7 .. 8.3e-7 on logits of magnitude ~1; the control 1.3e-3 .. 3.9e-3);
  the converter takes each folder with neither ``--model`` nor ``--flavor`` and back
  (``--hf-config``) bit for bit;
* bad input through the converter: an unmodeled field, an unsupported architecture, a flavor
  contradicting config.json: one ``error:`` line naming it, exit code 2, nothing written.

About 10 s in all (the meta builds of the big configs allocate nothing).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from models.common.hf_adapter import HFConfigMismatch  # noqa: E402
from models.registry import build_model, flavor_names, get_hf_adapter, get_model_spec  # noqa: E402
from tests.hf_models import randomize_hf_  # noqa: E402
from tests.hf_published import PUBLISHED, TINYLLAMA_1_1B  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import convert_hf  # noqa: E402

RTOL = ATOL = 1e-5
SEQ = 24
VOCAB = 128


def _n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------------------------
# published config.json files


@pytest.mark.parametrize("name, config, flavor, total", PUBLISHED, ids=[p[2] for p in PUBLISHED])
def test_published_config_sizes_the_model(name, config, flavor, total):
    if "quantization_config" in config:  # DeepSeek-V3 ships FP8 weights: refused by name
        with pytest.raises(HFConfigMismatch, match="quantization_config.*dequantize") as err:
            get_model_spec(name, "hf", config)
        assert [m[0] for m in err.value.mismatches] == ["quantization_config"]
        config = {k: v for k, v in config.items() if k != "quantization_config"}  # the dequantized copy's
    spec = get_model_spec(name, "hf", config)
    preset = get_model_spec(name, flavor)
    # the same model as the preset: our config.json of either is the same
    assert get_hf_adapter(name, spec.args).hf_config() == get_hf_adapter(name, preset.args).hf_config()
    get_hf_adapter(name, spec.args).check_hf_config(config)
    assert _n_params(build_model(name, "hf", hf_config=config)) == total


def test_sizes_no_preset_has():
    """transformers' default LlamaConfig() (refused over rms_norm_eps before: 1e-6) and a
    TinyLlama-sized model load with exactly transformers' parameter count."""
    from transformers import LlamaConfig, LlamaForCausalLM

    default = json.loads(LlamaConfig().to_json_string(use_diff=True))
    assert "architectures" not in default  # model_type "llama" says which model
    for config, expected in ((default, 6_738_415_616), (TINYLLAMA_1_1B, 1_100_048_384)):
        spec = get_model_spec("llama3", "hf", config)
        with torch.device("meta"):
            theirs = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in config.items() if k != "architectures"}))
        assert _n_params(build_model("llama3", "hf", hf_config=config)) == _n_params(theirs) == expected
    assert spec.args.hidden_dim == 5632 and spec.args.kv_heads == 4 and not spec.args.use_rope_scaling
    assert get_model_spec("llama3", "hf", default).args.norm_eps == 1e-6


# ---------------------------------------------------------------------------------------------
# tiny custom sizes: parity with transformers and bitwise round trips


def _hf_tiny(kind: str):
    from transformers import (
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    common = dict(vocab_size=VOCAB, num_hidden_layers=2, max_position_embeddings=64, rms_norm_eps=1e-6)
    qwen = dict(hidden_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=80)
    if kind == "llama":  # FFN width 96: not Llama 3's sizing rule; theta 1e4, no rope scaling
        cls, config = (
            LlamaForCausalLM,
            LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, **common),
        )
    elif kind == "qwen3":  # tied, head_dim 16 != 48 / 4
        cls, config = Qwen3ForCausalLM, Qwen3Config(**qwen, tie_word_embeddings=True, **common)
    elif kind == "qwen3_moe":  # top-k weights not renormalised
        cls, config = (
            Qwen3MoeForCausalLM,
            Qwen3MoeConfig(
                **qwen, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=False, **common
            ),
        )
    else:  # q LoRA, 2 groups of 2 experts with 1 kept, a shared expert, a dense first layer
        cls, config = DeepseekV3ForCausalLM, DeepseekV3Config(
            hidden_size=48, intermediate_size=80, moe_intermediate_size=24, first_k_dense_replace=1,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1,
            num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=1.5, q_lora_rank=24,
            kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, **common,
        )  # fmt: skip
    torch.manual_seed(0)
    model = cls(config).float().eval()
    randomize_hf_(model, 1)
    return model


_MODEL = {"llama": "llama3", "qwen3": "qwen3", "qwen3_moe": "qwen3", "deepseek_v3": "deepseek_v3"}


@pytest.fixture(scope="module", params=list(_MODEL))
def tiny(request, tmp_path_factory):
    kind = request.param
    folder = tmp_path_factory.mktemp(kind)
    hf = _hf_tiny(kind)
    hf.save_pretrained(folder, safe_serialization=True)
    sd = {}
    for f in sorted(folder.glob("*.safetensors")):
        sd.update(safetensors_torch.load_file(str(f)))
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        logits = hf(input_ids=tokens, use_cache=False).logits.float()
    return _MODEL[kind], folder, json.loads((folder / "config.json").read_text()), sd, tokens, logits


def _our_logits(name, args, sd, tokens):
    with torch.device("cpu"):
        model = get_model_spec(name, flavor_names(name)[0]).model_cls(args)
    model.init_weights(0)
    model.load_state_dict(get_hf_adapter(name, args).from_hf(sd))
    model.eval()
    with torch.no_grad():
        return model(tokens).float()


def test_tiny_custom_size_matches_transformers(tiny):
    name, _, config, sd, tokens, theirs = tiny
    args = get_model_spec(name, "hf", config).args
    assert args.norm_eps == 1e-6 and args.vocab_size == VOCAB and args.n_layers == 2
    ours = _our_logits(name, args, sd, tokens)
    assert theirs.abs().max() > 0.1
    torch.testing.assert_close(ours, theirs, rtol=RTOL, atol=ATOL)
    # negative control: the eps config.json does not say (x10) moves the logits past the tolerance
    wrong = _our_logits(name, dataclasses.replace(args, norm_eps=1e-5), sd, tokens)
    assert not torch.allclose(wrong, theirs, rtol=RTOL, atol=ATOL)


def test_tiny_custom_size_round_trips_bitwise(tiny):
    name, _, config, sd, _, _ = tiny
    args = get_model_spec(name, "hf", config).args
    adapter = get_hf_adapter(name, args)
    back = adapter.to_hf(adapter.from_hf(sd))
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)
    # our exported config.json sizes the same args again
    assert get_model_spec(name, "hf", adapter.hf_config()).args == args


def test_convert_without_flavor_round_trips(tiny, tmp_path):
    """scripts/convert_hf.py: to-dcp with neither --model nor --flavor (both from config.json),
    to-hf with --hf-config (no --model either): every tensor back bit for bit."""
    _, folder, _, sd, _, _ = tiny
    assert convert_hf.main(["to-dcp", str(folder), str(tmp_path / "dcp")]) == 0
    argv = ["to-hf", str(tmp_path / "dcp"), str(tmp_path / "back"), "--hf-config", str(folder), "--dtype", "float32"]
    assert convert_hf.main(argv) == 0
    back = {}
    for f in sorted((tmp_path / "back").glob("*.safetensors")):
        back.update(safetensors_torch.load_file(str(f)))
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)


# ---------------------------------------------------------------------------------------------
# bad input: one line, exit 2, nothing written


def _one_line(capsys, rc: int, *needles: str) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: "), err
    for needle in needles:
        assert needle in err[0], err[0]
    return err[0]


@pytest.mark.parametrize(
    "edit, argv, needles",
    [
        # a field we do not model that changes the math (Gemma 2's logit soft-capping)
        ({"attn_logit_softcapping": 50.0}, [], ["attn_logit_softcapping=50.0", "not modeled here"]),
        # one we read, set to what we do not implement
        ({"attention_bias": True}, [], ["attention_bias=True in config.json vs False here"]),
        # an architecture no model implements: every supported one named
        (
            {"architectures": ["MistralForCausalLM"], "model_type": "mistral"},
            [],
            ["MistralForCausalLM", "LlamaForCausalLM (model 'llama3')", "Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM"],
        ),
        ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, ["--model", "llama3"], ["no model here"]),
        # a flavor contradicting config.json
        ({}, ["--model", "llama3", "--flavor", "1B"], ["hidden_size=64 in config.json vs 2048 here"]),
    ],
    ids=["unmodeled", "unimplemented", "mistral", "gpt2", "flavor"],
)
def test_convert_bad_input_is_one_line(tmp_path, capsys, edit, argv, needles):
    from transformers import LlamaConfig, LlamaForCausalLM

    src = tmp_path / "hf"
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(src)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, **edit}))
    capsys.readouterr()
    rc = convert_hf.main(["to-dcp", str(src), str(tmp_path / "out"), *argv])
    _one_line(capsys, rc, *needles)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    shutil.rmtree(src)


# ---------------------------------------------------------------------------------------------
# the trainer's view: model.flavor = "hf" reaches the job plan, its layout rules and the planner


def _config_folder(tmp_path, name: str, config: dict):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_job_plan_and_planner_see_the_derived_args(tmp_path):
    """A config sized by Qwen3-30B-A3B's config.json: the job plan's args are the derived ones
    (vocab overridden as for a flavor), the layout rules read its 4 KV heads (tp=8 refused, the
    legal values named), and the planner's estimate equals the one of the preset of the same
    sizes (control: a different preset's differs)."""
    from tests.hf_published import QWEN3_0_6B, QWEN3_30B_A3B
    from tools.planner.from_config import estimate_from_config
    from tools.planner.hardware import load_hardware
    from trainer.config import load_config
    from trainer.plan import plan_job

    folder = _config_folder(tmp_path, "30B-A3B", QWEN3_30B_A3B)
    argv = ["--config", "qwen3_moe.toml", "--training.local_batch_size", "1", "--model.flavor", "hf",
            "--model.hf_config", str(folder)]  # fmt: skip
    plan = plan_job(load_config([*argv, "--parallelism.dp_shard", "8"]), 8, tokenizer_vocab=2048)
    assert (plan.model_args.n_routed_experts, plan.model_args.n_kv_heads, plan.model_args.head_dim) == (128, 4, 128)
    with pytest.raises(ValueError, match="tp=8 does not divide n_kv_heads=4.*legal tp values: 1, 2, 4"):
        plan_job(load_config([*argv, "--parallelism.tp", "8"]), 8, tokenizer_vocab=2048)

    h100 = load_hardware("h100")
    small = _config_folder(tmp_path, "0.6B", QWEN3_0_6B)
    base = ["--config", "qwen3.toml", "--training.seq_len", "2048", "--training.local_batch_size", "1",
            "--parallelism.dp_shard", "8"]  # fmt: skip

    def estimate(*extra):
        return estimate_from_config(load_config([*base, *extra]), 8, h100, tokenizer_vocab=2048)

    derived = estimate("--model.flavor", "hf", "--model.hf_config", str(small))
    assert derived.memory == estimate("--model.flavor", "0.6B").memory
    assert derived.time == estimate("--model.flavor", "0.6B").time
    assert derived.memory != estimate("--model.flavor", "1.7B").memory


def test_hf_flavor_config_errors():
    """model.flavor = 'hf' needs a folder to size it; model.hf_config needs flavor 'hf'."""
    from trainer.config import ConfigError, load_config
    from trainer.model_spec import config_model_spec

    with pytest.raises(ConfigError, match="model.flavor = 'hf' takes every size from a Hugging Face config.json"):
        config_model_spec(load_config(["--config", "llama3.toml", "--model.flavor", "hf"]))
    with pytest.raises(ConfigError, match="model.hf_config sizes the model only with model.flavor = 'hf'"):
        load_config(["--config", "llama3.toml", "--model.hf_config", "/x"])
