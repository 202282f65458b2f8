"""The planner's Muon pricing (tools/planner/muon.py) against a hand count on the llama3 debug
model with 2 blocks under fsdp=2. Arithmetic only: no model runs.

Hand count. Debug model: dim 256, 16 heads of 16, 8 KV heads, FFN hidden 768 (4 x 256 x 2/3 =
682, rounded up to a multiple of 256); Muon takes the 7 matrices of each block (not the
embedding, head or norms): wq, wo 256 x 256; wk, wv 128 x 256; w1, w3 768 x 256; w2 256 x 768.
Newton-Schulz, 5 steps, per matrix with m <= n: 5 (4 m^2 n + 2 m^3) FLOPs:
256 x 256: 5 x 6 x 256^3 = 503,316,480; 128 x 256: 5 (4 x 128^2 x 256 + 2 x 128^3) = 104,857,600;
256 x 768: 5 (4 x 256^2 x 768 + 2 x 256^3) = 1,174,405,120. One block: 2 x 503,316,480 +
2 x 104,857,600 + 3 x 1,174,405,120 = 4,739,563,520; two blocks 9,479,127,040.
Elements: one block 2 x 65,536 + 2 x 32,768 + 3 x 196,608 = 786,432; each fsdp rank holds half
of two blocks' worth: 786,432.

- gather: each rank orthogonalises every matrix: 9,479,127,040 FLOPs; one all-gather per matrix
  of its whole float32 buffer (4 x 262,144 B, 4 x 131,072 B, 6 x 786,432 B).
- round_robin: longest first to the least-loaded of 2 ranks: the six FFN matrices 3 each, the
  four 256 x 256 2 each, the four 128 x 256 2 each: 4,739,563,520 FLOPs per rank (half); two
  all-to-all rounds of 4 x 786,432 = 3,145,728 B (the owned whole matrices = the local shards).
- state: one float32 buffer per local Muon element instead of AdamW's two: 3,145,728 B less.
Negative control: the gather scheme's count is not the round-robin's (the estimates differ by
the halved FLOPs), so a planner pricing both alike fails the round-robin assertion.
"""

from __future__ import annotations

import dataclasses

import pytest

from parallel_dims.layout import validate_degrees
from tools.planner.choice import LayoutChoice
from tools.planner.estimate import Job, estimate
from tools.planner.hardware import load_hardware
from tools.planner.inventory import model_inventory
from tools.planner.muon import muon_cost

BLOCK_FLOPS = 4_739_563_520
D = validate_degrees(world_size=2, dp_shard=2)
OVERRIDES = {"n_layers": 2, "max_seq_len": 2048}
STAGES = [(range(2), True, True)]


def _cost(scheme):
    return muon_cost("llama3", "debugmodel", OVERRIDES, D, 0, True, STAGES, scheme, 5)


def test_hand_count_shapes():
    params, _ = model_inventory("llama3", "debugmodel", **OVERRIDES)
    shapes = {p.fqn.split(".", 2)[2]: p.shape for p in params if p.layer == 0 and len(p.shape) == 2}
    assert shapes == {
        "attention.wq.weight": (256, 256), "attention.wk.weight": (128, 256), "attention.wv.weight": (128, 256),
        "attention.wo.weight": (256, 256), "feed_forward.w1.weight": (768, 256),
        "feed_forward.w2.weight": (256, 768), "feed_forward.w3.weight": (768, 256),
    }  # fmt: skip


def test_gather_scheme_hand_count():
    c = _cost("gather")
    assert c.local_numel == 786_432
    assert c.ns_flops == 2 * BLOCK_FLOPS
    got = {(r["kind"], r["bytes"]): r["count"] for r in c.comm}
    assert got == {
        ("all_gather", 4 * 32_768): 4,
        ("all_gather", 4 * 65_536): 4,
        ("all_gather", 4 * 196_608): 6,
    }
    assert all(r["group_size"] == 2 and r["axes"] == ("fsdp",) for r in c.comm)


def test_round_robin_hand_count_and_the_estimate():
    c = _cost("round_robin")
    assert c.local_numel == 786_432
    assert c.ns_flops == BLOCK_FLOPS  # half of the gather scheme's
    assert c.ns_flops != _cost("gather").ns_flops  # negative control
    assert [dict(r) for r in c.comm] == [
        {"kind": "all_to_all", "axes": ("fsdp",), "group_size": 2, "count": 2, "bytes": 3_145_728}
    ]
    # in the estimate: state memory, Newton-Schulz time at the float32 rate, the exchange
    hw = load_hardware("h100")
    choice = LayoutChoice(8, 4, 64, param_dtype="float32")
    base = Job("llama3", "debugmodel", 2, 8, 64, 8, hw, model_overrides=(("n_layers", 2),))
    adamw, muon = (estimate(dataclasses.replace(base, optimizer=o), D, choice) for o in ("AdamW", "Muon"))
    assert adamw.memory["optimizer"] - muon.memory["optimizer"] == 4 * 786_432
    ns_s = BLOCK_FLOPS / (hw.peak_flops("float32") * base.efficiency)
    assert muon.time["optimizer"] - adamw.time["optimizer"] == pytest.approx(ns_s, rel=1e-9)
    assert muon.time["comm"]["muon"] > 0 and "muon" not in adamw.time["comm"]
    assert muon.time["total"] > adamw.time["total"]
