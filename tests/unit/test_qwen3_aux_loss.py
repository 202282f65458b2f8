"""Qwen3-MoE's load-balancing auxiliary loss (``router_aux_loss_coef``) against ``transformers``'
``load_balancing_loss_func`` on the same router logits (fp32, small random configs, no downloads).

Our statistic (docs/models.md, "The MoE aux losses") is the Switch loss
``E * sum_e (count_e / T) * P_e`` of ONE layer over ONE sequence, averaged over the sequences
of the step and over the MoE layers, times the coefficient; transformers pools the counts and
probabilities over every token of the batch it is given and over all layers at once. The two
agree exactly where the pools are one sequence and one layer, so:

* value: for a 3-layer model on a batch of 3 sequences, the aux loss ours reports equals
  ``coef * mean_b mean_l load_balancing_loss_func((logits_{l,b},), E, k)`` on transformers'
  own router logits of the same weights (1e-5 relative: the router logits of the two models
  differ by float32 summation order, ~1e-7, the selections are the same discrete picks);
* model: a 1-layer model on 1 sequence reports exactly transformers' ``coef * aux_loss``, and
  the gradient of the loss (cross entropy + aux) on the router gate equals transformers'
  ``loss.backward()`` within 1e-5 of its largest entry (the aux loss gets its gradient inside
  the MoE, ``_AuxLossGrad``; coefficient 1 so its share of the gate gradient is large);
* negative controls: DeepSeek's sequence form without Qwen3's ``k / n_layers`` scaling, and
  transformers' batch-and-layer pooled value, are both off by far more than the tolerance; the
  gradient without the aux loss misses transformers' by orders of magnitude more than 1e-5.

Shapes as tests/unit/test_qwen3.py (dim 64, 4 heads of width 32 over 2 KV heads, 8 experts top
2, norm_topk_prob): about a second in all.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func  # noqa: E402

from models.registry import build_model, get_hf_adapter  # noqa: E402
from tests.hf_models import randomize_hf_  # noqa: E402

RTOL = 1e-5
SEQ, E, K, VOCAB = 24, 8, 2, 128
OURS = dict(dim=64, n_heads=4, n_kv_heads=2, head_dim=32, hidden_dim=96, vocab_size=VOCAB, max_seq_len=64)
OURS_MOE = dict(n_routed_experts=E, n_activated_experts=K, moe_inter_dim=32, norm_topk_prob=True)
HF = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=96,
    vocab_size=VOCAB,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=False,
    num_experts=E,
    num_experts_per_tok=K,
    moe_intermediate_size=32,
    norm_topk_prob=True,
)


def _pair(tmp_path, n_layers: int, coef: float):
    """transformers' Qwen3-MoE with random weights, and ours loaded from its saved folder."""
    config = Qwen3MoeConfig(**HF, num_hidden_layers=n_layers, router_aux_loss_coef=coef, output_router_logits=True)
    torch.manual_seed(0)
    hf = Qwen3MoeForCausalLM(config).float()
    randomize_hf_(hf, 1)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    sd = {}
    for f in sorted(tmp_path.glob("*.safetensors")):
        sd.update(safetensors_torch.load_file(str(f)))
    ours = build_model("qwen3", "debugmodel_moe", device="cpu", n_layers=n_layers, router_aux_loss_coef=coef, **OURS,
                       **OURS_MOE)  # fmt: skip
    adapter = get_hf_adapter("qwen3", ours.args)
    adapter.check_hf_config(json.loads((tmp_path / "config.json").read_text()))
    ours.load_state_dict(adapter.from_hf(sd), strict=True)
    return hf, ours


def _tokens(batch: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(7))


def _our_loss(model, tokens: torch.Tensor, backward: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(cross entropy, reported aux loss) as the trainer computes them (trainer/forward.py):
    the divisor is the batch's sequence count, the aux gradient comes from inside the MoE."""
    moes = model.moe_layers()
    for moe in moes:
        moe.aux_loss_sequences = tokens.shape[0]
        moe.aux_loss_total.zero_()
    logits = model(tokens)
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    if backward:
        ce.backward()
    return ce.detach(), sum(m.aux_loss_total for m in moes) / tokens.shape[0]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def test_value_is_the_per_sequence_per_layer_switch_loss(tmp_path):
    coef, batch, n_layers = 0.001, 3, 3  # k / n_layers != 1: the control below differs
    hf, ours = _pair(tmp_path, n_layers, coef)
    tokens = _tokens(batch)
    with torch.no_grad():
        out = hf(input_ids=tokens, use_cache=False, output_router_logits=True)
        _, aux = _our_loss(ours, tokens, backward=False)
    logits = [t.view(batch, SEQ, E) for t in out.router_logits]
    assert len(logits) == n_layers
    per = torch.stack(
        [torch.stack([load_balancing_loss_func((lg[b],), E, K) for b in range(batch)]) for lg in logits]
    )  # [layers, sequences]
    assert per.min() > K * 1.01  # unbalanced routing (k is the minimum, at perfect balance)
    want = coef * per.mean()
    assert _rel(aux, want) <= RTOL, (aux.item(), want.item())
    # negative controls: DeepSeek's form as it is (no k / n_layers), and transformers' pooled value
    deepseek_form = aux * n_layers / K
    pooled = coef * load_balancing_loss_func(tuple(out.router_logits), E, K)
    assert _rel(deepseek_form, want) > 100 * RTOL
    assert _rel(pooled, want) > 100 * RTOL, (pooled.item(), want.item())


def test_one_layer_one_sequence_equals_transformers_loss_and_gradient(tmp_path):
    coef = 1.0  # large, so the aux loss's share of the gate's gradient is large
    hf, ours = _pair(tmp_path, 1, coef)
    tokens = _tokens(1)
    out = hf(input_ids=tokens, labels=tokens, use_cache=False, output_router_logits=True)
    out.loss.backward()
    ce, aux = _our_loss(ours, tokens, backward=True)
    assert abs(aux.item() - coef * out.aux_loss.item()) <= RTOL * out.aux_loss.item()
    assert abs((ce + aux).item() - out.loss.item()) <= RTOL * out.loss.item()
    want = hf.model.layers[0].mlp.gate.weight.grad
    got = ours.layers["0"].moe.router.gate.weight.grad
    assert _rel(got, want) <= RTOL, _rel(got, want)
    # negative control: the cross entropy's gradient alone
    ours.zero_grad()
    ours.layers["0"].moe.aux_loss_coeff = 0.0
    _our_loss(ours, tokens, backward=True)
    assert _rel(ours.layers["0"].moe.router.gate.weight.grad, want) > 1e3 * RTOL
