"""The layout planner's per-rank compute (tools/planner/compute.py) against what one rank of the
layout really computes, measured on the fake backend.

Each layout runs ONE rank of its job through ``train.py`` with ``comm.mode = "fake_backend"``
(the real meshes, sharding, pipeline split and schedule; no-op collectives; for MoE balanced
routing, see trainer/simulation/fake_backend.py), and ``profiling.matmul_census_step`` counts the FLOPs of
every matmul-class op of the step at the rank's local shard shapes (GEMMs forward and backward,
scaled-dot-product attention forward and backward). The planner's prediction for the same rank,
from the trainer's own job plan of the same config, must equal it EXACTLY: tensor-parallel
splits, sequence-parallel router/expert shards, MLA's replicated low-rank projections under TP,
expert and expert-tensor parallel, context-parallel query shards, the pipeline's uneven stages
(first stage vs last stage with the output projection), gradient accumulation and pipeline
micro-batches, full AC's recomputed forward, LoRA's frozen base and adapters (TP, EP, expert
adapters, full AC), selective AC's none with the per-op policy and
the fully checkpointed blocks' with its every-N-th-block option, one rank of a 64-rank job, and
float8 (``model.converters``): the FLOPs of the converted linears and routed experts, which the
census counts by their float8 operands, DeepSeek-V3's MTP depths included (the last stage of
tp=2 x pp=2: their ``eh_proj`` on the rank's sequence shard, by hand a planner that priced it in
high precision was short of the census by exactly its 6 x 64 tokens x 512 x 256 FLOPs). All layouts run one after another in one process (forked from
tools/forkserver.py's server; DTensor's caches are dropped between them), one optimizer step each.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest

from parallel_dims.axes import AXES

pytestmark = [pytest.mark.distributed, pytest.mark.fake_backend]

SEQ, LOCAL, ACCUM = 32, 2, 2
N_LAYERS = {"llama3": 2, "deepseek_v3": 3}  # deepseek: one dense layer, two MoE layers


class Case(NamedTuple):
    model: str
    degrees: dict
    rank: int = 0
    config: tuple = ()


_AC_FULL = (("activation_checkpoint.mode", "full"),)
CASES = {
    "llama3 fsdp=2": Case("llama3", dict(dp_shard=2)),
    "llama3 tp=2,fsdp=2 rank 1": Case("llama3", dict(dp_shard=2, tp=2), 1),
    "llama3 cp=2,tp=2": Case("llama3", dict(dp_shard=1, cp=2, tp=2), 3),
    "llama3 pp=2,fsdp=2 first stage": Case("llama3", dict(dp_shard=2, pp=2), 0),
    "llama3 pp=2,fsdp=2 last stage": Case("llama3", dict(dp_shard=2, pp=2), 2),
    "llama3 fsdp=4 full AC": Case("llama3", dict(dp_shard=4), 0, _AC_FULL),
    "llama3 tp=2,fsdp=2 selective AC": Case("llama3", dict(dp_shard=2, tp=2), 0, (("activation_checkpoint.mode", "selective"),)),
    "llama3 fsdp=8,tp=8 rank 17 of 64": Case("llama3", dict(dp_shard=8, tp=8), 17),
    "deepseek_v3 tp=2,fsdp=2": Case("deepseek_v3", dict(dp_shard=2, tp=2), 1),
    "deepseek_v3 fsdp=4,ep=2": Case("deepseek_v3", dict(dp_shard=4, ep=2), 2),
    "deepseek_v3 fsdp=2,tp=2,ep=2,etp=2 full AC": Case("deepseek_v3", dict(dp_shard=2, tp=2, ep=2, etp=2), 0, _AC_FULL),
    "deepseek_v3 pp=2,fsdp=2 last stage": Case("deepseek_v3", dict(dp_shard=2, pp=2), 3),
    # every 2nd block of each stage fully checkpointed: on the first stage the dense block 0 of
    # its dense + MoE blocks
    "deepseek_v3 pp=2,fsdp=2 first stage selective AC every 2": Case(
        "deepseek_v3", dict(dp_shard=2, pp=2), 0,
        (("activation_checkpoint.mode", "selective"), ("activation_checkpoint.selective_ac_option", "2")),
    ),
    # float8 (model.converters): the converted linears' FLOPs, counted in float8 by the census
    "llama3 fsdp=2 float8 full AC": Case("llama3", dict(dp_shard=2), 1, (("model.converters", "float8"), *_AC_FULL)),
    "deepseek_v3 tp=2,fsdp=2 float8": Case("deepseek_v3", dict(dp_shard=2, tp=2), 1, (("model.converters", "float8"),)),
    # and the routed experts' grouped GEMMs (one float8 torch._scaled_mm per expert on CPU), split
    # over ep and etp, recomputed by full AC
    "deepseek_v3 fsdp=2,tp=2,ep=2,etp=2 float8 + float8_experts full AC": Case(
        "deepseek_v3", dict(dp_shard=2, tp=2, ep=2, etp=2), 3, (("model.converters", "float8,float8_experts"), *_AC_FULL),
    ),
    # LoRA (model.converters): no weight-gradient GEMMs of the frozen base, the adapters' GEMMs
    # sharded like their base under TP, the per-expert merges split by ep, full AC's recompute
    "llama3 tp=2,fsdp=2 lora full AC": Case("llama3", dict(dp_shard=2, tp=2), 1, (("model.converters", "lora"), *_AC_FULL)),
    "deepseek_v3 tp=2,fsdp=2,ep=2 lora experts": Case(
        "deepseek_v3", dict(dp_shard=2, tp=2, ep=2), 2, (("model.converters", "lora"), ("lora.experts", "true")),
    ),
    # DeepSeek-V3 multi-token prediction: the MTP block (MoE, after the main blocks, on the last
    # stage), its eh_proj on the sequence shard under TP, the output projection over the main and
    # the depth's states
    "deepseek_v3 mtp=1 tp=2,fsdp=2": Case("deepseek_v3", dict(dp_shard=2, tp=2), 1, (("model.mtp_layers", "1"),)),
    "deepseek_v3 mtp=2 pp=2,fsdp=2 last stage full AC": Case(
        "deepseek_v3", dict(dp_shard=2, pp=2), 3, (("model.mtp_layers", "2"), *_AC_FULL),
    ),
    # and in float8 on the last stage of tp x pp: the depth's eh_proj (replicated, on the rank's
    # sequence shard), its block's linears and routed experts float8, the shared head not
    "deepseek_v3 mtp=1 pp=2,tp=2 last stage float8 + float8_experts": Case(
        "deepseek_v3", dict(dp_shard=1, pp=2, tp=2), 3,
        (("model.mtp_layers", "1"), ("model.converters", "float8,float8_experts")),
    ),
}  # fmt: skip
FLOAT8_CASES = [name for name in CASES if "float8" in name]

# the config key of each degree, from the axis table
_KEYS = {a.name: f"--parallelism.{a.config_key}" for a in AXES}


def _world(case: Case) -> int:
    d = case.degrees
    return d.get("dp_replicate", 1) * d.get("dp_shard", 1) * d.get("cp", 1) * d.get("tp", 1) * d.get("pp", 1)


def _argv(case: Case, folder: str) -> list[str]:
    d = case.degrees
    batch_degree = d.get("dp_replicate", 1) * d.get("dp_shard", 1)
    argv = [
        *("--config", f"{case.model}.toml", "--model.n_layers", str(N_LAYERS[case.model])),
        *("--training.seq_len", str(SEQ), "--training.local_batch_size", str(LOCAL)),
        *("--training.global_batch_size", str(LOCAL * ACCUM * batch_degree)),
        *("--training.steps", "1", "--profiling.matmul_census_step", "1"),
        *("--training.prefetch", "false", "--checkpoint.enable", "false", "--metrics.enable_tensorboard", "false"),
        *("--comm.mode", "fake_backend", "--comm.fake_world_size", str(_world(case))),
        *("--comm.fake_rank", str(case.rank), "--job.dump_folder", folder),
        # AdamW has no matmul to count; fused, it costs DTensor's first-use sharding propagation
        # far less than the CPU default foreach
        *("--optimizer.implementation", "fused"),
    ]
    for name, key in _KEYS.items():
        argv += [key, str(d.get(name, 1))]
    for key, value in case.config:
        argv += [f"--{key}", value]
    return argv


def predicted_flops(case: Case) -> dict:
    from tools.planner.compute import rank_matmul_flops
    from tools.planner.from_config import choice_from_plan
    from trainer.config import load_config
    from trainer.plan import model_overrides, plan_job

    cfg = load_config(_argv(case, "unused"))
    plan = plan_job(cfg, _world(case), tokenizer_vocab=2048)
    overrides = model_overrides(plan.config, 2048)
    return rank_matmul_flops(
        case.model, "debugmodel", plan.parallel_dims.degrees, choice_from_plan(plan), case.rank,
        lora=plan.parallelize.lora, **overrides,
    )  # fmt: skip


@pytest.fixture(scope="module")
def censuses(tmp_path_factory) -> dict[str, dict]:
    """Every case's census, the runs one after another on ONE process forked from
    tools/forkserver.py's server (torch and the trainer imported once; a process of its own, as
    the fake backend's process group needs), one intra-op thread (the census counts FLOPs, not
    time)."""
    from tests.distributed.run_json import run_on_own_process

    root = tmp_path_factory.mktemp("census")
    argvs = [_argv(case, str(root / f"case{i}")) for i, case in enumerate(CASES.values())]
    return dict(zip(CASES, run_on_own_process("tools.planner.measure:census_of_runs", argvs, timeout=900)))


@pytest.mark.parametrize("name", list(CASES))
def test_predicted_rank_flops_equal_the_census_of_a_fake_backend_step(name, censuses):
    case, census = CASES[name], censuses[name]
    assert census["local_shapes"] and census["rank"] == case.rank and census["world_size"] == _world(case)
    want = predicted_flops(case)
    assert census["total_flops"] == want["total"], (name, census["calls"], want)


@pytest.mark.parametrize("name", FLOAT8_CASES)
def test_predicted_float8_flops_equal_the_census(name, censuses):
    """The planner prices at the float8 peak exactly the FLOPs that ran as float8 GEMMs (the
    census counts torchao's float8 matmuls by their payload's dtype): the planner and the
    converter agree on which linears convert, under TP and full AC too."""
    census, want = censuses[name], predicted_flops(CASES[name])
    got = sum(census["share"].get(d, 0.0) for d in ("float8_e4m3fn", "float8_e5m2")) * census["total_flops"]
    f8 = want["forward_float8"] + want["backward_float8"] + want["recompute_float8"]
    assert 0 < f8 < want["total"] and got == pytest.approx(f8, rel=1e-12), (name, census["calls"], want)


def test_float8_experts_run_in_float8(censuses):
    """Not vacuous: with ``float8_experts`` the census's float8 FLOPs are those of the linears
    alone (the planner's figure for the same layout with ``float8`` only) plus the routed
    experts' GEMMs, written out from the debug model's shapes: each of the rank's sequence-parallel
    tokens through top_k = 2 experts of 3 weights of dim 256 x hidden 256 in the 2 MoE layers,
    forward + 2 x backward + full AC's recomputed forward."""
    name = "deepseek_v3 fsdp=2,tp=2,ep=2,etp=2 float8 + float8_experts full AC"
    census = censuses[name]
    got = sum(census["share"].get(d, 0.0) for d in ("float8_e4m3fn", "float8_e5m2")) * census["total_flops"]
    linears = predicted_flops(CASES[name]._replace(config=(("model.converters", "float8"), *_AC_FULL)))
    tokens = LOCAL * ACCUM * SEQ // 2  # tp = 2
    experts = 4 * tokens * 2 * 2 * 3 * 2 * 256 * 256
    f8_linears = linears["forward_float8"] + linears["backward_float8"] + linears["recompute_float8"]
    assert got == pytest.approx(f8_linears + experts, rel=1e-12)


def test_the_comparison_sees_the_differences_the_layouts_make(censuses):
    """Not vacuous: the layouts' measured FLOPs differ where the planner says they should."""
    c = {n: censuses[n]["total_flops"] for n in CASES}
    # the last stage also runs the output projection
    assert c["llama3 pp=2,fsdp=2 last stage"] > c["llama3 pp=2,fsdp=2 first stage"]
    # full AC recomputes the blocks' forward; TP splits the work
    assert c["llama3 fsdp=4 full AC"] > c["llama3 fsdp=2"] / 2 * 1.2
    assert c["llama3 tp=2,fsdp=2 rank 1"] < c["llama3 fsdp=2"]
    # MLA's replicated low-rank projections run on every TP rank: TP halves less than the work
    forward_only = predicted_flops(CASES["deepseek_v3 tp=2,fsdp=2"])
    assert forward_only["total"] == c["deepseek_v3 tp=2,fsdp=2"]
