"""Float8 with Qwen3 (``models/qwen3``, dense and MoE) in one process, as tests/unit/test_float8.py
and test_float8_experts.py prove it for Llama 3 and DeepSeek-V3: the converter's decisions on
both debug flavors (every attention projection and dense SwiGLU linear converted; the output
projection and the MoE routers kept; the per-head q/k norms are not linears), and a matmul census
of one forward + backward in which exactly the converted modules' GEMMs (6 * in * out FLOPs per
token, integer counts) run as float8 ``_scaled_mm``, and with ``float8_experts`` exactly the
routed experts' grouped GEMMs (3 weights x 3 GEMMs x 2 * dim * moe_inter_dim per routed token).
Negative control: the same census without float8 counts 0 float8 FLOPs. Training through
train.py with the converters on: the "Qwen3" lines of docs/float8.md. About 3 s.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from models.parallel.float8 import Float8Options, convert_to_float8, float8_decisions, float8_expert_decisions
from models.registry import build_model
from trainer.instruments.matmul_census import MatmulCensus

pytest.importorskip("torchao.float8")

LINEAR_OPS = ("mm", "addmm", "_scaled_mm")


def _linears(model: nn.Module) -> dict[str, nn.Linear]:
    return {fqn: mod for fqn, mod in model.named_modules() if isinstance(mod, nn.Linear)}


@pytest.mark.parametrize(("flavor", "converted"), [("debugmodel", 4 * 7), ("debugmodel_moe", 4 * 4)])
def test_decisions_keep_output_and_routers_and_convert_the_rest(flavor, converted):
    model = build_model("qwen3", flavor)  # meta: only shapes are read
    decisions = float8_decisions(model, Float8Options())
    kept = {fqn: why for fqn, why in decisions.items() if why is not None}
    routers = {f"layers.{i}.moe.router.gate" for i in range(4)} if flavor.endswith("moe") else set()
    assert kept == {"output": "the output projection", **{r: "a MoE router" for r in routers}}
    assert len(decisions) - len(kept) == converted  # 4 blocks: wq wk wv wo (+ w1 w2 w3 when dense)
    experts = float8_expert_decisions(model, Float8Options(moe_fqns=("experts",)))
    assert set(experts) == {f"layers.{i}.moe.experts" for i in range(4)} if routers else not experts
    assert all(why is None for why in experts.values())


def _flops(census: MatmulCensus) -> tuple[int, int, int]:
    """(linear-layer GEMM FLOPs, float8 _scaled_mm FLOPs, high-precision _grouped_mm FLOPs)."""
    linear = sum(f for (op, _), f in census.op_flops.items() if op in LINEAR_OPS)
    f8 = sum(f for (op, dt), f in census.op_flops.items() if op == "_scaled_mm" and dt.itemsize == 1)
    grouped = sum(f for (op, _), f in census.op_flops.items() if op == "_grouped_mm")
    return linear, f8, grouped


@pytest.mark.parametrize("flavor", ["debugmodel", "debugmodel_moe"])
def test_census_float8_flops_are_exactly_the_converted_gemms(flavor):
    tokens = torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(0))
    n = tokens.numel()
    moe = flavor.endswith("moe")
    runs = {}
    for label, opts in (("off", None), ("on", Float8Options(moe_fqns=("experts",) if moe else ()))):
        torch.manual_seed(0)
        model = build_model("qwen3", flavor, device="cpu", n_layers=2)
        model.init_weights(0)
        decisions = float8_decisions(model, Float8Options())
        linears = _linears(model)
        if opts is not None:
            convert_to_float8(model, opts, fsdp_all_gather=False)
        with MatmulCensus() as census:
            loss = model(tokens).float().logsumexp(-1).mean()
            loss.backward()
        assert torch.isfinite(loss)
        runs[label] = _flops(census)
    converted = [f for f, why in decisions.items() if why is None]
    linear_f8 = sum(6 * n * linears[f].in_features * linears[f].out_features for f in converted)
    args = model.args
    experts = 2 * n * args.n_activated_experts * 3 * 3 * 2 * args.dim * args.moe_inter_dim if moe else 0
    linear_off, f8_off, grouped_off = runs["off"]
    linear_on, f8_on, grouped_on = runs["on"]
    assert f8_off == 0 and grouped_off == experts  # negative control: nothing in float8 without it
    assert f8_on == linear_f8 + experts and grouped_on == 0
    # float8 changes the dtype of the GEMMs, not their sizes (the experts' now count as _scaled_mm)
    assert linear_on == linear_off + experts
    assert 0.3 < linear_f8 / linear_off < 1  # the output projection (and routers) stay high precision
