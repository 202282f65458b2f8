"""The layout planner with float8 training (tools/planner/float8.py): the converter and the planner
agree on which linears convert; the converted GEMM FLOPs are priced at the float8 peak and, with
FSDP float8 all-gather, the converted weights are gathered at 1 byte per element. The expected
figures are the formulas written out from Llama 3 8B's published shapes (dim 4096, 8 KV heads of
128, feed-forward 14336, 32 layers), not from the planner's own code; the float8 FLOPs a rank
really computes are checked against a fake-backend census in tests/distributed/test_planner_compute.py."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from models.parallel.float8 import Float8Options, convert_to_float8
from models.registry import get_model_spec
from parallel_dims.layout import validate_degrees
from tools.planner.choice import LayoutChoice
from tools.planner.cli import main as planner_main
from tools.planner.collectives import predict_collectives
from tools.planner.compute import rank_matmul_flops
from tools.planner.estimate import Job, estimate
from tools.planner.float8 import converted_expert_weights, converted_weights, float8_experts_refusal
from tools.planner.hardware import load_hardware
from tools.planner.inventory import model_inventory
from tools.planner.search import enumerate_degrees

H100 = load_hardware("h100")
DIM, KV, FFN, LAYERS = 4096, 8 * 128, 14336, 32
ATTN = 2 * DIM * DIM + 2 * DIM * KV  # wq, wo + wk, wv
LINEARS = ATTN + 3 * DIM * FFN  # per block: every projection converts
W2 = FFN * DIM  # the block's last projection (full AC recomputes it only in float8)


def _converter_swaps(model: str, flavor: str, opts: Float8Options) -> set[str]:
    """Weight FQNs of the modules the real converter turns into Float8Linear (meta model)."""
    from torchao.float8.float8_linear import Float8Linear

    spec = get_model_spec(model, flavor)
    with torch.device("meta"):
        m = spec.model_cls(dataclasses.replace(spec.args))
    convert_to_float8(m, opts, fsdp_all_gather=False)
    return {f"{fqn}.weight" for fqn, mod in m.named_modules() if isinstance(mod, Float8Linear)}


@pytest.mark.parametrize("model,flavor", [("llama3", "8B"), ("deepseek_v3", "16B"), ("deepseek_v3", "debugmodel")])
@pytest.mark.parametrize("filter_fqns", [(), ("wq", "shared_experts")])
def test_planner_and_converter_agree_on_the_converted_linears(model, flavor, filter_fqns):
    swapped = _converter_swaps(model, flavor, Float8Options(filter_fqns=filter_fqns))
    planned = converted_weights(model, flavor, (), filter_fqns)
    assert swapped and planned == swapped
    # what stays: the output projection, the router, routed experts (not linears), the filter
    assert "output.weight" not in planned and not any(".router." in f or ".experts." in f for f in planned)
    assert not any(f in name for name in planned for f in filter_fqns)


def test_llama3_8b_converts_every_block_projection():
    planned = converted_weights("llama3", "8B", (), ())
    assert len(planned) == 7 * LAYERS
    # negative control: a filter changes the set (the agreement above is not vacuous)
    assert converted_weights("llama3", "8B", (), ("feed_forward",)) == {f for f in planned if "attention" in f}


JOB = Job("llama3", "8B", 8, 8, 8192, 16, H100, efficiency=0.5)
D = validate_degrees(world_size=8, dp_shard=8)
TOKENS = 2 * 8192  # local batch 1, 2 accumulation steps of one 8192-token sequence per rank


def _est(f8: Float8Options | None, ac: str = "none"):
    job = dataclasses.replace(JOB, float8=f8)
    return estimate(job, D, LayoutChoice(16, 1, 8192, ac=ac, float8=f8))


@pytest.mark.parametrize("ac", ["none", "full"])
def test_converted_gemms_are_priced_at_the_float8_peak(ac):
    bf16, f8 = _est(None, ac), _est(Float8Options(), ac)
    rate, rate8 = H100.peak_flops("bfloat16") * 0.5, H100.peak_flops("float8") * 0.5
    assert rate8 == 1979e12 * 0.5  # trainer/reporting/metrics.py GPU_PEAKS, H100 SXM fp8 dense
    saved = 6 * TOKENS * LAYERS * LINEARS * (1 / rate - 1 / rate8)  # forward + 2x backward
    assert bf16.time["compute"] - f8.time["compute"] == pytest.approx(saved, rel=1e-9)
    # full AC recomputes the blocks' forward; w2 too in float8 (bf16's early stop skips it)
    redone = 2 * TOKENS * LAYERS * LINEARS if ac == "full" else 0
    redone_bf16 = 2 * TOKENS * LAYERS * W2 if ac == "full" else 0
    assert bf16.time["recompute"] - f8.time["recompute"] == pytest.approx(
        redone * (1 / rate - 1 / rate8) - redone_bf16 / rate, abs=1e-12
    )
    # the converted share of Llama 3 8B's FLOPs at 8192 tokens is 72% (the rest: attention and the
    # 128k-vocab output): compute falls to 1 - share + share x bf16/fp8 peak = 64% of bf16's
    share = 6 * TOKENS * LAYERS * LINEARS / (bf16.time["compute"] * rate)
    assert 0.72 < share < 0.73
    assert f8.time["compute"] / bf16.time["compute"] == pytest.approx(1 - share + share * rate / rate8, rel=1e-9)
    assert f8.time["total"] < bf16.time["total"] and f8.memory == bf16.memory  # memory: not modelled


def test_rowwise_with_gw_hp_keeps_the_weight_gradient_gemm_in_bf16():
    bf16, f8 = _est(None), _est(Float8Options(recipe="rowwise_with_gw_hp"))
    rate, rate8 = H100.peak_flops("bfloat16") * 0.5, H100.peak_flops("float8") * 0.5
    saved = 4 * TOKENS * LAYERS * LINEARS * (1 / rate - 1 / rate8)  # forward + input gradient
    assert bf16.time["compute"] - f8.time["compute"] == pytest.approx(saved, rel=1e-9)


def test_nothing_converted_changes_nothing():
    """Negative control: float8 on, but a filter that keeps every block linear in bf16 (the
    converter's own rule): the very same estimate as bf16."""
    bf16, kept = _est(None, "full"), _est(Float8Options(filter_fqns=("layers",)), "full")
    assert kept.time == bf16.time


def _gathers(f8: Float8Options | None) -> dict[str, int]:
    choice = LayoutChoice(16, 1, 8192, float8=f8)
    recs = predict_collectives("llama3", "8B", D, choice, 0, **JOB.overrides)
    return {r["bytes"]: r["count"] for r in recs if r["kind"] == "all_gather" and r["mesh"] == "fsdp"}


def test_float8_all_gather_gathers_the_converted_weights_in_one_byte():
    bf16 = _gathers(None)
    f8 = _gathers(Float8Options(fsdp_float8_all_gather=True))
    norms = 2 * DIM  # attention_norm, ffn_norm: still bf16
    block = 2 * (LINEARS + norms)
    assert bf16[block] == (LAYERS - 1) * 2 * 2 + 2  # 2 accumulation steps x forward + backward (the last block: once)
    assert f8[LINEARS + 2 * norms] == bf16[block]  # the converted weights at 1 byte, the norms at 2
    rest = {b: c for b, c in bf16.items() if b != block}  # embeddings, head: not converted
    assert {b: c for b, c in f8.items() if b != LINEARS + 2 * norms} == rest
    # without the all-gather option (or with a recipe that cannot use it): bf16's bytes
    assert _gathers(Float8Options()) == bf16
    assert _gathers(Float8Options(recipe="rowwise", fsdp_float8_all_gather=True)) == bf16
    with_ag = estimate(dataclasses.replace(JOB, float8=Float8Options(fsdp_float8_all_gather=True)), D,
                       LayoutChoice(16, 1, 8192, float8=Float8Options(fsdp_float8_all_gather=True)))  # fmt: skip
    assert with_ag.time["comm"]["fsdp"] < _est(Float8Options()).time["comm"]["fsdp"]


def test_estimate_from_config_reads_the_float8_section():
    from tools.planner.from_config import estimate_from_config
    from trainer.config import load_config

    argv = ["--config", "llama3.toml", "--training.seq_len", "256", "--training.local_batch_size", "2"]
    plain = estimate_from_config(load_config(argv), 2, H100, tokenizer_vocab=2048)
    f8 = ["--model.converters", "float8", "--float8.enable_fsdp_float8_all_gather", "true"]
    conv = estimate_from_config(load_config(argv + f8), 2, H100, tokenizer_vocab=2048)
    assert conv.choice.float8 == Float8Options(fsdp_float8_all_gather=True)
    assert conv.time["compute"] < plain.time["compute"] and conv.time["comm"]["fsdp"] < plain.time["comm"]["fsdp"]


_DEBUG = ["--model", "llama3", "--flavor", "debugmodel", "--world-size", "2", "--seq-len", "64", "--global-batch", "4"]


def test_cli_float8_flags(capsys):
    assert planner_main([*_DEBUG, "--float8", "--float8-all-gather", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "float8 (recipe tensorwise; FSDP float8 all-gather) at 1979 TFLOP/s peak" in out
    for bad, why in (
        (["--float8-all-gather"], "--float8-all-gather needs --float8 tensorwise"),
        (["--float8", "rowwise", "--float8-all-gather"], "--float8-all-gather needs --float8 tensorwise"),
        (["--float8", "--gpu", "a100"], "has no float8 tensor cores"),
    ):
        assert planner_main([*_DEBUG, *bad]) == 2
        err = capsys.readouterr().err
        assert why in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


# ---- float8 routed experts (model.converters = ["float8_experts"], Float8Options.moe_fqns) ----
# published shapes: (dim, expert hidden, top_k, MoE layers); every routed expert runs x w1^T,
# x w3^T, h w2^T, each 2 x dim x hidden FLOPs per token in forward, 2 x that in backward
MOE = {"debugmodel": (256, 256, 2, 5), "16B": (2048, 1408, 6, 26)}
EXPERTS = Float8Options(linears=False, moe_fqns=("experts",))


def _expert_forward(flavor: str, moe_tokens: int) -> int:
    dim, hidden, top_k, layers = MOE[flavor]
    return moe_tokens * layers * top_k * 3 * 2 * dim * hidden


@pytest.mark.parametrize("flavor", ["debugmodel", "16B"])
@pytest.mark.parametrize("moe_fqns,etp", [(("experts",), 1), (("experts",), 2), (("layers.1.", "layers.3."), 1)])
def test_planner_and_converter_agree_on_the_converted_experts(flavor, moe_fqns, etp):
    spec = get_model_spec("deepseek_v3", flavor)
    with torch.device("meta"):
        m = spec.model_cls(spec.args)
    report = convert_to_float8(m, Float8Options(linears=False, moe_fqns=moe_fqns), fsdp_all_gather=False, etp=etp)
    swapped = {f"{fqn}.{w}" for fqn in report.experts for w in ("w1", "w2", "w3")}
    assert swapped and converted_expert_weights("deepseek_v3", flavor, (), moe_fqns, etp) == swapped
    assert len(report.experts) == (MOE[flavor][3] if moe_fqns == ("experts",) else 2)


def test_expert_decision_depends_on_etp():
    """The hidden size per etp rank must be a multiple of 16: 272 converts at etp 1, not at 2
    (136); the planner prices that and the search drops etp 2, which the trainer refuses."""
    key = (("moe_inter_dim", 272),)
    assert converted_expert_weights("deepseek_v3", "debugmodel", key, ("experts",), 1)
    assert not converted_expert_weights("deepseek_v3", "debugmodel", key, ("experts",), 2)
    assert "at etp 2" in float8_experts_refusal("deepseek_v3", "debugmodel", key, ("experts",), 2)
    assert float8_experts_refusal("llama3", "8B", (), ("experts",), 1) == "the llama3 model has no routed experts"
    d = validate_degrees(world_size=4, dp_shard=2, tp=2, ep=2, etp=2)
    flops = rank_matmul_flops("deepseek_v3", "debugmodel", d, LayoutChoice(4, 1, 64, float8=EXPERTS), moe_inter_dim=272)
    assert flops["forward_float8"] == 0 and flops["backward_float8"] == 0
    job = Job("deepseek_v3", "debugmodel", 4, 4, 64, 4, H100, model_overrides=key)
    _, args = model_inventory("deepseek_v3", "debugmodel", **job.overrides)
    plain = enumerate_degrees(job, args)
    f8 = enumerate_degrees(dataclasses.replace(job, float8=EXPERTS), args)
    assert any(d.etp == 2 for d in plain) and f8 == [d for d in plain if d.etp == 1]


_MOE_LAYOUTS = {
    "fsdp=8": (dict(dp_shard=8), "none", "tensorwise"),
    # tp: the experts read the sequence-parallel shard; etp/ep move rows, not FLOPs; the
    # experts' backward stays all float8 under the recipe that keeps the linears' gw in bf16
    "fsdp=4,tp=2,ep=2,etp=2 full AC gw_hp": (dict(dp_shard=4, tp=2, ep=2, etp=2), "full", "rowwise_with_gw_hp"),
}


@pytest.mark.parametrize("flavor", ["debugmodel", "16B"])
@pytest.mark.parametrize("layout", list(_MOE_LAYOUTS))
def test_float8_experts_add_exactly_the_expert_gemm_flops(flavor, layout):
    degrees, ac, recipe = _MOE_LAYOUTS[layout]
    d = validate_degrees(world_size=8, **degrees)
    seq = 4096
    tokens = 16 * seq // d.dp_shard  # a global batch of 16 sequences over the data-parallel ranks
    expert = _expert_forward(flavor, tokens // d.tp)

    def flops(f8):
        return rank_matmul_flops("deepseek_v3", flavor, d, LayoutChoice(16, 1, seq, ac=ac, float8=f8))

    linears = flops(Float8Options(recipe=recipe))
    both = flops(Float8Options(recipe=recipe, moe_fqns=("experts",)))
    alone = flops(Float8Options(recipe=recipe, linears=False, moe_fqns=("experts",)))
    redo = expert if ac == "full" else 0
    assert both["forward_float8"] - linears["forward_float8"] == expert
    assert both["backward_float8"] - linears["backward_float8"] == 2 * expert
    assert both["recompute_float8"] - linears["recompute_float8"] == redo
    # experts only: just the experts' GEMMs in float8 (the linears in the parameter dtype)
    assert (alone["forward_float8"], alone["backward_float8"], alone["recompute_float8"]) == (expert, 2 * expert, redo)
    # the same FLOPs, only their rate changes (full AC recomputes float8 linears' last
    # projection, so the recompute follows the linears' choice, not the experts')
    bf16 = flops(None)
    assert all(both[k] == linears[k] and alone[k] == bf16[k] for k in ("forward", "backward", "recompute", "total"))
    assert both["forward"] == bf16["forward"] and both["backward"] == bf16["backward"]
    # the experts are a real share of the work (the 16B's 64-expert MoE: the bulk of it)
    assert 0.02 < 3 * expert / both["total"] < 0.6


def test_llama3_has_no_experts_to_convert():
    assert _est(Float8Options(moe_fqns=("experts",)), "full").time == _est(Float8Options(), "full").time
    assert _est(Float8Options(linears=False, moe_fqns=("experts",)), "full").time == _est(None, "full").time


def test_experts_only_prices_only_the_experts_at_the_float8_peak():
    job = Job("deepseek_v3", "16B", 8, 8, 4096, 16, H100)
    d = validate_degrees(world_size=8, dp_shard=8)

    def est(f8):
        return estimate(dataclasses.replace(job, float8=f8), d, LayoutChoice(16, 1, 4096, float8=f8))

    rate, rate8 = H100.peak_flops("bfloat16") * 0.5, H100.peak_flops("float8") * 0.5
    saved = 3 * _expert_forward("16B", 2 * 4096) * (1 / rate - 1 / rate8)
    bf16, alone, linears, both = (
        est(None),
        est(EXPERTS),
        est(Float8Options()),
        est(Float8Options(moe_fqns=("experts",))),
    )
    assert bf16.time["compute"] - alone.time["compute"] == pytest.approx(saved, rel=1e-9)
    assert linears.time["compute"] - both.time["compute"] == pytest.approx(saved, rel=1e-9)
    assert alone.memory == bf16.memory


@pytest.mark.parametrize("degrees", [dict(dp_shard=8), dict(dp_shard=8, ep=2)])  # experts in the block's group; apart
def test_float8_all_gather_keeps_the_expert_weights_at_the_parameter_dtype(degrees):
    d = validate_degrees(world_size=8, **degrees)

    def gathers(f8):
        recs = predict_collectives("deepseek_v3", "debugmodel", d, LayoutChoice(8, 1, 64, float8=f8))
        return sorted((r["mesh"], r["bytes"], r["count"]) for r in recs if r["kind"] == "all_gather")

    bf16, linears = gathers(None), gathers(Float8Options(fsdp_float8_all_gather=True))
    assert linears != bf16  # the converted linears shrink (not vacuous)
    assert gathers(Float8Options(fsdp_float8_all_gather=True, moe_fqns=("experts",))) == linears
    assert gathers(Float8Options(fsdp_float8_all_gather=True, linears=False, moe_fqns=("experts",))) == bf16


def test_estimate_from_config_reads_float8_experts(tmp_path):
    from tools.planner.from_config import estimate_from_config
    from trainer.config import load_config

    argv = ["--config", "deepseek_v3.toml", "--training.seq_len", "256", "--training.local_batch_size", "2"]
    plain = estimate_from_config(load_config(argv), 2, H100, tokenizer_vocab=2048)
    alone = estimate_from_config(
        load_config([*argv, "--model.converters", "float8_experts"]), 2, H100, tokenizer_vocab=2048
    )
    both = estimate_from_config(
        load_config([*argv, "--model.converters", "float8,quantize.grouped_mm.float8"]), 2, H100, tokenizer_vocab=2048
    )
    assert alone.choice.float8 == EXPERTS and both.choice.float8 == Float8Options(moe_fqns=("experts",))
    assert both.time["compute"] < alone.time["compute"] < plain.time["compute"]


_MOE_DEBUG = ["--model", "deepseek_v3", "--flavor", "debugmodel", "--world-size", "2", "--seq-len", "64",
              "--global-batch", "4", "--top", "1"]  # fmt: skip


@pytest.mark.parametrize("flags,converters", [([], '["float8_experts"]'), (["--float8", "rowwise"], '["float8", "float8_experts"]')])  # fmt: skip
def test_cli_float8_experts(flags, converters, capsys, tmp_path):
    import tomllib

    toml = tmp_path / "plan.toml"
    assert planner_main([*_MOE_DEBUG, "--float8-experts", *flags, "--toml", str(toml)]) == 0
    out = capsys.readouterr().out
    linears = "recipe rowwise" if flags else "linear layers in the parameter dtype"
    assert f"float8 ({linears}; routed experts 'experts' rowwise) at 1979 TFLOP/s peak" in out
    text = toml.read_text()
    assert f"# with [model] converters = {converters}" in text
    f8 = tomllib.loads(text)["float8"]
    assert f8["moe_fqns"] == ["experts"] and ("recipe_name" in f8) == bool(flags)
    # the snippet over the shipped config, with the converters it names: the trainer's plan
    # runs the planned float8
    from trainer.config import load_config
    from trainer.plan import plan_job

    data = tomllib.loads((Path(__file__).resolve().parents[2] / "train_configs" / "deepseek_v3.toml").read_text())
    for section, values in tomllib.loads(text).items():
        data.setdefault(section, {}).update(values)
    data["model"]["converters"] = json.loads(converters)
    merged = tmp_path / "merged.toml"
    merged.write_text(
        "".join(f"[{k}]\n" + "".join(f"{a} = {json.dumps(b)}\n" for a, b in v.items()) for k, v in data.items())
    )
    plan = plan_job(load_config(["--config", str(merged)]), 2, tokenizer_vocab=2048)
    want = Float8Options(recipe="rowwise", moe_fqns=("experts",)) if flags else EXPERTS
    assert plan.parallelize.float8 == want
    for bad, why in (
        (["--model", "llama3"], "--float8-experts: the llama3 model has no routed experts"),
        (["--gpu", "a100"], "has no float8 tensor cores"),
        (["--float8-all-gather"], "--float8-all-gather needs --float8 tensorwise"),
    ):
        assert planner_main([*_MOE_DEBUG, "--float8-experts", *bad]) == 2
        err = capsys.readouterr().err
        assert why in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
