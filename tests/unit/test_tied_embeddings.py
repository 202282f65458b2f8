"""Tied input/output embeddings (``tie_word_embeddings``, models/common/decoder.py)."""

from __future__ import annotations

import json

import pytest
import torch

from models.registry import build_model
from tests.hf_published import LLAMA32_1B

pytestmark = pytest.mark.unit

_TINY = dict(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16, max_seq_len=16)


def _tiny(tied: bool, device: str = "cpu"):
    m = build_model("llama3", "debugmodel", device=device, tie_word_embeddings=tied, **_TINY)
    return m


def test_one_parameter_for_both_uses_survives_materialization():
    """Tied, the head's weight is the embedding's Parameter, listed once by named_parameters,
    and stays one object through ``to_empty`` and ``to(dtype)`` (nn.Module._apply converts each
    slot separately) and init; its gradient is the sum of both uses. One layer of width 32
    suffices: the tie is structural."""
    m = _tiny(True, "meta")
    assert m.output.weight is m.tok_embeddings.weight
    m.to_empty(device="cpu")
    m.init_weights(0)
    assert m.output.weight is m.tok_embeddings.weight
    names = [n for n, _ in m.named_parameters()]
    assert "tok_embeddings.weight" in names and "output.weight" not in names
    untied = _tiny(False)
    assert sum(p.numel() for p in untied.parameters()) - sum(p.numel() for p in m.parameters()) == 64 * 32
    tokens = torch.randint(0, 64, (2, 8))
    m(tokens).float().square().mean().backward()
    grad_tied = m.tok_embeddings.weight.grad.clone()
    # the same computation with two separate copies of the weight: the tied grad is the sum
    untied.load_state_dict({k: v for k, v in m.state_dict().items()})
    untied.zero_grad()
    untied(tokens).float().square().mean().backward()
    want = untied.tok_embeddings.weight.grad + untied.output.weight.grad
    torch.testing.assert_close(grad_tied, want, rtol=1e-6, atol=1e-7)
    # negative control: the head's grad alone is not the tied grad
    assert not torch.allclose(grad_tied, untied.output.weight.grad, rtol=1e-3, atol=1e-6)
    m.to(torch.bfloat16)
    assert m.output.weight is m.tok_embeddings.weight and m.output.weight.dtype == torch.bfloat16


def test_untied_by_default():
    m = _tiny(False, "meta")
    assert m.output.weight is not m.tok_embeddings.weight


def test_bad_tie_value_is_refused():
    with pytest.raises(ValueError, match="tie_word_embeddings must be true or false"):
        build_model("llama3", "debugmodel", tie_word_embeddings="yes", **_TINY)


# ---------------------------------------------------------------------------------------------
# Hugging Face: a small random Llama-3.2-shaped tied model (RoPE scaling factor 32), fp32

# Llama 3.2 1B's published config.json (meta-llama/Llama-3.2-1B): tests/hf_published.py
LLAMA32_1B_CONFIG = LLAMA32_1B
LLAMA32_1B_PARAMS = 1_235_814_400

# ours as overrides of llama3/debugmodel; head_dim 16 with theta 5e5 puts RoPE frequencies on
# both sides of the scaling band, so the factor (32 vs 8) changes the logits
SMALL = dict(
    dim=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    vocab_size=128,
    multiple_of=32,
    max_seq_len=64,
    tie_word_embeddings=True,
    rope_scaling_factor=32.0,
)
SEQ = 48


def _hf_tied_model():
    transformers = pytest.importorskip("transformers")
    from tests.hf_models import LLAMA3_ROPE, llama_config, randomize_hf_

    cfg = llama_config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_parameters={"rope_theta": 500000.0, **LLAMA3_ROPE, "factor": 32.0},
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    randomize_hf_(model, 1)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


def _saved(model, path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    model.save_pretrained(path, safe_serialization=True)
    sd = {}
    for f in sorted(path.glob("*.safetensors")):
        sd.update(safetensors_torch.load_file(str(f)))
    return sd, json.loads((path / "config.json").read_text())


def _logits(model, tokens, hf: bool = False):
    with torch.no_grad():
        out = model(input_ids=tokens, use_cache=False).logits if hf else model(tokens)
    return out.float()


def _close(a, b) -> bool:
    return torch.allclose(a, b, rtol=1e-5, atol=1e-5)


def test_hf_tied_llama32_import_export_round_trip(tmp_path):
    """transformers' tied Llama (saved without lm_head) -> ours: logits within rtol/atol 1e-5
    (SDPA vs eager summation order, RoPE tables in float64 there); ours -> HF folder -> from_pretrained
    (no missing/unexpected key, tie_word_embeddings true, one tensor for both uses): same logits;
    HF -> ours -> HF bitwise. Negative controls: RoPE factor 8 instead of 32, and an untied head,
    each break the logits. Two layers of width 64 and 48 tokens exercise every mapped tensor."""
    from models.common.hf_adapter import HFConfigMismatch
    from models.registry import get_hf_adapter

    hf = _hf_tied_model()
    hf_sd, config = _saved(hf, tmp_path / "hf")
    assert "lm_head.weight" not in hf_sd and config["tie_word_embeddings"] is True
    ours = build_model("llama3", "debugmodel", device="cpu", **SMALL)
    adapter = get_hf_adapter("llama3", ours.args)
    adapter.check_hf_config(config)
    assert set(hf_sd) == set(adapter.hf_keys())
    sd = adapter.from_hf(hf_sd)
    assert sd["output.weight"] is sd["tok_embeddings.weight"]
    ours.load_state_dict(sd, strict=True)
    assert ours.output.weight is ours.tok_embeddings.weight
    tokens = torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(7))
    theirs = _logits(hf, tokens, hf=True)
    assert theirs.abs().max() > 0.1
    torch.testing.assert_close(_logits(ours, tokens), theirs, rtol=1e-5, atol=1e-5)

    # negative controls: Llama 3.1's factor 8; a head of its own (untied, other values)
    wrong_rope = build_model("llama3", "debugmodel", device="cpu", **{**SMALL, "rope_scaling_factor": 8.0})
    wrong_rope.load_state_dict(sd, strict=True)
    assert not _close(_logits(wrong_rope, tokens), theirs)
    with pytest.raises(HFConfigMismatch, match="rope_scaling"):
        get_hf_adapter("llama3", wrong_rope.args).check_hf_config(config)
    untied = build_model("llama3", "debugmodel", device="cpu", **{**SMALL, "tie_word_embeddings": False})
    untied.load_state_dict({**sd, "output.weight": sd["output.weight"].roll(1, 0)}, strict=True)
    assert not _close(_logits(untied, tokens), theirs)
    with pytest.raises(HFConfigMismatch, match="tie_word_embeddings=True in config.json vs False"):
        get_hf_adapter("llama3", untied.args).check_hf_config(config)

    # export: one tensor, config says tied, transformers loads it with nothing missing
    out = adapter.to_hf(ours.state_dict())
    assert "lm_head.weight" not in out
    assert set(out) == set(hf_sd) and all(torch.equal(out[k], hf_sd[k]) for k in hf_sd)  # HF -> ours -> HF
    export = tmp_path / "export"
    export.mkdir()
    safetensors_torch = pytest.importorskip("safetensors.torch")
    safetensors_torch.save_file({k: v.contiguous() for k, v in out.items()}, str(export / "model.safetensors"))
    hf_config = adapter.hf_config("float32")
    assert hf_config["tie_word_embeddings"] is True and hf_config["rope_scaling"]["factor"] == 32.0
    (export / "config.json").write_text(json.dumps(hf_config))
    from transformers import AutoModelForCausalLM

    loaded, info = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    torch.testing.assert_close(_logits(loaded.eval(), tokens, hf=True), _logits(ours, tokens), rtol=1e-5, atol=1e-5)


def test_hf_tied_checkpoint_with_lm_head():
    """A tied checkpoint that also stores lm_head.weight loads when it equals the embedding and
    is refused (naming the key and the fix) when it does not; an untied model refuses to
    export a head that differs from its embedding as tied. Shapes: the tiny SMALL model."""
    from models.registry import get_hf_adapter

    ours = build_model("llama3", "debugmodel", device="cpu", **SMALL)
    ours.init_weights(0)
    adapter = get_hf_adapter("llama3", ours.args)
    hf_sd = adapter.to_hf(ours.state_dict())
    with_head = {**hf_sd, "lm_head.weight": hf_sd["model.embed_tokens.weight"].clone()}
    back = adapter.from_hf(with_head)
    assert torch.equal(back["output.weight"], ours.tok_embeddings.weight)
    with_head["lm_head.weight"] = with_head["lm_head.weight"] + 1
    with pytest.raises(ValueError, match="'lm_head.weight' different from the tensor it is tied to"):
        adapter.from_hf(with_head)
    sd = dict(ours.state_dict())
    sd["output.weight"] = sd["output.weight"] + 1
    with pytest.raises(ValueError, match="'output.weight' differs from 'tok_embeddings.weight'"):
        adapter.to_hf(sd)


def test_published_llama32_1b_config_and_parameter_count():
    """Llama 3.2 1B's published config.json passes the config check against our 1B flavor
    (which flavor inference also picks), and the flavor built on meta has exactly the published
    1,235,814,400 parameters (one tensor for embedding and head). The 3B flavor is tied too."""
    from models.llama3 import llama3_flavors
    from models.llama3.hf_adapter import Llama3HFAdapter

    assert Llama3HFAdapter.infer_flavor(LLAMA32_1B_CONFIG, llama3_flavors) == "1B"
    Llama3HFAdapter(llama3_flavors["1B"]).check_hf_config(LLAMA32_1B_CONFIG)
    model = build_model("llama3", "1B", device="meta")
    assert sum(p.numel() for p in model.parameters()) == LLAMA32_1B_PARAMS
    assert model.output.weight is model.tok_embeddings.weight
    three = llama3_flavors["3B"]
    assert (three.dim, three.n_layers, three.n_heads, three.kv_heads, three.ffn_hidden_dim) == (3072, 28, 24, 8, 8192)
    assert three.tie_word_embeddings and three.rope_scaling_factor == 32.0
    # our own export of the 1B flavor describes the same model
    Llama3HFAdapter(llama3_flavors["1B"]).check_hf_config(Llama3HFAdapter(llama3_flavors["1B"]).hf_config())


# ---------------------------------------------------------------------------------------------
# layouts a tied model refuses


def test_layout_rules_for_tied_embeddings():
    """Tied embeddings need a vocabulary tp divides (the embedding and head share one
    Shard(0) tensor): one ValueError naming the fix; tp=2 x pp=2 with a vocabulary tp divides
    passes, pp=4 passes (the embedding group is pp ranks 0 and 3), and the untied model passes
    what the tied one refuses (control)."""
    from parallel_dims import ModelRules, check_model_layout, validate_degrees

    tp2, pp4, both = (
        validate_degrees(world_size=n, **d) for n, d in ((2, {"tp": 2}), (4, {"pp": 4}), (4, {"tp": 2, "pp": 2}))
    )
    with pytest.raises(ValueError, match=r"tp=2 does not divide vocab_size=1001 .* multiple of 2 \(e.g. 1002\)"):
        check_model_layout(tp2, ModelRules(vocab_size=1001, tied_embeddings=True))
    check_model_layout(pp4, ModelRules(vocab_size=1002, tied_embeddings=True))
    check_model_layout(both, ModelRules(vocab_size=1002, tied_embeddings=True))
    check_model_layout(both, ModelRules(vocab_size=1001, tied_embeddings=False))
    check_model_layout(pp4, ModelRules(vocab_size=1001, tied_embeddings=False))


def test_tied_vocab_tp_refused_on_the_command_line(tmp_path):
    """``python -m trainer.plan_report --config`` (the trainer's job plan) with the tied 1B flavor and a
    vocabulary of 2049 on tp=2: exit 2 and one line naming the rule and the fix, no traceback."""
    from tests.distributed.run_json import ROOT, run_module_on_own_process

    text = (ROOT / "train_configs" / "llama3.toml").read_text()
    assert 'flavor = "debugmodel"' in text
    config = tmp_path / "tied.toml"
    config.write_text(text.replace('flavor = "debugmodel"', 'flavor = "1B"\nvocab_size = 2049', 1))
    res = run_module_on_own_process("trainer.plan_report", "--config", str(config), "--world-size", "2", "--tp", "2")
    assert res.returncode == 2, res.stderr[-2000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "tp=2 does not divide vocab_size=2049" in lines[0] and "Traceback" not in res.stderr


def test_tied_folder_to_dcp_and_back(tmp_path):
    """The converter's two directions (scripts/convert_hf.py to-dcp / to-hf) on a tied folder:
    HF -> DCP -> HF float32 gives back every tensor bit for bit, still without lm_head.weight,
    and a config.json that says tied. The tiny SMALL shapes: the path is per tensor."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    from models.registry import get_hf_adapter
    from trainer.checkpoint.convert import convert_hf_to_dcp
    from trainer.checkpoint.hf_write import export_dcp_to_hf

    hf = _hf_tied_model()
    hf_sd, _ = _saved(hf, tmp_path / "hf")
    args = build_model("llama3", "debugmodel", device="meta", **SMALL).args
    get_hf_adapter("llama3", args)  # registered adapter
    convert_hf_to_dcp(str(tmp_path / "hf"), str(tmp_path / "dcp"), "llama3", args)
    export_dcp_to_hf(str(tmp_path / "dcp"), str(tmp_path / "back"), "llama3", args, dtype="float32")
    back = {}
    for f in sorted((tmp_path / "back").glob("*.safetensors")):
        back.update(safetensors_torch.load_file(str(f)))
    assert set(back) == set(hf_sd) and all(torch.equal(back[k], hf_sd[k]) for k in hf_sd)
    assert json.loads((tmp_path / "back" / "config.json").read_text())["tie_word_embeddings"] is True


def test_compute_copies_keep_one_copy_for_tied_weights():
    """The bf16 compute copies of the one-GPU / pure-TP path (models/parallel/mixed_precision.py)
    put ONE copy in both slots of the tied weight, and its gradient (both uses, summed by
    autograd in bf16) reaches the fp32 master once: bitwise the gradient of the same model cast
    to bf16 as a whole (the same bf16 ops on the same shapes), and it holds the head's share
    (rows of tokens absent from the batch, which the embedding's use leaves at zero, are not).
    Tiny shapes: the property is structural."""
    from models.parallel.mixed_precision import apply_compute_copies

    model = _tiny(True)
    model.init_weights(0)
    ref = _tiny(True)
    ref.load_state_dict(model.state_dict())
    ref.to(torch.bfloat16)
    handle = apply_compute_copies(model, "bfloat16")
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(3))
    out = model(tokens)
    assert handle.installed and model.output.weight is model.tok_embeddings.weight
    assert model.output.weight.dtype == torch.bfloat16
    out.float().square().mean().backward()
    assert not handle.installed and model.output.weight is model.tok_embeddings.weight
    ref(tokens).float().square().mean().backward()
    master_grad = model.tok_embeddings.weight.grad
    assert master_grad.dtype == torch.float32
    assert torch.equal(master_grad, ref.tok_embeddings.weight.grad.float())
    # the head's share is there: rows the lookup never touched have a gradient
    rows = torch.zeros(64, dtype=torch.bool)
    rows[tokens.flatten()] = True
    assert not torch.equal(master_grad[~rows], torch.zeros_like(master_grad[~rows]))


def test_hf_folder_loads_into_both_pipeline_ends(tmp_path):
    """A tied Hugging Face folder (no lm_head.weight) loads into pipeline stages (the trainer's
    checkpoint.initial_load_in_hf path, trainer/checkpoint/hf_load.py): the first stage's
    embedding and the last stage's copy of it (output.weight) both equal
    model.embed_tokens.weight, bit for bit. Both stages on one process: the loader works per
    part; the SMALL shapes suffice (per tensor)."""
    import copy

    from models.parallel.pipeline.split import _carve_stage
    from trainer.checkpoint.hf_load import load_hf_into_model

    hf_sd, _ = _saved(_hf_tied_model(), tmp_path / "hf")
    full = build_model("llama3", "debugmodel", device="meta", **SMALL)
    first = _carve_stage(copy.deepcopy(full), (0, 1), True, False)
    last = _carve_stage(copy.deepcopy(full), (1, 2), False, True)
    for stage in (first, last):
        stage.to_empty(device="cpu")
        stage.init_weights(0)
    assert torch.equal(first.tok_embeddings.weight, last.output.weight)  # the copy is drawn as the embedding
    load_hf_into_model([first, last], str(tmp_path / "hf"), "llama3", full.args)
    emb = hf_sd["model.embed_tokens.weight"]
    assert torch.equal(first.tok_embeddings.weight, emb) and torch.equal(last.output.weight, emb)
