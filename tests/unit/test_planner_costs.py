"""The planner's per-parameter and elementwise memory traffic, its published NCCL link figures,
and its choice of tensor parallelism inside a node (issue 39). Arithmetic only: no model runs."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from parallel_dims.layout import validate_degrees
from tools.planner.choice import LayoutChoice
from tools.planner.estimate import Job, estimate
from tools.planner.hardware import (
    LINKS,
    STEP_BYTES_PER_PARAM,
    TORCH_BASE_LATENCY_US,
    TORCH_INTER_NODE_BW_FACTOR,
    TORCH_INTER_NODE_HOP_US,
    TORCH_INTRA_NODE_GBPS,
    TORCH_INTRA_NODE_HOP_US,
    collective_seconds,
    gpu_names,
    load_hardware,
    step_bytes_per_param,
)

REPO = Path(__file__).resolve().parents[2]
H100 = load_hardware("h100")
TORCH_LINKS = {
    "intra_node_gbps": TORCH_INTRA_NODE_GBPS,
    "intra_node_hop_us": TORCH_INTRA_NODE_HOP_US,
    "inter_node_gbps": TORCH_INTRA_NODE_GBPS * TORCH_INTER_NODE_BW_FACTOR,
    "inter_node_hop_us": TORCH_INTER_NODE_HOP_US,
    "base_latency_us": TORCH_BASE_LATENCY_US,
}


def test_per_parameter_bytes_are_the_mixed_precision_recipe():
    """The recipe (fp32 masters, bf16 compute): cast 6, gradient cast 6, norm 4, clip 8, fused
    AdamW 28 = 52 bytes per local parameter; a float32 run has no casts (40). The estimate's
    optimizer time is exactly the rank's local parameters x those bytes / memory bandwidth, so
    bf16 over float32 is 52/40 on the same layout (negative control: the old 40-byte pricing of
    a bf16 run gives 40/40)."""
    assert STEP_BYTES_PER_PARAM == {"param_cast": 6, "grad_cast": 6, "grad_norm": 4, "clip": 8, "adamw": 28}
    assert step_bytes_per_param("bfloat16") == 52 and step_bytes_per_param("float32") == 40
    hw = dataclasses.replace(H100, memory_gbps=100.0)
    job = Job("llama3", "8B", 8, 8, 4096, 64, hw)
    d = validate_degrees(world_size=8, dp_replicate=8, dp_shard=1)
    bf16 = estimate(job, d, LayoutChoice(64, 8, 4096, ac="full", param_dtype="bfloat16")).time
    fp32 = estimate(job, d, LayoutChoice(64, 8, 4096, ac="full", param_dtype="float32")).time
    n_params = 8.03e9  # Llama 3 8B, replicated: every rank steps all of them
    assert bf16["optimizer"] == pytest.approx(n_params * 52 / 100e9, rel=0.01)
    assert bf16["optimizer"] / fp32["optimizer"] == pytest.approx(52 / 40)
    assert bf16["optimizer"] / fp32["optimizer"] != pytest.approx(40 / 40)


def test_elementwise_work_is_priced_per_pass_and_shard():
    """The memory-bound activation work (tools/planner/elementwise.py): forward + 2x backward
    without AC, one more forward of the blocks under full AC (the head is not recomputed), a
    quarter per rank under tp 4 with sequence parallelism (every term is split by tp: heads,
    hidden sizes, the vocabulary, the sequence shard), and it is part of the step's total.
    Llama 3 8B at 4096 tokens: shapes the formulas are written for; nothing runs."""
    from tools.planner.elementwise import BACKWARD_FACTOR, elementwise_bytes, layer_forward_bytes
    from tools.planner.inventory import model_inventory

    _, args = model_inventory("llama3", "8B")
    layers = range(args.n_layers)
    none = elementwise_bytes(args, layers, 1, 4096, ac="none", head=False)
    full = elementwise_bytes(args, layers, 1, 4096, ac="full", head=False)
    one = layer_forward_bytes(args, 0, 4096, 4096, 1, 1, 2)
    assert none == (1 + BACKWARD_FACTOR) * args.n_layers * one
    assert full - none == args.n_layers * one
    tp4 = elementwise_bytes(args, layers, 1, 4096, tp=4, ac="none", head=True)
    assert tp4 == pytest.approx(elementwise_bytes(args, layers, 1, 4096, ac="none", head=True) / 4, rel=1e-6)
    job = Job("llama3", "8B", 8, 8, 4096, 64, H100)
    t = estimate(job, validate_degrees(world_size=8, dp_shard=8), LayoutChoice(64, 8, 4096, ac="full")).time
    assert t["elementwise"] > 0
    assert t["total"] == pytest.approx(
        t["compute"] + t["recompute"] + t["elementwise"] + t["comm_exposed_fsdp"] + t["comm_exposed_other"]
        + t["optimizer"] + t["bubble"]
    )  # fmt: skip


def test_link_figures_are_the_published_nccl_measurements_with_their_sources():
    """Every GPU kind has link figures; the NVSwitch parts carry the nccl-tests ring bus
    bandwidths (H100 / H200 370 GB/s, A100 230, B200 695; 48 GB/s per 400 Gb/s NIC, 24 per 200
    Gb/s) and NCCL's Simple-protocol latencies, not torch's generic 87.7 GB/s; each figure's
    source tag in tools/planner/hardware.py is described there (a document, or ESTIMATE with its
    derivation) and each source is named in docs/planner.md."""
    assert set(LINKS) == set(gpu_names())
    for name in gpu_names():
        hw = load_hardware(name)
        assert (hw.intra_node_gbps, hw.inter_node_gbps) == LINKS[name]
        assert hw.intra_node_gbps != TORCH_INTRA_NODE_GBPS
    assert LINKS["h100"] == LINKS["h200"] == (370.0, 48.0)
    assert LINKS["a100"] == (230.0, 24.0) and LINKS["b200"] == (695.0, 48.0)
    assert (H100.intra_node_hop_us, H100.inter_node_hop_us, H100.base_latency_us) == (3.4, 14.0, 8.4)
    source = (REPO / "tools" / "planner" / "hardware.py").read_text()
    docs = (REPO / "docs" / "planner.md").read_text()
    tags = re.findall(r"^    \"[\w-]+\": \([\d.]+, [\d.]+\),  # (.*)$", source, re.M)
    assert len(tags) == len(LINKS)
    for line in tags:
        for tag in re.findall(r"\[(\w+)\]", line):
            block = re.search(rf"^# \[{tag}\] +(.*?)(?=^# \[|^# Measure|^LINKS)", source, re.M | re.S)
            assert block, f"no source for [{tag}]"
            # a published figure names its document; an estimate says so (and gives its derivation)
            assert re.search(r"issue \d+|docs\.\w+|ESTIMATE", block.group(1)), f"[{tag}] names no document"
    for ref in ("nccl-tests issue 212", "nccl-tests issue 149", "nccl issue 2140", "nccl-tests issue 319",
                "nccl-tests issue 119", "tuning.cc", "docs.alayanew.com"):  # fmt: skip
        assert ref in docs, ref


def test_groups_across_nodes_use_one_nic_per_member_in_each_node():
    """A ring that crosses nodes runs on the NICs of its members in each node at once: one
    member per node gets one NIC's 48 GB/s, eight per node 8 x 48 capped at NVLink's 370; an
    all-to-all sends each member's off-node share through its own NIC. 1 GiB buffers make the
    bandwidth term dominate (latencies checked apart)."""
    nbytes = 2**30
    n = 16
    moved = nbytes * (n - 1) / n
    one = collective_seconds("all_gather", nbytes, n, True, H100, per_node=1)
    eight = collective_seconds("all_gather", nbytes, n, True, H100, per_node=8)
    assert one == pytest.approx((8.4 + 16 * 14.0) * 1e-6 + moved / 48e9)
    assert eight == pytest.approx((8.4 + 14 * 3.4 + 2 * 14.0) * 1e-6 + moved / 370e9)
    a2a = collective_seconds("all_to_all", nbytes, n, True, H100, per_node=8)
    assert a2a == pytest.approx((8.4 + 14 * 3.4 + 2 * 14.0) * 1e-6 + nbytes * 8 / 16 / 48e9)
    inside = collective_seconds("all_gather", nbytes, 8, False, H100)
    assert inside == pytest.approx((8.4 + 7 * 3.4) * 1e-6 + nbytes * 7 / 8 / 370e9)


def _best(hw):
    from tools.planner.search import plan_layouts

    # Llama 3 70B, 8 nodes of 8 H100, 8192 tokens, 1M tokens per step
    job = Job("llama3", "70B", 64, 8, 8192, 128, hw)
    return plan_layouts(job, ac_modes=("selective", "full"), schedules=("1F1B",)).estimates[0]


def test_the_search_puts_tensor_parallelism_inside_a_node():
    """Large runs keep TP inside the NVLink domain (Llama 3 405B: TP 8 per node, Megatron-LM's
    GPT tables likewise): with the published NCCL figures the planner's best layout for Llama 3
    70B on 8 x 8 H100 has tp > 1 within a node; with torch's generic 87.7 GB/s (negative
    control) its best layout has no TP at all, so the check can fail. Two searches restricted to
    two AC modes and one schedule (a few seconds): the choice between TP and none does not
    depend on the schedule."""
    best = _best(H100)
    assert best.degrees.tp > 1 and "tp" not in best.crosses_nodes, best.as_json()
    old = _best(dataclasses.replace(H100, **TORCH_LINKS))
    assert old.degrees.tp == 1, old.as_json()
