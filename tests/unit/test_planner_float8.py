"""The layout planner with float8 training (tools/planner/float8.py): the converter and the planner
agree on which linears convert; the converted GEMM FLOPs are priced at the float8 peak and, with
FSDP float8 all-gather, the converted weights are gathered at 1 byte per element. The expected
figures are the formulas written out from Llama 3 8B's published shapes (dim 4096, 8 KV heads of
128, feed-forward 14336, 32 layers), not from the planner's own code; the float8 FLOPs a rank
really computes are checked against a fake-backend census in tests/distributed/test_planner_compute.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from models.parallel.float8 import Float8Options, convert_to_float8
from models.registry import get_model_spec
from parallel_dims.layout import validate_degrees
from tools.planner.choice import LayoutChoice
from tools.planner.cli import main as planner_main
from tools.planner.collectives import predict_collectives
from tools.planner.estimate import Job, estimate
from tools.planner.float8 import converted_weights
from tools.planner.hardware import load_hardware

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
    assert rate8 == 1979e12 * 0.5  # trainer/metrics.py GPU_PEAKS, H100 SXM fp8 dense
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
    from tools.planner.estimate import estimate_from_config
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
