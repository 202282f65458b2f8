"""LoRA (models/parallel/lora.py) against Hugging Face PEFT on the same transformers model and
weights, and the PEFT export's names and layouts (trainer/checkpoint/lora_export.py).

Our model is loaded from a small random transformers model (Llama 3 and Qwen3) through the
model's Hugging Face adapter; both sides get the same random adapters (ours set directly, PEFT's
through our PEFT export's tensors and ``set_peft_model_state_dict``, as ``PeftModel.from_pretrained``
loads them). Compared: logits, and the gradients of every A and B under one scalar loss, fp32.

Tolerance: logits elementwise 1e-5 relative with 1e-5 absolute on values of order 1; each
gradient tensor 1e-5 relative in norm (``||ours - peft|| / ||peft||``; elementwise, a gradient
element near zero is a cancellation of terms of the tensor's scale, so its own relative error
says nothing). The two implementations
sum in different orders (SDPA vs eager attention, RoPE tables in float64 vs float32), as in
tests/unit/test_hf_adapters.py. Negative controls: B's rows left in our interleaved rotary
layout for q/k (a forgotten permutation), and PEFT's rank-stabilized scale (alpha / sqrt(r)),
each fail the logits comparison. Measured: logits within 8.3e-7 absolute (Llama 3) and 7.2e-7
(Qwen3); gradients within 1.0e-6 and 8.8e-7 relative in norm.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.unit

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from models.common.hf_adapter import RopeRows, interleaved_to_half_split  # noqa: E402
from models.parallel.lora import (  # noqa: E402
    LoRAOptions,
    check_lora,
    convert_to_lora,
    is_adapter_key,
    lora_decisions,
)
from models.registry import build_model, get_hf_adapter, get_model_spec  # noqa: E402
from tests.hf_models import llama_config, randomize_hf_  # noqa: E402
from trainer.checkpoint.lora_export import merge_adapters, peft_config, peft_tensors  # noqa: E402

RTOL = ATOL = 1e-5
SEQ = 24
OPTS = LoRAOptions(rank=4, alpha=8.0)

LLAMA_OURS = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, multiple_of=32, max_seq_len=64)
LLAMA_HF = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=192,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
QWEN_OURS = dict(
    dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, hidden_dim=96, vocab_size=128, max_seq_len=64
)
QWEN_HF = dict(
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


def _pair(name: str, tmp_path=None):
    """(transformers model, our model with the same weights), fp32, both in train mode with
    dropout 0 (the adapters' dropout is 0 too). DeepSeek-V3 (MLA with a q low-rank, 2 dense + 2
    MoE blocks, the shapes of tests/unit/test_hf_adapters.py) goes through a saved folder: the
    on-disk format holds its experts one by one."""
    if name == "llama3":
        hf = transformers.LlamaForCausalLM(llama_config(**LLAMA_HF))
        overrides = LLAMA_OURS
    elif name == "qwen3":
        hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**QWEN_HF))
        overrides = QWEN_OURS
    else:
        from tests.unit.test_hf_adapters import DS_OURS, DS_VARIANTS, _ds_hf

        cfg, cls = _ds_hf("v3_qlora")
        torch.manual_seed(0)
        hf = cls(cfg)
        overrides = {**DS_OURS, **DS_VARIANTS["v3_qlora"][0]}
    randomize_hf_(hf, 1)
    hf = hf.float()
    ours = build_model(name, "debugmodel", device="cpu", **overrides)
    adapter = get_hf_adapter(name, ours.args)
    if name == "deepseek_v3":
        from safetensors.torch import load_file

        hf.save_pretrained(tmp_path)
        sd = {k: v for f in sorted(tmp_path.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    else:
        sd = hf.state_dict()
    ours.load_state_dict(adapter.from_hf(sd), strict=True)
    return hf, ours, adapter


def _random_adapters(model) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if is_adapter_key(n):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return {n: p.detach().clone() for n, p in model.named_parameters() if is_adapter_key(n)}


def _peft(hf, tensors, *, use_rslora: bool = False):
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    cfg = peft_config(
        OPTS, sorted({k[len("base_model.model.") : -len(".lora_A.weight")] for k in tensors if "lora_A" in k})
    )
    lcfg = LoraConfig(
        r=cfg["r"], lora_alpha=cfg["lora_alpha"], lora_dropout=0.0, target_modules=cfg["target_modules"],
        use_rslora=use_rslora,
    )  # fmt: skip
    model = get_peft_model(hf, lcfg)
    result = set_peft_model_state_dict(model, dict(tensors))
    assert not result.unexpected_keys
    return model


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error of a whole tensor: ||a - b|| / ||b||."""
    return float((a - b).norm() / b.norm())


def _loss(logits: torch.Tensor) -> torch.Tensor:
    w = torch.randn(logits.shape, generator=torch.Generator().manual_seed(9))
    return (logits * w).sum()


@pytest.mark.parametrize("name", ["llama3", "qwen3", "deepseek_v3"])
def test_forward_and_adapter_grads_match_peft(name, tmp_path):
    hf, ours, adapter = _pair(name, tmp_path)
    if name == "deepseek_v3":
        # PEFT moves feed-forward adapters of an MoE model onto its fused experts (refused by the
        # export, see test_peft_refusals): MLA's q_a q_b kv_a kv_b o projections
        report = convert_to_lora(ours, LoRAOptions(rank=4, alpha=8.0, target_modules=("attention.*",)))
        assert len(report.adapted) == 4 * 5
    else:
        report = convert_to_lora(ours, OPTS)
        assert len(report.adapted) == 2 * 7  # q k v o + gate up down per layer
    adapters = _random_adapters(ours)
    tensors = peft_tensors(adapters, adapter)
    model = _peft(hf, tensors)
    tokens = torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(7))
    if name == "deepseek_v3":  # in eval mode: transformers' MoE has no training-only aux path then
        model.eval(), ours.eval()

    theirs = model(input_ids=tokens, use_cache=False).logits
    mine = ours(tokens)
    assert theirs.abs().max() > 0.1
    torch.testing.assert_close(mine, theirs, rtol=RTOL, atol=ATOL)
    _loss(theirs).backward()
    _loss(mine).backward()

    # every base parameter frozen on our side: no gradient at all
    assert all(p.grad is None for n, p in ours.named_parameters() if not is_adapter_key(n))
    peft_params = dict(model.named_parameters())
    compared, worst = 0, 0.0
    for key, p in ours.named_parameters():
        if not is_adapter_key(key):
            continue
        owner, ab = key.rsplit(".", 1)
        entry = adapter._entry(owner + ".weight")
        module = "base_model.model." + entry.hf[: -len(".weight")]
        g = peft_params[f"{module}.lora_{ab[-1].upper()}.default.weight"].grad
        mine_g = p.grad
        if ab == "lora_b" and isinstance(entry, RopeRows):
            mine_g = interleaved_to_half_split(mine_g, entry.n_heads)
        assert mine_g.abs().max() > 0
        worst = max(worst, _rel(mine_g, g))
        compared += 1
    assert worst <= RTOL, worst
    assert compared == 2 * len(report.adapted)


def test_negative_controls_fail_the_logit_comparison():
    _, ours, adapter = _pair("llama3")
    convert_to_lora(ours, OPTS)
    adapters = _random_adapters(ours)
    tokens = torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        mine = ours(tokens)
    good = peft_tensors(adapters, adapter)
    # q/k B rows without the rotary permutation
    unpermuted = dict(good)
    for key, t in adapters.items():
        if key.endswith("attention.wq.lora_b"):
            layer = key.split(".")[1]
            unpermuted[f"base_model.model.model.layers.{layer}.self_attn.q_proj.lora_B.weight"] = t
    for tensors, kw in ((unpermuted, {}), (good, {"use_rslora": True})):
        hf_copy, _, _ = _pair("llama3")
        with torch.no_grad():
            theirs = _peft(hf_copy, tensors, **kw)(input_ids=tokens, use_cache=False).logits
        assert not torch.allclose(mine, theirs, rtol=RTOL, atol=ATOL)


def test_targets_freeze_and_merge():
    """Default targets are every attention and feed-forward projection (never the head or a
    router); everything else is frozen; the merged weight is W + scale * B @ A bitwise."""
    model = build_model("deepseek_v3", "debugmodel", device="meta", n_layers=2)
    decisions = lora_decisions(model, OPTS)
    assert decisions["output"] == "the output projection"
    assert decisions["layers.1.moe.router.gate"] == "a MoE router"
    assert decisions["layers.1.moe.shared_experts.w1"] is None and decisions["layers.0.attention.wkv_a"] is None
    report = convert_to_lora(model, LoRAOptions(rank=4, alpha=8.0, experts=True))
    assert report.experts == ["layers.1.moe.experts"]
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(is_adapter_key(n) for n in trainable)
    assert "layers.1.moe.experts.w2_lora_a" in trainable
    w, a, b = torch.randn(6, 5), torch.randn(3, 5), torch.randn(6, 3)
    merged = merge_adapters({"x.weight": w, "x.lora_a": a, "x.lora_b": b}, 2.0)
    assert set(merged) == {"x.weight"}
    assert torch.equal(merged["x.weight"], w + torch.matmul(b, a) * 2.0)
    spec = get_model_spec("llama3", "debugmodel")
    with pytest.raises(ValueError, match="matches no linear"):
        check_lora(spec.model_cls, spec.args, LoRAOptions(target_modules=("nope",)))
    with pytest.raises(ValueError, match="has no routed experts"):
        check_lora(spec.model_cls, spec.args, LoRAOptions(experts=True))
    ds = get_model_spec("deepseek_v3", "debugmodel")
    check_lora(ds.model_cls, ds.args, LoRAOptions(experts=True))  # expert adapters split over etp too


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--lora.rank", "0"], "lora.rank must be a positive integer"),
        (["--lora.dropout", "1.5"], "lora.dropout must be in [0, 1)"),
        (["--lora.frozen_dtype", "bfloat16"], "set it to 'bfloat16'"),
        (["--lora.experts", "true"], "has no routed experts; set lora.experts = false"),
        (["--lora.target_modules", "nothing"], "matches no linear layer"),
        (["--model.converters", "lora,lorax"], "model.converters entry"),
        (["--comm.mode", "local_tensor", "--checkpoint.initial_load_path", "x"], "with real processes"),
    ],
)
def test_bad_lora_config_is_one_line(args, needle):
    """Bad [lora] input: one ConfigError line naming the key and the fix (train.py prints it
    and exits 2, trainer/runtime/cli_errors.py)."""
    from trainer.config import ConfigError, load_config
    from trainer.plan import plan_job

    with pytest.raises(ConfigError) as info:
        cfg = load_config(["--config", "llama3.toml", "--model.converters", "lora", *args])
        plan_job(cfg, 1, tokenizer_vocab=2048)
    assert needle in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_float8_base_with_adapters():
    """``model.converters = ["float8", "lora"]``: the adapters sit on torchao's ``Float8Linear``
    modules (float8 GEMMs on the frozen base), each adapted layer's output is bitwise the float8
    layer's own plus ``scale * B(A(x))`` (the same kernels both ways), and only the adapters get
    gradients."""
    pytest.importorskip("torchao.float8")
    from torchao.float8.float8_linear import Float8Linear

    from models.parallel.float8 import Float8Options, convert_to_float8

    torch.manual_seed(0)
    model = build_model("llama3", "debugmodel", device="cpu", n_layers=1)
    model.init_weights(0)
    convert_to_float8(model, Float8Options(), fsdp_all_gather=False)
    convert_to_lora(model, OPTS)
    _random_adapters(model)
    wq = model.layers["0"].attention.wq
    assert isinstance(wq, Float8Linear) and wq.lora_a.requires_grad and not wq.weight.requires_grad
    x = torch.randn(2, 8, wq.in_features)
    with torch.no_grad():
        got = wq(x)
        base = Float8Linear.forward(wq, x)
        want = base + torch.nn.functional.linear(torch.nn.functional.linear(x, wq.lora_a), wq.lora_b) * OPTS.scale
    assert torch.equal(got, want)
    assert not torch.allclose(got, base)
    model(torch.randint(0, 2048, (1, 16))).sum().backward()
    grads = {n for n, p in model.named_parameters() if p.grad is not None}
    assert grads == {n for n, _ in model.named_parameters() if is_adapter_key(n)}


def test_expert_adapters_merge_into_the_experts():
    """Per-expert adapters (DeepSeek-V3 debug, 2 layers, one MoE block): the adapted model's
    logits equal a plain model's holding ``merge_adapters`` of its state (what the merged export
    writes) within 1e-6 relative (fp32; the merge sums ``W + s B A`` once in float32 where the
    forward adds it in the compute path); the adapters have no PEFT form (one clear error)."""
    model = build_model("deepseek_v3", "debugmodel", device="cpu", n_layers=2)
    model.init_weights(0)
    convert_to_lora(model, LoRAOptions(rank=4, alpha=8.0, experts=True))
    _random_adapters(model)
    plain = build_model("deepseek_v3", "debugmodel", device="cpu", n_layers=2)
    merged = merge_adapters(model.state_dict(), 2.0)
    plain.load_state_dict(merged, strict=True)
    tokens = torch.randint(0, 2048, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b, base = model(tokens), plain(tokens), build_model("deepseek_v3", "debugmodel", device="cpu", n_layers=2)
        base.init_weights(0)
        c = base(tokens)
    assert _rel(a, b) < 1e-6 and _rel(a, c) > 1e-3, (_rel(a, b), _rel(a, c))
    with pytest.raises(ValueError, match="no PEFT form"):
        peft_tensors(
            {k: v for k, v in model.state_dict().items() if is_adapter_key(k)},
            get_hf_adapter("deepseek_v3", model.args),
        )


def test_peft_refusals():
    """Adapters PEFT would load wrongly have no PEFT folder (one clear reason each): per-expert
    adapters, and feed-forward adapters of an MoE model (PEFT 0.21 renames gate/up/down_proj
    targets of transformers 5 MoE models onto the fused routed experts); attention adapters of
    the same model and dense models' feed-forward adapters are fine."""
    from trainer.checkpoint.lora_export import peft_refusal

    ds = get_model_spec("deepseek_v3", "debugmodel").args
    llama = get_model_spec("llama3", "debugmodel").args
    assert "fused routed experts" in peft_refusal(["layers.0.feed_forward.w1.lora_a"], ds)
    assert "fused routed experts" in peft_refusal(["layers.1.moe.shared_experts.w2.lora_b"], ds)
    assert "per-expert" in peft_refusal(["layers.1.moe.experts.w2_lora_b"], ds)
    assert peft_refusal(["layers.1.attention.wkv_a.lora_a"], ds) is None
    assert peft_refusal(["layers.0.feed_forward.w1.lora_a"], llama) is None
