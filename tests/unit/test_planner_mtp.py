"""The layout planner with DeepSeek-V3 multi-token prediction (``mtp_layers`` = D > 0): its
parameter inventory against the model's own parameters, its FLOPs against the model's own count
(``flops_per_token``), its activation estimate against the tensors a CPU forward keeps, the MTP
depths on the last pipeline stage, and ``--mtp-layers`` on the command line.

The exact per-rank FLOPs of MTP layouts (tp=2; pp=2 last stage with D = 2 and full AC) against
a fake-backend census are in tests/distributed/test_planner_compute.py."""

from __future__ import annotations

import pytest

from models.registry import build_model
from parallel_dims.layout import validate_degrees
from tools.planner.activations import activation_bytes
from tools.planner.choice import LayoutChoice, stage_layers
from tools.planner.cli import main as planner_main
from tools.planner.compute import rank_matmul_flops
from tools.planner.estimate import Job, memory_for_rank
from tools.planner.hardware import load_hardware
from tools.planner.inventory import cached_layout, model_inventory
from tools.planner.measure import measure_activations

SMALL = dict(n_layers=2, max_seq_len=64)


@pytest.mark.parametrize("depth", [1, 2])
def test_inventory_holds_every_mtp_parameter(depth):
    """Every parameter of the model with D MTP depths, name and shape, is in the inventory (the
    MTP blocks as layers n_layers + k in FSDP groups ``mtp.<k>``, the embedding copy
    vocabulary-sharded on tp like ``tok_embeddings``, eh_proj replicated); one rank's fp32
    parameter, gradient and AdamW bytes grow by exactly the depths' parameters."""
    params, args = model_inventory("deepseek_v3", "debugmodel", mtp_layers=depth, **SMALL)
    model = build_model("deepseek_v3", "debugmodel", device="meta", mtp_layers=depth, **SMALL)
    assert {p.fqn: p.shape for p in params} == {n: tuple(p.shape) for n, p in model.named_parameters()}
    mtp = [p for p in params if p.fqn.startswith("mtp.")]
    assert {p.layer for p in mtp} == set(range(args.n_layers, args.n_layers + depth))
    assert {p.group for p in mtp if not p.expert} == {f"mtp.{k}" for k in range(depth)}
    by_name = {p.fqn: p for p in mtp}
    assert by_name["mtp.0.embed_tokens.weight"].tp_dim == 0 and by_name["mtp.0.embed_tokens.weight"].role == "embedding"
    assert (
        by_name["mtp.0.eh_proj.weight"].tp_dim is None and by_name["mtp.0.eh_proj.weight"].role == "replicated_linear"
    )
    assert by_name["mtp.0.attention.wo.weight"].tp_dim == 1

    d = validate_degrees(world_size=1)
    choice = LayoutChoice(global_batch=2, local_batch=2, seq_len=64, param_dtype="float32")
    mems = [
        memory_for_rank(
            Job("deepseek_v3", "debugmodel", 1, 8, 64, 2, load_hardware("h100"), param_dtype="float32",
                model_overrides=tuple(sorted({**SMALL, **({"mtp_layers": n} if n else {})}.items()))),
            d, choice, 0,
        )
        for n in (0, depth)
    ]  # fmt: skip
    extra = sum(p.numel for p in mtp)
    assert mems[1]["params"] - mems[0]["params"] == 4 * extra
    assert mems[1]["optimizer"] - mems[0]["optimizer"] == 8 * extra


def test_mtp_depths_sit_on_the_last_stage():
    """Under pp the MTP blocks are layers of the stage with the head, none of the others'."""
    _, args = model_inventory("deepseek_v3", "debugmodel", mtp_layers=2, **SMALL)
    d = validate_degrees(world_size=2, pp=2)
    choice = LayoutChoice(global_batch=4, local_batch=2, seq_len=64, schedule="1F1B", n_microbatches=2)
    layout = cached_layout(d)
    first, _ = stage_layers(args, d, choice, 0, layout)
    last, _ = stage_layers(args, d, choice, 1, layout)
    assert [(list(r), e, h) for r, e, h in first] == [([0], True, False)]
    assert [(list(r), e, h) for r, e, h in last] == [([1, 2, 3], False, True)]


@pytest.mark.parametrize("depth", [1, 2])
def test_flops_grow_by_the_models_own_count(depth):
    """One rank, no AC: the planner's FLOPs grow with the depths by what the model's own
    ``flops_per_token`` adds (the blocks, their attention, one more pass of the output head
    each) times the tokens, up to the two conventions on which the planner and the trainer's
    formula differ for every block: the planner counts no 1-D weights (the norms: the formula's 6
    x numel) and does count the MoE combine's batched matmul (6 x top_k x dim per token)."""
    d = validate_degrees(world_size=1)
    seq, batch = 64, 2
    choice = LayoutChoice(global_batch=batch, local_batch=batch, seq_len=seq, param_dtype="float32")
    off = rank_matmul_flops("deepseek_v3", "debugmodel", d, choice, 0, **SMALL)["total"]
    on = rank_matmul_flops("deepseek_v3", "debugmodel", d, choice, 0, mtp_layers=depth, **SMALL)["total"]
    base = build_model("deepseek_v3", "debugmodel", device="meta", **SMALL)
    model = build_model("deepseek_v3", "debugmodel", device="meta", mtp_layers=depth, **SMALL)
    a = model.args
    norms = sum(p.numel() for block in model.mtp.values() for p in block.parameters() if p.dim() == 1)
    combine = 6 * a.n_activated_experts * a.dim * sum(block.moe_enabled for block in model.mtp.values())
    per_token = model.flops_per_token(seq) - base.flops_per_token(seq) - 6 * norms + combine
    assert on - off == batch * seq * per_token
    # not vacuous: the head's extra passes alone are a large share of it
    assert batch * seq * 6 * a.vocab_size * a.dim * depth > 0.25 * (on - off)


@pytest.mark.parametrize("ac", ["none", "full", "selective", "selective:2"])
def test_activation_estimate_with_mtp_matches_saved_tensors(ac):
    """D = 2: the bytes a CPU forward + loss keeps for the backward (the main and both depths'
    logits, tools/planner/measure.py) vs the formula, in float32 and bfloat16, within 1%
    (measured: within 0.3%); the MTP blocks are layers of the estimate, their norms, eh_proj
    input and the head's (1 + D) passes the rest."""
    _, args = model_inventory("deepseek_v3", "debugmodel", mtp_layers=2)
    mode, _, option = ac.partition(":")
    for dtype, nbytes in (("float32", 4), ("bfloat16", 2)):
        measured = measure_activations(
            "deepseek_v3", "debugmodel", 128, batch=2, ac_mode=mode, dtype=dtype, ac_option=option or "op",
            mtp_layers=2,
        )["bytes"]  # fmt: skip
        predicted = activation_bytes(
            args, range(args.n_layers + 2), 2, 128, act_bytes=nbytes, ac=mode,
            selective_every=int(option) if option else None,
        ).held  # fmt: skip
        assert abs(predicted - measured) <= 0.01 * measured, (dtype, predicted, measured)
        if ac == "none":  # not vacuous: without the MTP terms the estimate is far off
            plain = activation_bytes(
                model_inventory("deepseek_v3", "debugmodel")[1], range(args.n_layers), 2, 128, act_bytes=nbytes
            ).held
            assert measured - plain > 0.15 * measured


def test_cli_takes_mtp_layers(capsys):
    """``--mtp-layers`` plans DeepSeek-V3 with its depths (the same best layout needs more
    memory than without them) and says so in --json; it is refused, one line and exit 2, for a
    model without MTP."""
    import json

    argv = ["--model", "deepseek_v3", "--flavor", "debugmodel", "--world-size", "1", "--seq-len", "256",
            "--global-batch", "8", "--top", "1", "--json", "--ac", "none"]  # fmt: skip
    assert planner_main(argv) == 0
    plain = json.loads(capsys.readouterr().out)
    assert planner_main([*argv, "--mtp-layers", "1"]) == 0
    with_mtp = json.loads(capsys.readouterr().out)
    assert plain["mtp_layers"] == 0 and with_mtp["mtp_layers"] == 1
    base, first = plain["top"][0], with_mtp["top"][0]
    assert first["degrees"] == base["degrees"]
    assert first["memory_gib"]["params"] > base["memory_gib"]["params"]
    assert first["memory_gib"]["activations"] > base["memory_gib"]["activations"]
    assert planner_main(["--model", "llama3", "--flavor", "debugmodel", "--world-size", "2", "--seq-len", "256",
                         "--global-batch", "8", "--mtp-layers", "1"]) == 2  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--mtp-layers 1" in err[0] and "deepseek_v3" in err[0], err
