"""The planner's step-time model for LoRA (tools/planner/compute.py with ``lora``): a frozen base
runs no weight-gradient GEMM (its backward is one forward, not two), nor the input gradient of
the linears that read the frozen embedding; each adapted linear adds its two small GEMMs forward
and four backward; per-expert adapters add their merge ``B @ A`` (forward, and the gradients of
both factors) and keep the routed experts' weight gradients (the merged weight needs one).

Proved three ways on one process (the LoRA debug models, fp32):

* the planner's forward and backward FLOPs equal a hand count written out from the Llama 3 debug
  shapes below;
* they equal what the step really computes: ``MatmulCensus`` counts every matmul-class op of a
  forward + backward of the converted model (Llama 3; DeepSeek-V3 with expert adapters under full
  activation checkpointing, where the recompute has its own rule: an adapted last projection's
  base GEMM and ``A`` are recomputed because the adapter saves tensors after them);
* negative control: the full fine-tune (``lora=None``) is priced at the hand count of a full
  backward (2 x forward), a different total, and the planner's compute seconds of the two jobs
  differ by exactly the ratio of the hand counts.

TP, EP and the expert merges split by ep are checked against the census of fake-backend ranks in
tests/distributed/test_planner_compute.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models.parallel.activation_checkpoint import apply_activation_checkpointing
from models.parallel.lora import LoRAOptions, convert_to_lora
from models.registry import build_model
from parallel_dims.layout import validate_degrees
from tools.planner.choice import LayoutChoice
from tools.planner.compute import rank_matmul_flops
from trainer.instruments.matmul_census import MatmulCensus

pytestmark = pytest.mark.unit

BATCH, SEQ, VOCAB, LAYERS, RANK = 2, 32, 512, 2, 4
OVERRIDES = dict(n_layers=LAYERS, vocab_size=VOCAB, max_seq_len=64)


def _census(model_name: str, opts: LoRAOptions | None, ac: str = "none") -> int:
    torch.manual_seed(0)
    model = build_model(model_name, "debugmodel", device="cpu", **OVERRIDES)
    if opts is not None:
        convert_to_lora(model, opts)
    model.init_weights(0)
    apply_activation_checkpointing(model, ac, "op")
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
    with MatmulCensus() as census:
        F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    return census.total_flops


def _planned(model_name: str, opts: LoRAOptions | None, ac: str = "none") -> dict:
    choice = LayoutChoice(global_batch=BATCH, local_batch=BATCH, seq_len=SEQ, ac=ac)
    return rank_matmul_flops(model_name, "debugmodel", validate_degrees(world_size=1), choice, lora=opts, **OVERRIDES)


def _hand_count_llama3() -> tuple[int, int, int]:
    """(forward, LoRA backward, full fine-tune backward) FLOPs of the Llama 3 debug model (dim 256,
    16 heads, 8 KV heads of 16, SwiGLU hidden 768, here 2 layers and a 512 vocabulary) on 2 x 32
    tokens with rank-4 adapters on all seven projections of each block."""
    dim, kv, hidden, t = 256, 8 * 16, 768, BATCH * SEQ
    # [out, in] of wq, wk, wv, wo, w1, w3, w2
    linears = [(dim, dim), (kv, dim), (kv, dim), (dim, dim), (hidden, dim), (hidden, dim), (dim, hidden)]
    block = sum(o * i for o, i in linears)
    adapters = sum(RANK * (o + i) for o, i in linears)  # A [r, in] + B [out, r]
    attention = 2 * BATCH * 16 * SEQ * SEQ * 2 * 16  # Q K^T and P V over the whole rectangle
    head = VOCAB * dim
    base_forward = LAYERS * (2 * t * block + attention) + 2 * t * head
    forward = base_forward + LAYERS * 2 * t * adapters
    # layer 0's wq, wk, wv read the frozen embedding: no input gradient for them or for their A
    entry, entry_a = dim * dim + 2 * kv * dim, 3 * RANK * dim
    lora_backward = (
        LAYERS * (2 * t * block + 2 * attention) + 2 * t * head - 2 * t * entry  # input gradients only
        + LAYERS * 4 * 2 * t * adapters // 2 - 2 * t * entry_a  # dA, dB, and their inputs' gradients
    )  # fmt: skip
    return forward, lora_backward, 2 * base_forward


def test_llama3_lora_flops_equal_the_hand_count_and_the_census():
    model = build_model("llama3", "debugmodel", device="meta", **OVERRIDES)
    assert tuple(model.layers["0"].feed_forward.w1.weight.shape) == (768, 256)  # the hand count's hidden
    forward, backward, _ = _hand_count_llama3()
    opts = LoRAOptions(rank=RANK)
    got = _planned("llama3", opts)
    assert (got["forward"], got["backward"], got["recompute"]) == (forward, backward, 0)
    assert _census("llama3", opts) == got["total"]


def test_full_fine_tune_is_priced_differently_by_the_expected_ratio():
    """Negative control: without LoRA the same model is priced at a full backward (2 x forward of
    the base, no adapters), and the planner's compute time of the LoRA job is the full one's
    times the ratio of the hand counts."""
    from tools.planner.estimate import Job, estimate
    from tools.planner.hardware import load_hardware

    forward, lora_backward, full_backward = _hand_count_llama3()
    full = _planned("llama3", None)
    base_forward = full_backward // 2
    assert (full["forward"], full["backward"]) == (base_forward, full_backward)
    assert full["total"] != forward + lora_backward
    ratio = (forward + lora_backward) / (base_forward + full_backward)
    assert 0.6 < ratio < 0.8  # backward ~1x forward for the frozen linears instead of 2x

    def compute_s(lora):
        job = Job(
            "llama3", "debugmodel", 1, 8, SEQ, BATCH, load_hardware("h100"), model_overrides=tuple(OVERRIDES.items()),
            lora=lora,
        )  # fmt: skip
        choice = LayoutChoice(global_batch=BATCH, local_batch=BATCH, seq_len=SEQ, param_dtype="bfloat16")
        return estimate(job, validate_degrees(world_size=1), choice).time["compute"]

    assert compute_s(LoRAOptions(rank=RANK)) == pytest.approx(ratio * compute_s(None), rel=1e-12)


@pytest.mark.parametrize("experts", [False, True], ids=["base-experts-frozen", "expert-adapters"])
def test_deepseek_v3_lora_full_ac_flops_equal_the_census(experts):
    """MLA (wq and wkv_a read the embedding), the router, frozen routed experts (input gradient
    only) or adapted ones (merge bmm, weight gradients kept), and full AC's recompute."""
    opts = LoRAOptions(rank=RANK, experts=experts)
    got = _planned("deepseek_v3", opts, "full")
    assert got["recompute"] > 0
    assert _census("deepseek_v3", opts, "full") == got["total"]
