"""Qwen3 (``models/qwen3``: dense, MoE, tied embeddings) against ``transformers``' Qwen3 /
Qwen3-MoE, fp32, on small random configs written here (no downloads), and against the published
config.json of Qwen3-0.6B, Qwen3-8B and Qwen3-30B-A3B.

* import: ``save_pretrained`` (the on-disk format, per-expert tensors) -> ``from_hf`` -> our
  logits equal transformers' within rtol/atol 1e-5 (the two differ in summation order: SDPA vs
  eager attention, our sorted-expert combine vs a per-expert loop; RoPE tables are float64-made
  here, float32 there), with a negative control (q and k norm gains swapped) that fails it;
* export: ours -> ``to_hf`` + ``hf_config()`` -> ``from_pretrained`` loads with no missing or
  unexpected key and gives our logits; HF -> ours -> HF bitwise on every tensor;
* the published configs pass the config check, infer their flavor and build on the meta device
  with exactly transformers' parameter count (596,049,920, 8,190,735,360 and 30,532,122,624);
* bad input: mismatching or unsupported config fields are named; a bad aux-loss coefficient is refused.

Shapes: dim 64, 2 layers, 4 query heads of width 32 (so head_dim != dim / n_heads) over 2 KV
heads, 8 experts top 2: the smallest that exercise GQA, the free head width, the per-head norms
and routing with renormalised top-k. About a second per test.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from models.common.hf_adapter import HFConfigMismatch, Plain  # noqa: E402
from models.qwen3 import Qwen3Args, qwen3_flavors  # noqa: E402
from models.qwen3.hf_adapter import Qwen3HFAdapter  # noqa: E402
from models.registry import build_model, get_hf_adapter, model_rules  # noqa: E402
from parallel_dims import check_model_layout  # noqa: E402
from parallel_dims.layout import validate_degrees  # noqa: E402
from tests.hf_models import randomize_hf_  # noqa: E402

RTOL = ATOL = 1e-5
SEQ = 24
OURS = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, hidden_dim=96, vocab_size=128, max_seq_len=64)
MOE = dict(n_routed_experts=8, n_activated_experts=2, moe_inter_dim=32, norm_topk_prob=True)
HF = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=96,
    vocab_size=128,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=False,
)
HF_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)

# Published config.json files (the fields that matter), typed in from the released folders
# Qwen/Qwen3-0.6B (tied embeddings), Qwen/Qwen3-8B and Qwen/Qwen3-30B-A3B.
QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024,
    "initializer_range": 0.02, "intermediate_size": 3072, "max_position_embeddings": 40960, "max_window_layers": 28,
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}  # fmt: skip
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 12288, "max_position_embeddings": 40960, "max_window_layers": 36,
    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}  # fmt: skip
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645,
    "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
    "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [], "moe_intermediate_size": 768,
    "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936,
}  # fmt: skip


def _ours(kind: str, seed: int = 0):
    extra = MOE if kind == "moe" else {"tie_word_embeddings": True} if kind == "tied" else {}
    model = build_model("qwen3", "debugmodel", device="cpu", **OURS, **extra)
    model.init_weights(seed)
    return model


def _tokens() -> torch.Tensor:
    return torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(7))


def _logits(model, tokens, hf: bool) -> torch.Tensor:
    with torch.no_grad():
        return (model(input_ids=tokens, use_cache=False).logits if hf else model(tokens)).float()


@pytest.fixture(scope="module", params=["dense", "moe", "tied"])
def qwen_hf(request, tmp_path_factory):
    kind = request.param
    moe = kind == "moe"
    config = Qwen3MoeConfig(**HF, **HF_MOE) if moe else Qwen3Config(**{**HF, "tie_word_embeddings": kind == "tied"})
    torch.manual_seed(0)
    model = (Qwen3MoeForCausalLM if moe else Qwen3ForCausalLM)(config).float().eval()
    randomize_hf_(model, 1)
    folder = tmp_path_factory.mktemp(f"qwen3_{request.param}")
    model.save_pretrained(folder, safe_serialization=True)
    sd = {}
    for f in sorted(folder.glob("*.safetensors")):
        sd.update(safetensors_torch.load_file(str(f)))
    return kind, model, sd, json.loads((folder / "config.json").read_text())


def test_import_matches_transformers(qwen_hf):
    """Logits of our model loaded from transformers' saved folder equal transformers' (1e-5);
    swapping the q and k norm gains (a plausible mapping slip) breaks the match."""
    kind, hf_model, hf_sd, config = qwen_hf
    if kind == "moe":
        assert any(".mlp.experts.0.gate_proj.weight" in k for k in hf_sd)  # per-expert on disk
    assert ("lm_head.weight" in hf_sd) == (kind != "tied")  # a tied folder stores the embedding only
    ours = _ours(kind)
    adapter = get_hf_adapter("qwen3", ours.args)
    assert adapter.hf_architecture == type(hf_model).__name__
    adapter.check_hf_config(config)  # the folder's own config.json (transformers 5 format)
    assert set(hf_sd) == set(adapter.hf_keys())
    ours.load_state_dict(adapter.from_hf(hf_sd), strict=True)
    tokens = _tokens()
    theirs = _logits(hf_model, tokens, hf=True)
    assert theirs.abs().max() > 0.1
    torch.testing.assert_close(_logits(ours, tokens, hf=False), theirs, rtol=RTOL, atol=ATOL)

    swapped = dict(hf_sd)
    for i in range(2):
        q, k = f"model.layers.{i}.self_attn.q_norm.weight", f"model.layers.{i}.self_attn.k_norm.weight"
        swapped[q], swapped[k] = hf_sd[k], hf_sd[q]
    ours.load_state_dict(adapter.from_hf(swapped), strict=True)
    assert not torch.allclose(_logits(ours, tokens, hf=False), theirs, rtol=RTOL, atol=ATOL)


def test_export_loads_in_transformers_and_round_trips(qwen_hf, tmp_path):
    """ours -> HF folder -> from_pretrained: every key loads and logits match ours; HF -> ours
    -> HF and ours -> HF -> ours are bitwise on every tensor."""
    kind, _, hf_sd, _ = qwen_hf
    ours = _ours(kind, seed=3)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():  # norms off 1 so a mapping slip between them cannot hide
        for name, t in ours.state_dict(keep_vars=True).items():
            if name.endswith("norm.weight"):
                t.copy_(1 + 0.2 * torch.randn(t.shape, generator=g))
    adapter = get_hf_adapter("qwen3", ours.args)
    out = tmp_path / "out"
    out.mkdir()
    safetensors_torch.save_file(
        {k: v.contiguous() for k, v in adapter.to_hf(ours.state_dict()).items()}, str(out / "model.safetensors")
    )
    (out / "config.json").write_text(json.dumps(adapter.hf_config("float32")))
    theirs, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert type(theirs).__name__ == adapter.hf_architecture
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    tokens = _tokens()
    torch.testing.assert_close(
        _logits(ours, tokens, hf=False), _logits(theirs.eval(), tokens, hf=True), rtol=RTOL, atol=ATOL
    )

    back = adapter.to_hf(adapter.from_hf(hf_sd))
    assert set(back) == set(hf_sd) and all(torch.equal(back[k], hf_sd[k]) for k in hf_sd)
    sd = ours.state_dict()
    again = adapter.from_hf(adapter.to_hf(sd))
    assert set(again) == set(sd) and all(torch.equal(again[k], sd[k]) for k in sd)
    if kind == "tied":
        assert ours.output.weight is ours.tok_embeddings.weight and theirs.config.tie_word_embeddings
    if kind == "moe":  # a non-zero expert bias has no place in a Qwen3-MoE checkpoint
        sd["layers.0.moe.expert_bias"] = torch.full_like(sd["layers.0.moe.expert_bias"], 0.5)
        with pytest.raises(ValueError, match="no expert bias"):
            adapter.to_hf(sd)


@pytest.mark.parametrize(
    ("config", "flavor", "total", "active"),
    [
        (QWEN3_0_6B, "0.6B", 596_049_920, 596_049_920),
        (QWEN3_8B, "8B", 8_190_735_360, 8_190_735_360),
        (QWEN3_30B_A3B, "30B-A3B", 30_532_122_624, 3_353_032_704),
    ],
)
def test_published_configs(config, flavor, total, active):
    """The published config.json passes the check against its flavor, infers that flavor, and
    the flavor built on the meta device has transformers' exact parameter count (0.6B, tied;
    8.2B; 30.5B total, 3.3B active: the model cards' figures)."""
    adapter = get_hf_adapter("qwen3", qwen3_flavors[flavor])
    adapter.check_hf_config(config)
    assert Qwen3HFAdapter.infer_flavor(config, qwen3_flavors) == flavor
    ours = build_model("qwen3", flavor)
    assert sum(p.numel() for p in ours.parameters()) == total
    assert ours.active_params() == active  # model card: "3.3B activated" for 30B-A3B
    cls, cfg_cls = (Qwen3MoeForCausalLM, Qwen3MoeConfig) if "num_experts" in config else (Qwen3ForCausalLM, Qwen3Config)
    hf_config = {k: v for k, v in config.items() if k not in ("architectures", "model_type")}
    with torch.device("meta"):
        theirs = cls(cfg_cls(**hf_config))
    assert sum(p.numel() for p in theirs.parameters()) == total
    # every tensor of the checkpoint has its name and shape in the adapter
    stored = {k: tuple(v.shape) for k, v in theirs.state_dict().items() if "experts" not in k}
    if config["tie_word_embeddings"]:  # transformers does not write the tied head
        del stored["lm_head.weight"]
    assert stored == {k: v for k, v in adapter.hf_keys().items() if "experts" not in k}


def test_config_check_names_each_mismatch():
    """A config.json differing from the flavor is refused with every differing field named
    (both values), and what our Qwen3 does not implement is refused by name."""
    moe = Qwen3HFAdapter(qwen3_flavors["30B-A3B"])
    bad = {**QWEN3_30B_A3B, "head_dim": 64, "num_experts_per_tok": 4, "moe_intermediate_size": 512}
    with pytest.raises(HFConfigMismatch) as err:
        moe.check_hf_config(bad)
    for text in (
        "head_dim=64 in config.json vs 128 here",
        "num_experts_per_tok=4 in config.json vs 8 here",
        "moe_intermediate_size=512 in config.json vs 768 here",
    ):
        assert text in str(err.value), str(err.value)
    for field, value in (
        ("tie_word_embeddings", True),  # 30B-A3B is untied
        ("use_sliding_window", True),
        ("attention_bias", True),
        ("mlp_only_layers", [0]),
        ("decoder_sparse_step", 2),
    ):
        with pytest.raises(HFConfigMismatch, match=field):
            moe.check_hf_config({**QWEN3_30B_A3B, field: value})
    with pytest.raises(HFConfigMismatch, match="Qwen3MoeForCausalLM"):
        Qwen3HFAdapter(qwen3_flavors["8B"]).check_hf_config(QWEN3_30B_A3B)


def test_args_refusals_and_layout_rules():
    """One-line errors for a bad aux-loss coefficient and bad shapes; the layout rules see
    the KV heads (tp must divide 4 for 30B-A3B) and the 128 experts. A config.json that switches
    the router aux loss on (output_router_logits) passes the check: it is a training choice."""
    qwen3_flavors["30B-A3B"].validate()  # the published 0.001
    Qwen3HFAdapter(qwen3_flavors["30B-A3B"]).check_hf_config({**QWEN3_30B_A3B, "output_router_logits": True})
    with pytest.raises(ValueError, match="router_aux_loss_coef must be a number >= 0"):
        dataclasses.replace(qwen3_flavors["30B-A3B"], router_aux_loss_coef=-0.1).validate()
    with pytest.raises(ValueError, match="router_aux_loss_coef=0.001 needs routed experts"):
        dataclasses.replace(qwen3_flavors["8B"], router_aux_loss_coef=0.001).validate()
    with pytest.raises(ValueError, match="n_activated_experts=16 exceeds"):
        Qwen3Args(n_routed_experts=8, n_activated_experts=16).validate()
    rules = model_rules(qwen3_flavors["30B-A3B"], seq_len=4096)
    assert (rules.n_heads, rules.n_kv_heads, rules.n_experts, rules.n_layers) == (32, 4, 128, 48)
    assert model_rules(qwen3_flavors["8B"]).n_experts == 0
    check_model_layout(validate_degrees(world_size=64, dp_shard=16, tp=4, ep=64), rules)
    with pytest.raises(ValueError, match=r"tp=8 does not divide n_kv_heads=4: .*legal tp values: 1, 2, 4"):
        check_model_layout(validate_degrees(world_size=64, dp_shard=8, tp=8), rules)


def test_adapter_maps_every_tensor_plainly():
    """No rotary permutation is needed (our attention rotates transformers' half-split pairs),
    so every non-expert tensor is a plain rename."""
    adapter = Qwen3HFAdapter(Qwen3Args(**OURS))
    assert all(isinstance(e, Plain) for e in adapter._entries())
    assert Path(__file__).exists()


def test_convert_hf_round_trip_and_refusal(tmp_path, capsys):
    """scripts/convert_hf.py on a Qwen3-MoE folder of debugmodel_moe's shapes (1 layer): to-dcp
    then to-hf float32 gives back every tensor bit for bit and a config.json
    transformers reads as Qwen3-MoE; a folder whose config.json differs in one field is refused
    with one line naming it, exit 2, nothing written."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    import convert_hf

    a = qwen3_flavors["debugmodel_moe"]
    config = Qwen3MoeConfig(
        hidden_size=a.dim,
        num_hidden_layers=1,
        num_attention_heads=a.n_heads,
        num_key_value_heads=a.n_kv_heads,
        head_dim=a.head_dim,
        intermediate_size=a.hidden_dim,
        vocab_size=a.vocab_size,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        num_experts=a.n_routed_experts,
        num_experts_per_tok=a.n_activated_experts,
        moe_intermediate_size=a.moe_inter_dim,
        norm_topk_prob=True,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).float()
    randomize_hf_(model, 2)
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    hf_sd = safetensors_torch.load_file(str(next((tmp_path / "hf").glob("*.safetensors"))))
    flags = ["--model", "qwen3", "--flavor", "debugmodel_moe", "--n-layers", "1"]
    assert convert_hf.main(["to-dcp", str(tmp_path / "hf"), str(tmp_path / "dcp"), *flags]) == 0
    assert convert_hf.main(["to-hf", str(tmp_path / "dcp"), str(tmp_path / "back"), *flags, "--dtype", "float32"]) == 0
    back = {}
    for f in sorted((tmp_path / "back").glob("*.safetensors")):
        back.update(safetensors_torch.load_file(str(f)))
    assert set(back) == set(hf_sd) and all(torch.equal(back[k], hf_sd[k]) for k in hf_sd)
    assert transformers.AutoConfig.from_pretrained(tmp_path / "back").model_type == "qwen3_moe"

    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**cfg, "moe_intermediate_size": 64}))
    capsys.readouterr()
    rc = convert_hf.main(["to-dcp", str(tmp_path / "hf"), str(tmp_path / "bad"), *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "moe_intermediate_size=64 in config.json vs 128 here" in err[0], err
    assert not (tmp_path / "bad").exists()
    # without --flavor every size comes from config.json (moe_intermediate_size 64 now), so the
    # stored experts' width is what disagrees, named with both shapes
    rc = convert_hf.main(["to-dcp", str(tmp_path / "hf"), str(tmp_path / "bad"), "--model", "qwen3"])
    err = capsys.readouterr().err
    assert rc == 2 and "has shape [128, 256], expected [64, 256]" in err and "Qwen3ForCausalLM" not in err, err
