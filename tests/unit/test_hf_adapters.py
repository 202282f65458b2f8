"""Hugging Face state-dict adapters (``models/*/hf_adapter.py``) against ``transformers``
itself: small random HF models built from configs written here (no downloads), fp32.

* import: ``save_pretrained`` -> safetensors -> ``from_hf`` -> our logits == transformers';
* export: ours -> ``to_hf`` + ``hf_config()`` -> ``from_pretrained`` -> logits == ours; round
  trips bitwise both ways;
* negative controls: a skipped q/k permutation, transposed or reordered experts and a flipped
  expert bias each break the import comparison;
* ``from_hf_local`` equals slicing ``from_hf`` bitwise and reads only what the shard needs;
* ``check_hf_config`` / ``infer_flavor`` on mutated and real-flavor configs; the real flavors'
  ``config.json`` build transformers models whose on-disk names and shapes are ``to_hf``'s.

Tolerance: rtol 1e-5 with atol 1e-5 on logits of magnitude ~1 (see ``_assert_logits``): the
two implementations differ in summation order (SDPA vs eager attention, MoE combine order)
and RoPE tables are computed in float64 here and float32 there.
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
    AutoConfig,
    AutoModelForCausalLM,
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
)

import models.common.hf_adapter as hf_adapter_mod  # noqa: E402
from models import registry  # noqa: E402
from models.common.hf_adapter import (  # noqa: E402
    HFConfigMismatch,
    HFStateDictAdapter,
    Stacked,
)
from models.deepseek_v3 import deepseek_v3_flavors  # noqa: E402
from models.deepseek_v3.hf_adapter import DeepSeekV3HFAdapter  # noqa: E402
from models.llama3 import llama3_flavors  # noqa: E402
from models.llama3.hf_adapter import Llama3HFAdapter  # noqa: E402
from models.registry import build_model, get_hf_adapter  # noqa: E402
from tests.hf_models import LLAMA3_ROPE, llama_config, randomize_hf_  # noqa: E402

RTOL = 1e-5
ATOL = 1e-5
SEQ = 48

# ---------------------------------------------------------------------------------------------
# small shapes (ours as overrides of a flavor, theirs as a transformers config written here)

LLAMA_OURS = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, multiple_of=32, max_seq_len=64)


def _llama_hf_config() -> LlamaConfig:
    return llama_config(  # Llama sizing of dim 64: intermediate 192 (multiple_of 32)
        vocab_size=128,
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )


# moe_inter_dim == dim: a transposed expert would load without a shape error, so only the
# logits can catch it (negative control). Two dense + two MoE layers, 2 shared experts, 4
# groups of 2 experts with 2 kept; YaRN on (max_seq_len 128 > original 32).
DS_OURS = dict(
    vocab_size=128,
    dim=64,
    inter_dim=96,
    moe_inter_dim=64,
    n_layers=4,
    n_dense_layers=2,
    n_heads=4,
    n_routed_experts=8,
    n_shared_experts=2,
    n_activated_experts=3,
    n_expert_groups=4,
    n_limited_groups=2,
    score_func="sigmoid",
    route_norm=True,
    route_scale=2.5,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    rope_theta=10000.0,
    rope_factor=4.0,
    original_seq_len=32,
    mscale=0.707,
    max_seq_len=128,
)
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
}
DS_VARIANTS = {
    # name: (our overrides, transformers class, transformers config kwargs)
    "v3": ({"q_lora_rank": 0}, "v3", {"q_lora_rank": None}),
    "v3_qlora": ({"q_lora_rank": 24}, "v3", {"q_lora_rank": 24}),
    "v2_greedy": (
        {
            "q_lora_rank": 0,
            "score_func": "softmax",
            "route_norm": False,
            "route_scale": 1.0,
            "n_expert_groups": 1,
            "n_limited_groups": 1,
        },
        "v2",
        {"q_lora_rank": None, "topk_method": "greedy", "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0},
    ),
    "v2_grouped": (
        {"q_lora_rank": 24, "score_func": "softmax", "route_norm": False, "route_scale": 1.5},
        "v2",
        {
            "q_lora_rank": 24,
            "topk_method": "group_limited_greedy",
            "n_group": 4,
            "topk_group": 2,
            "routed_scaling_factor": 1.5,
        },
    ),
}


def _ds_hf(variant: str):
    _, kind, extra = DS_VARIANTS[variant]
    common = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=64,
        num_hidden_layers=4,
        first_k_dense_replace=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=2,
        n_routed_experts=8,
        num_experts_per_tok=3,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_theta": 10000.0, **YARN},
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    if kind == "v3":
        cfg = DeepseekV3Config(
            **common, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5, num_mtp_layers=0, **extra
        )
        return cfg, DeepseekV3ForCausalLM
    return DeepseekV2Config(**common, **extra), DeepseekV2ForCausalLM


def _ours(name: str, overrides: dict, seed: int = 0):
    base = "debugmodel"
    model = build_model(name, base, device="cpu", **overrides)
    model.init_weights(seed)
    return model


def _perturb_ours(model, seed: int) -> None:
    """init_weights leaves norms at 1 and expert biases at 0: make every tensor distinct so a
    mapping error cannot hide behind equal values."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.state_dict(keep_vars=True).items():
            if name.endswith("norm.weight"):
                t.copy_(1 + 0.2 * torch.randn(t.shape, generator=g))
            elif name.endswith("expert_bias"):
                t.copy_(0.05 * torch.randn(t.shape, generator=g))


def _tokens(vocab: int = 128) -> torch.Tensor:
    return torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(7))


def _hf_logits(model, tokens) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tokens, use_cache=False).logits.float()


def _our_logits(model, tokens) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens).float()


def _assert_logits(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert theirs.abs().max() > 0.1  # not a degenerate comparison
    torch.testing.assert_close(ours, theirs, rtol=RTOL, atol=ATOL)


def _logits_match(ours: torch.Tensor, theirs: torch.Tensor) -> bool:
    return torch.allclose(ours, theirs, rtol=RTOL, atol=ATOL)


def _save_hf(model, path: Path) -> dict[str, torch.Tensor]:
    model.save_pretrained(path, safe_serialization=True)
    files = sorted(path.glob("*.safetensors"))
    assert files, "save_pretrained wrote no safetensors"
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(safetensors_torch.load_file(str(f)))
    return sd


def _write_folder(path: Path, hf_sd: dict[str, torch.Tensor], config: dict) -> None:
    path.mkdir(parents=True, exist_ok=True)
    safetensors_torch.save_file({k: v.contiguous() for k, v in hf_sd.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config, indent=2))


# ---------------------------------------------------------------------------------------------
# fixtures: one random HF model per architecture, saved once


@pytest.fixture(scope="module")
def llama_hf(tmp_path_factory):
    torch.manual_seed(0)
    model = LlamaForCausalLM(_llama_hf_config()).float().eval()
    randomize_hf_(model, 1)
    folder = tmp_path_factory.mktemp("llama_hf")
    sd = _save_hf(model, folder)
    return model, sd, json.loads((folder / "config.json").read_text())


@pytest.fixture(scope="module")
def ds_hf(tmp_path_factory):
    out = {}
    for variant in DS_VARIANTS:
        cfg, cls = _ds_hf(variant)
        torch.manual_seed(0)
        model = cls(cfg).float().eval()
        randomize_hf_(model, 2)
        folder = tmp_path_factory.mktemp(f"ds_{variant}")
        sd = _save_hf(model, folder)
        out[variant] = (model, sd, json.loads((folder / "config.json").read_text()))
    return out


def _ds_overrides(variant: str) -> dict:
    return {**DS_OURS, **DS_VARIANTS[variant][0]}


# ---------------------------------------------------------------------------------------------
# 1. import


def test_llama_import_matches_transformers(llama_hf):
    hf_model, hf_sd, config = llama_hf
    ours = _ours("llama3", LLAMA_OURS)
    adapter = get_hf_adapter("llama3", ours.args)
    assert isinstance(adapter, Llama3HFAdapter)
    adapter.check_hf_config(config)  # the folder's own config.json (transformers 5 format)
    assert set(hf_sd) == set(adapter.hf_keys())
    ours.load_state_dict(adapter.from_hf(hf_sd), strict=True)
    tokens = _tokens()
    _assert_logits(_our_logits(ours, tokens), _hf_logits(hf_model, tokens))


@pytest.mark.parametrize("variant", list(DS_VARIANTS))
def test_deepseek_import_matches_transformers(ds_hf, variant):
    hf_model, hf_sd, config = ds_hf[variant]
    # what transformers writes is the per-expert on-disk format (it fuses experts in memory)
    assert any(".mlp.experts.0.gate_proj.weight" in k for k in hf_sd)
    assert not any(k.endswith("gate_up_proj") for k in hf_sd)
    ours = _ours("deepseek_v3", _ds_overrides(variant))
    adapter = get_hf_adapter("deepseek_v3", ours.args)
    assert adapter.hf_architecture == type(hf_model).__name__
    adapter.check_hf_config(config)
    assert set(hf_sd) == set(adapter.hf_keys())
    sd = adapter.from_hf(hf_sd)
    ours.load_state_dict(sd, strict=True)
    if variant.startswith("v3"):
        assert sd["layers.2.moe.expert_bias"].abs().max() > 0  # the bias is mapped, not zeroed
    tokens = _tokens()
    _assert_logits(_our_logits(ours, tokens), _hf_logits(hf_model, tokens))


# ---------------------------------------------------------------------------------------------
# 2. export and round trips


def test_llama_export_loads_in_transformers(tmp_path, llama_hf):
    ours = _ours("llama3", LLAMA_OURS, seed=3)
    _perturb_ours(ours, 4)
    adapter = get_hf_adapter("llama3", ours.args)
    config = adapter.hf_config("float32")
    _write_folder(tmp_path / "out", adapter.to_hf(ours.state_dict()), config)
    theirs, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32, output_loading_info=True)
    assert type(theirs).__name__ == "LlamaForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert theirs.config.rope_parameters["rope_type"] == "llama3"
    tokens = _tokens()
    _assert_logits(_our_logits(ours, tokens), _hf_logits(theirs.eval(), tokens))

    # HF -> ours -> HF and ours -> HF -> ours, bitwise on every tensor
    _, hf_sd, _ = llama_hf
    back = adapter.to_hf(adapter.from_hf(hf_sd))
    assert set(back) == set(hf_sd) and all(torch.equal(back[k], hf_sd[k]) for k in hf_sd)
    sd = ours.state_dict()
    again = adapter.from_hf(adapter.to_hf(sd))
    assert set(again) == set(sd) and all(torch.equal(again[k], sd[k]) for k in sd)


@pytest.mark.parametrize("variant", list(DS_VARIANTS))
def test_deepseek_export_loads_in_transformers(tmp_path, ds_hf, variant):
    ours = _ours("deepseek_v3", _ds_overrides(variant), seed=5)
    _perturb_ours(ours, 6)
    adapter = get_hf_adapter("deepseek_v3", ours.args)
    if adapter.v2:  # DeepSeek-V2 has no expert bias: refused unless zero
        with pytest.raises(ValueError, match=r"layers\.2\.moe\.expert_bias.*load_balance_coeff"):
            adapter.to_hf(ours.state_dict())
        for moe in ours.moe_layers():
            moe.expert_bias.zero_()
    config = adapter.hf_config("float32")
    _write_folder(tmp_path / "out", adapter.to_hf(ours.state_dict()), config)
    theirs, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32, output_loading_info=True)
    assert type(theirs).__name__ == adapter.hf_architecture
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert theirs.config.rope_parameters["rope_type"] == "yarn"
    tokens = _tokens()
    _assert_logits(_our_logits(ours, tokens), _hf_logits(theirs.eval(), tokens))

    _, hf_sd, _ = ds_hf[variant]
    back = adapter.to_hf(adapter.from_hf(hf_sd))
    assert set(back) == set(hf_sd) and all(torch.equal(back[k], hf_sd[k]) for k in hf_sd)
    sd = ours.state_dict()
    again = adapter.from_hf(adapter.to_hf(sd))
    assert set(again) == set(sd) and all(torch.equal(again[k], sd[k]) for k in sd)


def test_hf_config_accepted_by_autoconfig():
    for name, overrides in (("llama3", LLAMA_OURS), ("deepseek_v3", DS_OURS)):
        args = _ours(name, overrides).args
        cfg = get_hf_adapter(name, args).hf_config()
        auto = AutoConfig.for_model(**cfg)
        assert auto.model_type == cfg["model_type"] and auto.architectures == cfg["architectures"]
        assert auto.num_hidden_layers == args.n_layers and auto.vocab_size == args.vocab_size
        assert auto.dtype == torch.bfloat16


# ---------------------------------------------------------------------------------------------
# 3. negative controls: a wrong mapping fails the import comparison


def _import_logits(name, overrides, adapter, hf_sd):
    ours = _ours(name, overrides)
    ours.load_state_dict(adapter.from_hf(hf_sd), strict=True)
    return _our_logits(ours, _tokens())


def test_negative_control_qk_permutation_skipped(llama_hf, monkeypatch):
    hf_model, hf_sd, _ = llama_hf
    adapter = Llama3HFAdapter(_ours("llama3", LLAMA_OURS).args)
    theirs = _hf_logits(hf_model, _tokens())
    assert _logits_match(_import_logits("llama3", LLAMA_OURS, adapter, hf_sd), theirs)
    monkeypatch.setattr(hf_adapter_mod, "half_split_to_interleaved", lambda w, n_heads: w)
    assert not _logits_match(_import_logits("llama3", LLAMA_OURS, adapter, hf_sd), theirs)


class _ReversedExperts(DeepSeekV3HFAdapter):
    def _entries(self):
        for e in super()._entries():
            yield dataclasses.replace(e, hf=tuple(reversed(e.hf))) if isinstance(e, Stacked) else e


class _TransposedExperts(DeepSeekV3HFAdapter):
    def from_hf(self, hf_state_dict):
        sd = super().from_hf(hf_state_dict)
        return {k: v.transpose(1, 2).contiguous() if ".experts.w" in k else v for k, v in sd.items()}


class _GateUpSwapped(DeepSeekV3HFAdapter):
    def from_hf(self, hf_state_dict):
        sd = super().from_hf(hf_state_dict)
        swap = {k: k.replace(".w1", ".w3") if ".w1" in k else k.replace(".w3", ".w1") for k in sd}
        return {swap[k]: v for k, v in sd.items()}


class _NegatedBias(DeepSeekV3HFAdapter):
    def from_hf(self, hf_state_dict):
        sd = super().from_hf(hf_state_dict)
        return {k: -v if k.endswith("expert_bias") else v for k, v in sd.items()}


@pytest.mark.parametrize("mutant", [_ReversedExperts, _TransposedExperts, _GateUpSwapped, _NegatedBias])
def test_negative_control_expert_mapping(ds_hf, mutant):
    hf_model, hf_sd, _ = ds_hf["v3"]
    overrides = _ds_overrides("v3")
    args = _ours("deepseek_v3", overrides).args
    theirs = _hf_logits(hf_model, _tokens())
    assert _logits_match(_import_logits("deepseek_v3", overrides, DeepSeekV3HFAdapter(args), hf_sd), theirs)
    assert not _logits_match(_import_logits("deepseek_v3", overrides, mutant(args), hf_sd), theirs)


# ---------------------------------------------------------------------------------------------
# 4. from_hf_local


class _CountingReader:
    def __init__(self, hf_sd):
        self.hf_sd = hf_sd
        self.elements = 0
        self.keys: list[str] = []

    def __call__(self, key, slices):
        t = self.hf_sd[key] if slices is None else self.hf_sd[key][slices]
        self.elements += t.numel()
        self.keys.append(key)
        return t.clone()


def _check_local(adapter, hf_sd, full, key, slices):
    reader = _CountingReader(hf_sd)
    got = adapter.from_hf_local(key, slices, reader)
    want = full[key][slices]
    assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), (key, slices)
    return reader


def test_from_hf_local_qk_rows_split_heads(llama_hf):
    _, hf_sd, _ = llama_hf
    adapter = Llama3HFAdapter(_ours("llama3", LLAMA_OURS).args)
    full = adapter.from_hf(hf_sd)
    hd, cols = 16, 64
    wq, wk = "layers.1.attention.wq.weight", "layers.0.attention.wk.weight"
    # (rows of ours, heads the read must cover)
    for key, rows, heads in (
        (wq, slice(0, 32), 2),  # whole heads 0-1
        (wq, slice(24, 40), 2),  # splits heads 1 and 2
        (wq, slice(0, 22), 2),  # FSDP-like uneven: 22 + 21 + 21
        (wq, slice(22, 43), 2),
        (wq, slice(43, 64), 2),
        (wq, slice(5, 6), 1),
        (wq, slice(60, 64), 1),
        (wk, slice(0, 11), 1),
        (wk, slice(11, 32), 2),
        (wk, slice(32, 32), 0),  # an empty shard
    ):
        reader = _check_local(adapter, hf_sd, full, key, (rows,))
        assert reader.elements == heads * hd * cols, (key, rows)
        reader = _check_local(adapter, hf_sd, full, key, (rows, slice(10, 50)))
        assert reader.elements == heads * hd * 40
    # a dim-1 slice of every other tensor reads exactly the slice
    for key, t in full.items():
        if t.dim() == 2:
            reader = _check_local(adapter, hf_sd, full, key, (slice(None), slice(3, 17)))
            assert reader.elements == t.shape[0] * 14


def _uneven_chunks(n: int, parts: int = 3) -> list[slice]:
    bounds = [0] + [min(n, (n * i + parts - 1) // parts + (i % 2)) for i in range(1, parts)] + [n]
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("variant", ["v3", "v3_qlora", "v2_greedy"])
def test_from_hf_local_every_tensor_and_experts(ds_hf, variant):
    _, hf_sd, _ = ds_hf[variant]
    adapter = DeepSeekV3HFAdapter(_ours("deepseek_v3", _ds_overrides(variant)).args)
    full = adapter.from_hf(hf_sd)
    for key, t in full.items():  # FSDP-like Shard(0) pieces of every tensor
        for piece in _uneven_chunks(t.shape[0]):
            _check_local(adapter, hf_sd, full, key, (piece,))
    # stacked experts: only the slice's experts are read
    e_hid, e_dim = 64, 64
    for key in ("layers.2.moe.experts.w1", "layers.3.moe.experts.w2", "layers.3.moe.experts.w3"):
        for experts in (slice(0, 8), slice(2, 5), slice(7, 8), slice(4, 4)):
            reader = _check_local(adapter, hf_sd, full, key, (experts,))
            n = len(range(*experts.indices(8)))
            assert reader.elements == n * e_hid * e_dim
            assert sorted({int(k.split(".experts.")[1].split(".")[0]) for k in reader.keys}) == (
                list(range(*experts.indices(8))) if n else [0]
            )
            reader = _check_local(adapter, hf_sd, full, key, (experts, slice(8, 40)))
            assert reader.elements == n * 32 * e_dim
            reader = _check_local(adapter, hf_sd, full, key, (experts, slice(None), slice(0, 16)))
            assert reader.elements == n * e_hid * 16
    if adapter.v2:  # no bias in the checkpoint: zeros, nothing read
        reader = _check_local(adapter, hf_sd, full, "layers.2.moe.expert_bias", (slice(2, 6),))
        assert reader.elements == 0 and torch.equal(full["layers.2.moe.expert_bias"], torch.zeros(8))


def test_from_hf_errors_name_the_key(llama_hf):
    _, hf_sd, _ = llama_hf
    adapter = Llama3HFAdapter(_ours("llama3", LLAMA_OURS).args)
    missing = {k: v for k, v in hf_sd.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(ValueError, match=r"missing key 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        adapter.from_hf(missing)
    bad = dict(hf_sd, **{"model.norm.weight": torch.ones(65)})
    with pytest.raises(ValueError, match=r"'model\.norm\.weight' has shape \(65,\), expected \(64,\)"):
        adapter.from_hf(bad)
    extra = dict(hf_sd, **{"model.layers.2.mlp.up_proj.weight": torch.ones(1)})
    with pytest.raises(ValueError, match=r"unexpected key.*model\.layers\.2\.mlp\.up_proj\.weight"):
        adapter.from_hf(extra)
    # old checkpoints' rotary buffers are skipped
    adapter.from_hf(dict(hf_sd, **{"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}))


def test_deepseek_from_hf_skips_mtp_layers_and_refuses_fp8(ds_hf):
    _, hf_sd, _ = ds_hf["v3"]
    adapter = DeepSeekV3HFAdapter(_ours("deepseek_v3", _ds_overrides("v3")).args)
    adapter.from_hf(dict(hf_sd, **{"model.layers.4.eh_proj.weight": torch.ones(2, 2)}))  # MTP layer
    with pytest.raises(ValueError, match=r"unexpected key.*model\.layers\.3\.eh_proj\.weight"):
        adapter.from_hf(dict(hf_sd, **{"model.layers.3.eh_proj.weight": torch.ones(2, 2)}))  # not past n_layers
    fp8 = dict(hf_sd, **{"model.layers.0.self_attn.o_proj.weight_scale_inv": torch.ones(1, 1)})
    with pytest.raises(ValueError, match="FP8.*dequantize"):
        adapter.from_hf(fp8)


# ---------------------------------------------------------------------------------------------
# 5. check_hf_config / infer_flavor


def _mismatch(adapter, config) -> HFConfigMismatch:
    with pytest.raises(HFConfigMismatch) as info:
        adapter.check_hf_config(config)
    assert "\n" not in str(info.value)
    return info.value


def test_check_hf_config_llama_names_field_and_both_values():
    adapter = Llama3HFAdapter(llama3_flavors["8B"])
    good = adapter.hf_config()
    adapter.check_hf_config(good)
    for field, value, ours in (
        ("hidden_size", 2048, 4096),
        ("num_hidden_layers", 16, 32),
        ("num_attention_heads", 16, 32),
        ("num_key_value_heads", 4, 8),
        ("vocab_size", 32000, 128256),
        ("intermediate_size", 11008, 14336),
        ("rms_norm_eps", 1e-6, 1e-5),
        ("rope_theta", 10000.0, 500000.0),
    ):
        err = _mismatch(adapter, {**good, field: value})
        assert f"{field}={value!r} in config.json vs {ours!r} here" in str(err), str(err)
        assert err.mismatches[0][:3] == (field, value, ours) or field == "num_attention_heads"
    err = _mismatch(adapter, {**good, "rope_scaling": {**LLAMA3_ROPE, "factor": 32.0}})
    assert "rope_scaling" in str(err) and "32.0" in str(err) and "8.0" in str(err)
    err = _mismatch(adapter, {**good, "rope_scaling": None})  # Llama 3.0: no scaling
    assert "rope_scaling=None in config.json" in str(err) and "use_rope_scaling" in str(err)
    # transformers 5 format of the same config passes
    v5 = {k: v for k, v in good.items() if k not in ("rope_theta", "rope_scaling")}
    adapter.check_hf_config({**v5, "rope_parameters": {"rope_theta": 500000.0, **LLAMA3_ROPE}})
    # all mismatches in one message
    err = _mismatch(adapter, {**good, "hidden_size": 2048, "num_hidden_layers": 16, "vocab_size": 32000})
    assert [m[0] for m in err.mismatches] == ["hidden_size", "num_hidden_layers", "vocab_size"]


@pytest.mark.parametrize(
    "arch,model_type", [("Qwen2ForCausalLM", "qwen2"), ("MistralForCausalLM", "mistral"), ("GPT2LMHeadModel", "gpt2")]
)
def test_check_hf_config_refuses_other_architectures(arch, model_type):
    config = {**Llama3HFAdapter(llama3_flavors["8B"]).hf_config(), "architectures": [arch], "model_type": model_type}
    for adapter in (Llama3HFAdapter(llama3_flavors["8B"]), DeepSeekV3HFAdapter(deepseek_v3_flavors["671B"])):
        err = _mismatch(adapter, config)
        assert arch in str(err) and model_type in str(err) and adapter.hf_architecture in str(err)
        assert Llama3HFAdapter.infer_flavor(config, llama3_flavors) is None


def test_check_hf_config_deepseek():
    v3 = DeepSeekV3HFAdapter(deepseek_v3_flavors["671B"])
    good = v3.hf_config()
    assert good["rope_scaling"]["rope_type"] == "yarn"  # 671B: max_seq_len 16384 > 4096
    v3.check_hf_config(good)
    for field, value, ours in (
        ("n_routed_experts", 64, 256),
        ("num_experts_per_tok", 6, 8),
        ("n_shared_experts", 2, 1),
        ("first_k_dense_replace", 1, 3),
        ("q_lora_rank", 512, 1536),
        ("kv_lora_rank", 256, 512),
        ("moe_intermediate_size", 1408, 2048),
        ("routed_scaling_factor", 1.0, 2.5),
        ("n_group", 1, 8),
        ("topk_group", 1, 4),
        ("norm_topk_prob", False, True),
    ):
        err = _mismatch(v3, {**good, field: value})
        assert f"{field}={value!r} in config.json vs {ours!r} here" in str(err), str(err)
    err = _mismatch(v3, {**good, "rope_scaling": {**good["rope_scaling"], "factor": 8.0}})
    assert "rope_scaling.factor=8.0 in config.json vs 40.0 here" in str(err)
    err = _mismatch(v3, {**good, "rope_interleave": False})
    assert "rope_interleave=False" in str(err)
    err = _mismatch(v3, {**good, "quantization_config": {"quant_method": "fp8"}})
    assert "quantization_config" in str(err) and "dequantize" in str(err)
    # YaRN in the checkpoint but off here (max_seq_len <= original_seq_len)
    short = DeepSeekV3HFAdapter(dataclasses.replace(deepseek_v3_flavors["671B"], max_seq_len=4096))
    err = _mismatch(short, good)
    assert "rope_scaling='yarn' in config.json vs None here" in str(err) and "max_seq_len" in str(err)

    # sigmoid flavor vs a DeepSeek-V2 (softmax) checkpoint and the reverse: refused
    v2 = DeepSeekV3HFAdapter(deepseek_v3_flavors["16B"])
    v2_config = v2.hf_config()
    assert v2_config["architectures"] == ["DeepseekV2ForCausalLM"]
    err = _mismatch(v3, v2_config)
    assert "DeepseekV2ForCausalLM" in str(err) and "DeepseekV3ForCausalLM" in str(err)
    err = _mismatch(v2, {**v2_config, "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"})
    assert "DeepseekV3ForCausalLM" in str(err) and "deepseek_v2" in str(err)
    # routing V2 cannot express
    with pytest.raises(HFConfigMismatch, match="route_norm=True"):
        DeepSeekV3HFAdapter(dataclasses.replace(deepseek_v3_flavors["16B"], route_norm=True)).hf_config()


# Published config.json files (abridged to the fields that matter), typed in from the
# released folders: Llama 3.1 8B, DeepSeek-V2-Lite and DeepSeek-V3 (FP8).
LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
    "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "max_position_embeddings": 131072, "hidden_act": "silu",
    "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
}  # fmt: skip
DEEPSEEK_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": 2048,
    "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27, "first_k_dense_replace": 1,
    "moe_layer_freq": 1, "num_attention_heads": 16, "num_key_value_heads": 16, "n_routed_experts": 64,
    "n_shared_experts": 2, "num_experts_per_tok": 6, "n_group": 1, "topk_group": 1, "topk_method": "greedy",
    "norm_topk_prob": False, "scoring_func": "softmax", "routed_scaling_factor": 1.0, "q_lora_rank": None,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 102400,
    "rms_norm_eps": 1e-06, "rope_theta": 10000, "max_position_embeddings": 163840, "hidden_act": "silu",
    "attention_bias": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
}  # fmt: skip
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61, "first_k_dense_replace": 3,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_routed_experts": 256, "n_shared_experts": 1,
    "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "topk_method": "noaux_tc", "norm_topk_prob": True,
    "scoring_func": "sigmoid", "routed_scaling_factor": 2.5, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 129280,
    "rms_norm_eps": 1e-06, "rope_theta": 10000, "max_position_embeddings": 163840, "hidden_act": "silu",
    "num_nextn_predict_layers": 1, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
}  # fmt: skip


def test_infer_flavor_real_flavors_and_published_configs():
    for cls, flavors in ((Llama3HFAdapter, llama3_flavors), (DeepSeekV3HFAdapter, deepseek_v3_flavors)):
        for name, args in flavors.items():
            config = cls(args).hf_config()
            cls(args).check_hf_config(config)
            assert cls.infer_flavor(config, flavors) == name
            # vocab is overridden from the tokenizer: still found when no flavor has it
            assert cls.infer_flavor({**config, "vocab_size": 7}, flavors) == name
            assert cls.infer_flavor({**config, "num_hidden_layers": 3}, flavors) is None
    assert Llama3HFAdapter.infer_flavor(LLAMA31_8B, llama3_flavors) == "8B"
    Llama3HFAdapter(llama3_flavors["8B"]).check_hf_config(LLAMA31_8B)
    assert DeepSeekV3HFAdapter.infer_flavor(DEEPSEEK_V2_LITE, deepseek_v3_flavors) == "16B"
    DeepSeekV3HFAdapter(deepseek_v3_flavors["16B"]).check_hf_config(DEEPSEEK_V2_LITE)
    assert DeepSeekV3HFAdapter.infer_flavor(DEEPSEEK_V3, deepseek_v3_flavors) == "671B"
    err = _mismatch(DeepSeekV3HFAdapter(deepseek_v3_flavors["671B"]), DEEPSEEK_V3)
    assert [m[0] for m in err.mismatches] == ["quantization_config"]  # FP8 weights: the only difference
    no_fp8 = {k: v for k, v in DEEPSEEK_V3.items() if k != "quantization_config"}
    DeepSeekV3HFAdapter(deepseek_v3_flavors["671B"]).check_hf_config(no_fp8)


def test_get_hf_adapter_registry(monkeypatch):
    assert isinstance(get_hf_adapter("llama3", llama3_flavors["8B"]), Llama3HFAdapter)
    assert isinstance(get_hf_adapter("deepseek_v3", deepseek_v3_flavors["16B"]), DeepSeekV3HFAdapter)
    assert issubclass(registry.get_model_spec("llama3", "8B").hf_state_dict_adapter, HFStateDictAdapter)
    entry = registry._MODELS["llama3"]
    monkeypatch.setitem(registry._MODELS, "no_hf", dataclasses.replace(entry, name="no_hf", hf_state_dict_adapter=None))
    with pytest.raises(ValueError, match="'no_hf' has no Hugging Face state-dict adapter"):
        get_hf_adapter("no_hf", llama3_flavors["8B"])


# ---------------------------------------------------------------------------------------------
# 6. real flavors: transformers builds our config.json; its on-disk names/shapes are to_hf's


@pytest.mark.parametrize("name,flavor", [("llama3", "8B"), ("deepseek_v3", "16B"), ("deepseek_v3", "671B")])
def test_real_flavor_config_builds_transformers_model_with_our_names(name, flavor):
    from transformers.core_model_loading import revert_weight_conversion

    ours = build_model(name, flavor, device="meta")
    adapter = get_hf_adapter(name, ours.args)
    config = AutoConfig.for_model(**adapter.hf_config())
    with torch.device("meta"):
        theirs = AutoModelForCausalLM.from_config(config)
    assert type(theirs).__name__ == adapter.hf_architecture
    # transformers' own in-memory -> on-disk conversion (what save_pretrained writes)
    on_disk = revert_weight_conversion(theirs, theirs.state_dict())
    want = {k: tuple(v.shape) for k, v in on_disk.items()}
    got = {k: tuple(v.shape) for k, v in adapter.to_hf(ours.state_dict()).items()}
    assert got == want
    assert got == adapter.hf_keys()
