"""Float8 with DeepSeek-V3 multi-token prediction (``--model.mtp_layers``, models/deepseek_v3/mtp.py)
in one process, as tests/unit/test_float8_qwen3.py and test_float8_experts.py prove float8 for the
main blocks: which matmuls of an MTP depth run as float8 ``_scaled_mm``.

* The converter's decisions: an MTP depth's block converts exactly as a main MoE block does
  (every MLA projection and shared-expert linear; the router kept), its ``eh_proj`` (2 dim ->
  dim) converts too, its norms and embedding copy are not linears, and its routed experts join
  ``float8_experts``; the output head, which the main and MTP states share, stays high precision.
* A matmul census of one forward + backward through the MTP path (``mtp_tokens`` given, the head
  over the main and every depth's states) with ``float8,float8_experts``: the float8 FLOPs are
  exactly the converted linears' GEMMs (6 * in * out per token, forward, input and weight
  gradient, integer counts) plus the routed experts' grouped GEMMs (3 weights x 3 GEMMs x
  2 * dim * moe_inter_dim per routed token), the MTP depths' included; the high-precision linear
  FLOPs are exactly the shared head on (1 + D) x the tokens and the routers.
* Attribution, and the negative controls: the same census with the MTP depths left out of both
  converters (``filter_fqns = ["mtp."]``, ``moe_fqns = ["layers."]``) loses exactly the MTP
  depths' share of the float8 FLOPs (computed from their shapes: ``eh_proj``, the block's
  linears, its experts), which moves to high precision; without float8 nothing is float8. By
  hand: an MTP forward that bypassed the module (``F.linear`` on ``eh_proj.weight``) fails the
  census (its 6 * n * 2 dim * dim FLOPs show up in high precision), and ``eh_proj`` kept by the
  converter's rule fails the decisions test.

Shapes: the debug flavor with 2 main blocks (dense, MoE) and D = 2 MTP depths (MoE, the chain
of the second depth reading the first's output), 2 x 32 tokens. Training with float8 and MTP
through train.py: tests/e2e/test_mtp_train.py (test_depth_two_trains_on_one_process). About 1.5 s.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from models.parallel.float8 import Float8Options, convert_to_float8, float8_decisions, float8_expert_decisions
from models.registry import build_model
from trainer.instruments.matmul_census import MatmulCensus

pytest.importorskip("torchao.float8")

pytestmark = pytest.mark.unit

LINEAR_OPS = ("mm", "addmm", "_scaled_mm")
DEPTH = 2


def _model(device: str = "cpu") -> nn.Module:
    torch.manual_seed(0)
    model = build_model("deepseek_v3", "debugmodel", device=device, n_layers=2, mtp_layers=DEPTH)
    if device != "meta":
        model.init_weights(0)
    return model


def _linears(model: nn.Module) -> dict[str, nn.Linear]:
    return {fqn: mod for fqn, mod in model.named_modules() if isinstance(mod, nn.Linear)}


def test_mtp_depths_convert_as_the_main_moe_block_plus_eh_proj():
    model = _model("meta")  # only shapes are read
    decisions = float8_decisions(model, Float8Options())
    main = {f.removeprefix("layers.1."): why for f, why in decisions.items() if f.startswith("layers.1.")}
    for k in range(DEPTH):
        depth = {f.removeprefix(f"mtp.{k}."): why for f, why in decisions.items() if f.startswith(f"mtp.{k}.")}
        assert depth == {**main, "eh_proj": None}, k
        assert main["moe.router.gate"] == "a MoE router" and main["attention.wq"] is None
        assert not isinstance(model.get_submodule(f"mtp.{k}.embed_tokens"), nn.Linear)  # a lookup
    assert decisions["output"] == "the output projection"  # the head the depths share
    assert len(decisions) == 7 + 8 + 1 + DEPTH * 9  # dense block, MoE block, head, each depth's
    experts = float8_expert_decisions(model, Float8Options(moe_fqns=("experts",)))
    assert experts == {"layers.1.moe.experts": None, **{f"mtp.{k}.moe.experts": None for k in range(DEPTH)}}


def _census(opts: Float8Options | None) -> tuple[dict[str, int], nn.Module]:
    """One forward + backward through the MTP path; (linear FLOPs in high precision, float8
    ``_scaled_mm`` FLOPs, high-precision ``_grouped_mm`` FLOPs) and the converted model."""
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 2048, (2, 32), generator=gen)
    mtp_tokens = torch.randint(0, 2048, (2, 32, DEPTH), generator=gen)
    model = _model()
    if opts is not None:
        convert_to_float8(model, opts, fsdp_all_gather=False)
    with MatmulCensus() as census:
        logits = model(tokens, mtp_tokens=mtp_tokens)
        assert logits.shape == (2, (1 + DEPTH) * 32, 2048)  # the head over main + every depth
        loss = logits.float().logsumexp(-1).mean()
        loss.backward()
    assert torch.isfinite(loss)
    flops = census.op_flops.items()
    f8 = sum(f for (op, dt), f in flops if op == "_scaled_mm" and dt.itemsize == 1)
    hp = sum(f for (op, dt), f in flops if op in LINEAR_OPS and dt.itemsize > 1)
    grouped = sum(f for (op, _), f in flops if op == "_grouped_mm")
    return {"f8": f8, "hp": hp, "grouped": grouped}, model


def test_census_float8_flops_are_exactly_the_converted_gemms_mtp_included():
    n = 2 * 32
    model = _model("meta")
    args, linears = model.args, _linears(model)
    decisions = float8_decisions(model, Float8Options())

    def gemms(fqns) -> int:  # forward, input gradient, weight gradient of each linear on n tokens
        return sum(6 * n * linears[f].in_features * linears[f].out_features for f in fqns)

    converted = [f for f, why in decisions.items() if why is None]
    in_mtp = [f for f in converted if f.startswith("mtp.")]
    assert {f.split(".", 2)[2] for f in in_mtp} >= {"eh_proj", "attention.wkv_a", "moe.shared_experts.w2"}
    expert_layer = n * args.n_activated_experts * 3 * 3 * 2 * args.dim * args.moe_inter_dim
    experts = (1 + DEPTH) * expert_layer  # layers.1 and each depth's MoE
    head = 6 * (1 + DEPTH) * n * args.dim * args.vocab_size  # the shared head, once over all states
    routers = gemms(f for f in decisions if f.endswith("router.gate"))
    mtp_share = gemms(in_mtp) + DEPTH * expert_layer

    off, _ = _census(None)
    on, converted_model = _census(Float8Options(moe_fqns=("experts",)))
    no_mtp, _ = _census(Float8Options(filter_fqns=("mtp.",), moe_fqns=("layers.",)))

    # negative control: no float8 without the converters
    assert off == {"f8": 0, "hp": gemms(converted) + head + routers, "grouped": experts}
    # every converted linear (the MTP depths' eh_proj and block linears too) and every routed
    # expert runs its three GEMMs in float8; the shared head and the routers stay high precision
    assert on == {"f8": gemms(converted) + experts, "hp": head + routers, "grouped": 0}
    assert type(converted_model.get_submodule("mtp.0.eh_proj")).__name__ == "Float8Linear"
    assert type(converted_model.get_submodule("output")) is nn.Linear
    # attribution: leaving the MTP depths out removes exactly their share from float8
    assert mtp_share > 0 and no_mtp == {
        "f8": on["f8"] - mtp_share,
        "hp": on["hp"] + gemms(in_mtp),
        "grouped": DEPTH * expert_layer,
    }
