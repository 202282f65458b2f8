"""Bad model/layout combinations fail before any process group or weight exists, with a message
that names the degrees, the rule and what to use instead.

Single process: ``ParallelDims`` validates on construction without building meshes, and
``models.registry.model_rules`` reads the rules' inputs from the real model args (llama3's GQA
``n_kv_heads``, deepseek_v3's ``n_routed_experts``), so these tests also prove that each model's
fields reach the rules. (tests/unit/test_validation.py covers the rules on raw numbers.)
"""

from __future__ import annotations

import dataclasses

import pytest

from models.parallel.activation_checkpoint import apply_activation_checkpointing
from models.parallel.fsdp import apply_fsdp
from models.parallelize import ParallelizeOptions, parallelize_model
from models.registry import build_model, get_model_spec, model_rules
from parallel_dims import ParallelDims, check_model_layout


def _dims(world_size: int, **degrees: int) -> ParallelDims:
    full = dict(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1) | degrees
    return ParallelDims(world_size=world_size, **full)


def _check_fits(args, pd: ParallelDims, seq_len: int, sequence_parallel: bool) -> None:
    """What trainer.plan.plan_job checks: the model's rules from the registry, on the degrees."""
    check_model_layout(pd.degrees, model_rules(args, seq_len, sequence_parallel))


def _args(model: str, **overrides):
    return dataclasses.replace(get_model_spec(model, "debugmodel").args, **overrides)


# (model, arg overrides, world size, degrees, seq_len, sequence_parallel, expected message)
BAD = {
    # llama3 debug: 16 query heads, 8 kv heads, 6 layers; deepseek_v3 debug: 16 heads, 8 experts
    "heads-not-divisible-by-tp": (
        "llama3",
        {},
        3,
        dict(tp=3),
        64,
        True,
        r"tp=3 does not divide n_heads=16: tensor parallelism splits attention heads; "
        r"legal tp values for this model: 1, 2, 4, 8, 16",
    ),
    "mla-heads-not-divisible-by-tp": (
        "deepseek_v3",
        {},
        32,
        dict(tp=32),
        64,
        True,
        r"tp=32 does not divide n_heads=16.*legal tp values for this model: 1, 2, 4, 8, 16",
    ),
    # tp=16 splits the 16 query heads but would split 8 kv heads in halves
    "gqa-kv-heads-not-divisible-by-tp": (
        "llama3",
        {},
        16,
        dict(tp=16),
        64,
        True,
        r"tp=16 does not divide n_kv_heads=8: each tp rank needs whole key/value heads \(GQA\); "
        r"legal tp values: 1, 2, 4, 8",
    ),
    "experts-not-divisible-by-ep": (
        "deepseek_v3",
        {},
        3,
        dict(dp_shard=3, ep=3),
        64,
        True,
        r"ep=3 does not divide n_routed_experts=8: each ep rank owns an equal share of the "
        r"experts; legal ep values: 1, 2, 4, 8",
    ),
    "more-ep-ranks-than-experts": (
        "deepseek_v3",
        {},
        16,
        dict(dp_shard=16, ep=16),
        64,
        True,
        r"ep=16 does not divide n_routed_experts=8.*legal ep values: 1, 2, 4, 8",
    ),
    "seq-len-with-cp-and-tp": (
        "llama3",
        {},
        4,
        dict(cp=2, tp=2),
        36,
        True,
        r"seq_len=36 is not divisible by 8 = 2\*cp\*tp: 2\*cp \(load-balanced context-parallel "
        r"chunks\) times tp \(sequence parallel splits the sequence across tp ranks\); use a multiple of 8",
    ),
    "seq-len-with-cp": (
        "deepseek_v3",
        {},
        2,
        dict(cp=2),
        34,
        True,
        r"seq_len=34 is not divisible by 4 = 2\*cp: 2\*cp \(load-balanced context-parallel chunks\); use a multiple of 4",
    ),
    "seq-len-with-tp": (
        "llama3",
        {},
        4,
        dict(tp=4),
        30,
        True,
        r"seq_len=30 is not divisible by 4 = tp: tp \(sequence parallel splits the sequence across tp "
        r"ranks\); use a multiple of 4",
    ),
    "fewer-layers-than-pp-stages": (
        "llama3",
        dict(n_layers=3),
        4,
        dict(pp=4),
        64,
        True,
        r"n_layers=3 is fewer than the 4 pipeline stages \(pp=4\); every stage needs at least one "
        r"layer: use pp <= 3",
    ),
    "moe-with-tp-needs-sequence-parallel": (
        "deepseek_v3",
        {},
        2,
        dict(tp=2),
        64,
        False,
        r"tp=2 with a MoE model needs sequence parallel \(each tp rank routes its own tokens\); "
        r"set parallelism.enable_sequence_parallel = true",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_model_layout_is_refused(case):
    model, overrides, world_size, degrees, seq_len, sp, message = BAD[case]
    pd = _dims(world_size, **degrees)  # the degrees alone are legal
    with pytest.raises(ValueError, match=message):
        _check_fits(_args(model, **overrides), pd, seq_len, sp)


@pytest.mark.parametrize(
    "model, world_size, degrees, sp",
    [
        ("llama3", 8, dict(tp=8), True),  # 8 kv heads: one per tp rank
        ("llama3", 2, dict(tp=2), False),  # a dense model may run tp without sequence parallel
        ("deepseek_v3", 16, dict(tp=16), True),  # MLA has no kv-head constraint
        ("deepseek_v3", 8, dict(dp_shard=2, cp=2, tp=2, ep=8), True),  # ep folded over dp*cp*tp
        ("deepseek_v3", 8, dict(dp_replicate=2, dp_shard=2, tp=2, ep=2, etp=2), True),
        ("llama3", 6, dict(pp=6), True),  # one layer per stage
    ],
)
def test_good_model_layouts_pass(model, world_size, degrees, sp):
    _check_fits(_args(model), _dims(world_size, **degrees), 64, sp)


def _meta_model(name: str):
    return build_model(name, "debugmodel", device="meta", n_layers=2)


@pytest.mark.parametrize(
    "opts, message",
    [
        (dict(ac_mode="partial"), r"activation_checkpoint.mode='partial'; legal values: none, full, selective"),
        (
            dict(ac_mode="selective", ac_selective_option="every"),
            r"selective_ac_option='every'; legal values: 'op' or a positive integer N",
        ),
        (dict(ac_mode="selective", ac_selective_option="0"), r"selective_ac_option='0'"),
    ],
)
def test_bad_activation_checkpointing_options(opts, message):
    # a one-rank layout: the AC option is rejected before FSDP would need a process group
    with pytest.raises(ValueError, match=message):
        parallelize_model(_meta_model("llama3"), _dims(1), ParallelizeOptions(**opts))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(param_dtype="float8"), r"dtype 'float8'; legal values: float32, bfloat16, float16"),
        (dict(reduce_dtype="fp32"), r"dtype 'fp32'; legal values: float32, bfloat16, float16"),
        (
            dict(reshard_after_forward="sometimes"),
            r"fsdp_reshard_after_forward='sometimes'; legal values: default, always, never",
        ),
    ],
)
def test_bad_fsdp_options(kwargs, message):
    with pytest.raises(ValueError, match=message):
        apply_fsdp(_meta_model("deepseek_v3"), None, None, **kwargs)


def test_ac_refuses_before_touching_the_model():
    model = _meta_model("llama3")
    forwards = [b.forward for b in model.layers.values()]
    with pytest.raises(ValueError):
        apply_activation_checkpointing(model, "selective", "-1")
    assert [b.forward for b in model.layers.values()] == forwards
