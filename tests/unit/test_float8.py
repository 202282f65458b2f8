"""Float8 training (``model.converters = ["float8"]``, models/parallel/float8.py) in one process:
which linears the converter turns into torchao's ``Float8Linear`` on both debug models, that
exactly those run their GEMMs as float8 ``torch._scaled_mm`` (a matmul census over one
forward+backward, against the FLOP share the decisions predict, with a negative control), and
the config checks' one-line messages. (Training, checkpoints and train.py's exits:
tests/e2e/test_float8_train.py.)"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from models.parallel.float8 import Float8Options, convert_to_float8, float8_decisions
from models.registry import build_model
from trainer.config import ConfigError, load_config
from trainer.instruments.matmul_census import MatmulCensus

pytest.importorskip("torchao.float8")

MODELS = ("llama3", "deepseek_v3")
# the linear-layer GEMMs (F.linear -> mm / addmm, Float8Linear -> _scaled_mm); the attention
# (scaled-dot-product ops) and the routed experts (_grouped_mm; bmm on other paths) are counted
# by the census under other op names and left out
LINEAR_OPS = ("mm", "addmm", "_scaled_mm")


def _linears(model: nn.Module) -> dict[str, nn.Linear]:
    return {fqn: mod for fqn, mod in model.named_modules() if isinstance(mod, nn.Linear)}


# ---------------------------------------------------------------- decisions


@pytest.mark.parametrize("name", MODELS)
def test_decisions_keep_output_and_routers_and_convert_the_rest(name):
    model = build_model(name, "debugmodel")  # meta: only shapes are read
    decisions = float8_decisions(model, Float8Options())
    assert set(decisions) == set(_linears(model))
    kept = {fqn: why for fqn, why in decisions.items() if why is not None}
    routers = {fqn for fqn in decisions if fqn.endswith(".moe.router.gate")}
    assert kept == {"output": "the output projection", **{r: "a MoE router" for r in routers}}
    assert len(routers) == (5 if name == "deepseek_v3" else 0)  # every MoE layer's router
    # the debug models have no other linear with a dimension off the multiple of 16
    assert len(decisions) - len(kept) == 42


@pytest.mark.parametrize("name", MODELS)
def test_filter_fqns_keeps_exactly_the_matching_modules(name):
    model = build_model(name, "debugmodel")
    decisions = float8_decisions(model, Float8Options(filter_fqns=("attention.wq",)))
    filtered = {fqn for fqn, why in decisions.items() if why == "float8.filter_fqns"}
    assert filtered == {f"layers.{i}.attention.wq" for i in range(6)}
    # the substring rule: "attention.w" names every attention projection
    decisions = float8_decisions(model, Float8Options(filter_fqns=("attention.w",)))
    filtered = {fqn for fqn, why in decisions.items() if why == "float8.filter_fqns"}
    assert filtered == {fqn for fqn in decisions if ".attention.w" in fqn} and len(filtered) == 24
    # a filter never overrides the output / router reasons
    decisions = float8_decisions(model, Float8Options(filter_fqns=("output", "router")))
    assert decisions["output"] == "the output projection"


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ok = nn.Linear(32, 64)
        self.odd_in = nn.Linear(24, 64)
        self.odd_out = nn.Linear(64, 40)
        self.output = nn.Linear(64, 64)
        self.not_linear = nn.Conv1d(16, 16, 1)


def test_dimension_not_multiple_of_16_is_kept_and_convert_swaps_exactly_the_converted():
    from torchao.float8.float8_linear import Float8Linear

    model = _Tiny()
    decisions = float8_decisions(model, Float8Options())
    odd = "a dimension not a multiple of 16"
    assert decisions == {"ok": None, "odd_in": odd, "odd_out": odd, "output": "the output projection"}
    report = convert_to_float8(model, Float8Options(), fsdp_all_gather=False)
    assert report.converted == ["ok"]
    assert {fqn for fqn, mod in model.named_modules() if isinstance(mod, Float8Linear)} == {"ok"}


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_convert_swaps_exactly_the_converted_modules(name, recipe):
    from torchao.float8.float8_linear import Float8Linear

    model = build_model(name, "debugmodel")
    opts = Float8Options(recipe=recipe, filter_fqns=("feed_forward.w2",))
    decisions = float8_decisions(model, opts)
    report = convert_to_float8(model, opts, fsdp_all_gather=False)
    converted = {fqn for fqn, why in decisions.items() if why is None}
    assert set(report.converted) == converted and set(report.kept) == set(decisions) - converted
    swapped = {fqn for fqn, mod in model.named_modules() if isinstance(mod, Float8Linear)}
    assert swapped == converted
    # every module that was not converted is still a plain nn.Linear
    assert all(type(mod) is nn.Linear for fqn, mod in _linears(model).items() if fqn not in converted)


# ---------------------------------------------------------------- census


def _census(name: str, opts: Float8Options | None, tokens: torch.Tensor):
    """One forward+backward of ``name``'s debug model (float32, CPU), converted with ``opts``
    (None: no float8), under the matmul census; returns (census, float8 decisions)."""
    torch.manual_seed(0)
    model = build_model(name, "debugmodel", device="cpu")
    decisions = float8_decisions(model, opts or Float8Options())
    if opts is not None:
        convert_to_float8(model, opts, fsdp_all_gather=False)
    with MatmulCensus() as census:
        model(tokens).sum().backward()
    return census, decisions, _linears(model)


def _linear_flops(census: MatmulCensus) -> tuple[int, int]:
    """(all linear-layer GEMM FLOPs, those that ran as float8 _scaled_mm)."""
    total = sum(f for (op, _), f in census.op_flops.items() if op in LINEAR_OPS)
    f8 = sum(f for (op, dt), f in census.op_flops.items() if op == "_scaled_mm" and dt.itemsize == 1)
    return total, f8


def _predicted(linears: dict[str, nn.Module], fqns, n_tokens: int) -> int:
    # forward, grad input and grad weight: 3 GEMMs of 2 * in * out FLOPs per token
    return sum(6 * n_tokens * linears[f].in_features * linears[f].out_features for f in fqns)


@pytest.mark.parametrize("name", MODELS)
def test_census_float8_share_is_what_the_decisions_predict(name):
    """The share of linear-layer GEMM FLOPs that ran as float8 ``_scaled_mm`` equals the share
    of the converted modules' 6 * in * out * tokens (exactly: integer FLOP counts); 0 without
    float8; with ``filter_fqns`` covering the feed-forwards it drops by exactly their share
    (the negative control: a census that counted every linear as float8 would not drop)."""
    tokens = torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(0))
    n = tokens.numel()
    ffn = ("feed_forward", "shared_experts")

    off, decisions, linears = _census(name, None, tokens)
    total, f8 = _linear_flops(off)
    all_linear = _predicted(linears, decisions, n)
    assert total == all_linear  # the op-name separation counted exactly the nn.Linear GEMMs
    assert f8 == 0 and not any(dt.itemsize == 1 for dt in off.flops)
    assert any("scaled_dot_product" in op for op, _ in off.op_flops)  # attention counted, apart

    on, decisions, _ = _census(name, Float8Options(), tokens)
    total, f8 = _linear_flops(on)
    converted = [f for f, why in decisions.items() if why is None]
    assert total == all_linear  # float8 changes the dtype of the GEMMs, not their sizes
    assert f8 == _predicted(linears, converted, n)
    share = f8 / total
    assert 0.5 < share < 1  # the output projection (and routers) stay high precision

    opts = Float8Options(filter_fqns=ffn)
    filtered, decisions, _ = _census(name, opts, tokens)
    total, f8_filtered = _linear_flops(filtered)
    ffn_flops = _predicted(linears, [f for f in linears if any(p in f for p in ffn)], n)
    assert total == all_linear and ffn_flops > 0.3 * all_linear
    assert f8_filtered == f8 - ffn_flops
    assert f8_filtered / total == pytest.approx(share - ffn_flops / all_linear, abs=1e-12)
    print(f"\n{name}: float8 share of linear GEMM FLOPs {share:.4f}, with the ffn filtered {f8_filtered / total:.4f}")


# ---------------------------------------------------------------- config


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--float8.recipe_name", "rowwise", "--float8.enable_fsdp_float8_all_gather", "true"],
            "float8.enable_fsdp_float8_all_gather needs tensorwise scaling (FSDP all-gathers one float8 weight "
            "with one scale), but float8.recipe_name is 'rowwise': set float8.recipe_name = 'tensorwise', or "
            "float8.enable_fsdp_float8_all_gather = false",
        ),
        (
            ["--float8.precompute_float8_dynamic_scale_for_fsdp", "true"],
            "float8.precompute_float8_dynamic_scale_for_fsdp precomputes the scales of the float8 all-gather, "
            "which is off: set float8.enable_fsdp_float8_all_gather = true, or turn the precompute off",
        ),
        (
            ["--model.converters", "mx"],
            "model.converters entry must be one of 'float8', 'quantize.linear.float8', 'float8_experts', "
            "'quantize.grouped_mm.float8', 'lora', got 'mx'",
        ),
        (
            ["--float8.recipe_name", "colwise"],
            "float8.recipe_name must be one of 'tensorwise', 'rowwise', 'rowwise_with_gw_hp', got 'colwise'; "
            "did you mean 'rowwise'?",
        ),
    ],
)
def test_config_errors_are_one_line(args, message):
    with pytest.raises(ConfigError) as err:
        load_config(["--config", "llama3.toml", "--model.converters", "float8", *args])
    assert str(err.value) == message and "\n" not in str(err.value)


def test_torchtitan_converter_name_and_section_are_accepted():
    cfg = load_config(
        ["--config", "llama3.toml", "--model.converters", "quantize.linear.float8", "--float8.recipe_name", "rowwise"]
    )
    from trainer.plan import float8_options

    assert float8_options(cfg) == Float8Options(recipe="rowwise")
    assert float8_options(load_config(["--config", "llama3.toml"])) is None


@pytest.mark.parametrize(
    ("args", "precompute"),
    [
        ((), False),
        (("--float8.enable_fsdp_float8_all_gather", "true"), False),
        (("--float8.enable_fsdp_float8_all_gather", "true", "--parallelism.tp", "2"), True),
        (("--parallelism.tp", "2"), False),
        (
            (
                "--float8.enable_fsdp_float8_all_gather",
                "true",
                "--float8.precompute_float8_dynamic_scale_for_fsdp",
                "true",
            ),
            True,
        ),
    ],
)
def test_plan_precomputes_scales_under_tp_with_the_float8_all_gather(args, precompute):
    """Under tp the float8 all-gather alone would scale each tp rank's slice by its own amax
    (tests/distributed/test_float8_layouts.py): the plan turns the whole-weight precompute on
    there, and leaves the user's choice everywhere else."""
    from trainer.plan import float8_options

    opts = float8_options(load_config(["--model.converters", "float8", *args]))
    assert opts is not None and opts.precompute_scale is precompute
    assert float8_options(load_config(list(args))) is None  # float8 off: no options at all
