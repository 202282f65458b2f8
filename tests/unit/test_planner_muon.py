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

Parameter-group routing (``[[optimizer.param_groups]]``, the trainer's
``trainer.optim.groups.choose``): a config routing ``w2`` to AdamW and the output head
(2048 x 256, 524,288 elements) to Muon, read by ``estimate_from_config``. Hand count: per block
the six matrices but w2, 589,824 elements and 2 x 503,316,480 + 2 x 104,857,600 +
2 x 1,174,405,120 = 3,565,158,400 FLOPs; the head 5 (4 x 256^2 x 2048 + 2 x 256^3) =
2,852,126,720 FLOPs. Per fsdp rank: (2 x 589,824 + 524,288) / 2 = 851,968 Muon elements.

- gather: 2 x 3,565,158,400 + 2,852,126,720 = 9,982,443,520 FLOPs; all-gathers: 4 of 262,144 B,
  4 of 131,072 B, 4 of 786,432 B (w1, w3), 1 of 2,097,152 B (the head);
- round_robin (longest first to the least loaded): owner 0 gets the head, one FFN matrix and
  two 256 x 256 (5,033,164,800 FLOPs, 851,968 whole elements), owner 1 the rest (4,949,278,720):
  the busiest 5,033,164,800; two all-to-all rounds of 4 x 851,968 = 3,407,872 B;
- state: 8 x 1,311,360 local elements - 4 x 851,968 = 7,083,008 B.

And against the trainer's real optimizer (``trainer.optim.optimizers.build_optimizer`` after one step,
sharded models on the fake backend, ``tools.planner.measure``): the Muon parameter groups' local
elements and the optimizer state bytes equal the planner's, for llama3 fsdp=2 x tp=2 (the head
under TP) and for LoRA with expert adapters on deepseek_v3 fsdp=2 x tp=2 x ep=2 x etp=2 (Muon
takes the adapters; a table routes the experts' ``w2`` adapters and the attention's to AdamW).
Negative control: the default routing's prediction differs from both measurements.
"""

from __future__ import annotations

import dataclasses

import pytest

from models.parallel.lora import LoRAOptions
from parallel_dims.layout import validate_degrees
from tools.planner.choice import LayoutChoice
from tools.planner.estimate import Job, _muon, estimate, memory_for_rank
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


ROUTED_FLOPS = 3_565_158_400  # one block without w2
HEAD_FLOPS = 2_852_126_720
GROUPS = "[{pattern = 'w2', optimizer = 'AdamW'}, {pattern = '^output', optimizer = 'Muon'}]"


def _from_config(scheme: str, groups: str | None = GROUPS):
    from tools.planner.from_config import estimate_from_config
    from trainer.config import load_config

    argv = ["--config", "llama3.toml", "--model.n_layers", "2", "--parallelism.dp_shard", "2",
            "--training.seq_len", "64", "--training.local_batch_size", "2", "--optimizer.name", "Muon",
            "--optimizer.muon_distribution", scheme]  # fmt: skip
    est = estimate_from_config(
        load_config(argv + (["--optimizer.param_groups", groups] if groups else [])),
        2, load_hardware("h100"), tokenizer_vocab=2048,
    )  # fmt: skip
    job = Job("llama3", "debugmodel", 2, 8, 64, 2, load_hardware("h100"), optimizer="Muon",
              model_overrides=(("n_layers", 2), ("vocab_size", 2048)), muon_distribution=scheme,
              param_groups=(("w2", "AdamW"), ("^output", "Muon")) if groups else ())  # fmt: skip
    # the config's routing reached the estimate: it is this job's, Newton-Schulz time and exchange included
    assert estimate(job, est.degrees, est.choice).time == est.time
    return est, _muon(job, est.degrees, est.choice, 0)


def test_routed_groups_hand_count_gather():
    est, c = _from_config("gather")
    assert c.local_numel == 851_968
    assert c.ns_flops == 2 * ROUTED_FLOPS + HEAD_FLOPS
    got = {(r["kind"], r["bytes"]): r["count"] for r in c.comm}
    assert got == {
        ("all_gather", 4 * 32_768): 4,
        ("all_gather", 4 * 65_536): 4,
        ("all_gather", 4 * 196_608): 4,
        ("all_gather", 4 * 524_288): 1,
    }
    assert est.memory["optimizer"] == 7_083_008
    # negative control: the default routing (w2 in Muon, the head in AdamW) counts otherwise
    default_est, default = _from_config("gather", None)
    assert (default.local_numel, default.ns_flops) == (786_432, 2 * BLOCK_FLOPS)
    assert default_est.memory["optimizer"] != est.memory["optimizer"]


def test_routed_groups_hand_count_round_robin():
    est, c = _from_config("round_robin")
    assert (c.local_numel, c.ns_flops) == (851_968, 5_033_164_800)
    assert [dict(r) for r in c.comm] == [
        {"kind": "all_to_all", "axes": ("fsdp",), "group_size": 2, "count": 2, "bytes": 3_407_872}
    ]
    assert est.memory["optimizer"] == 7_083_008
    _, default = _from_config("round_robin", None)
    assert (default.ns_flops, default.comm[0]["bytes"]) == (BLOCK_FLOPS, 3_145_728)


# (model, degrees, rank, optimizer section, LoRA): the trainer's optimizer on the real sharded model
MEASURED = [
    ("llama3", dict(dp_shard=2, tp=2, world_size=4), 1,
     {"name": "Muon", "param_groups": [{"pattern": "w2", "optimizer": "AdamW"}, {"pattern": "^output", "optimizer": "Muon"}]},
     None),
    ("deepseek_v3", dict(dp_shard=2, tp=2, ep=2, etp=2, world_size=4), 3,
     {"name": "Muon", "param_groups": [{"pattern": "w2_lora", "optimizer": "AdamW"}, {"pattern": "attention", "optimizer": "AdamW"}]},
     dict(rank=4, experts=True)),
]  # fmt: skip


def _predicted(model, degrees, rank, optimizer, lora, routed=True):
    d = validate_degrees(**degrees)
    groups = tuple((t["pattern"], t.get("optimizer")) for t in optimizer.get("param_groups", ())) if routed else ()
    job = Job(
        model, "debugmodel", d.world_size, 8, 64, 2 * d.dp_shard, load_hardware("h100"), param_dtype="float32",
        optimizer="Muon", param_groups=groups, lora=LoRAOptions(**lora) if lora else None,
    )  # fmt: skip
    choice = LayoutChoice(global_batch=job.global_batch, local_batch=2, seq_len=64, param_dtype="float32")
    return memory_for_rank(job, d, choice, rank)["optimizer"], _muon(job, d, choice, rank).local_numel


def test_routed_state_equals_the_trainers_optimizer():
    from concurrent.futures import ThreadPoolExecutor

    from tests.distributed.run_json import run_on_own_process

    def measure(case):
        model, degrees, rank, optimizer, lora = case
        return run_on_own_process(
            "tools.planner.measure:measure_training_state", model, "debugmodel", degrees, rank, "float32",
            lora=lora, optimizer=optimizer,
        )  # fmt: skip

    with ThreadPoolExecutor(2) as pool:
        measured = list(pool.map(measure, MEASURED))
    for case, got in zip(MEASURED, measured):
        want = (got["optimizer_bytes"], got["muon_local_numel"])
        assert got["muon_local_numel"] > 0, case
        assert _predicted(*case) == want, (case, got)
        assert _predicted(*case, routed=False) != want, case  # negative control: the default routing
