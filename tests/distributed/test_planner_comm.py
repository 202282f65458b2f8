"""The layout planner's predicted collectives (tools/planner/collectives.py) against what the
trainer really issues, recorded on real gloo ranks (parallel_dims/comm_record.py through the
trainer's ``comm.record_step``), for every layout of the CPU proof matrix (README "Comparing
loss curves across layouts").

What is compared, per layout and per rank: the planner's ``(kind, mesh, bytes of one call) ->
calls per optimizer step`` against the recorded step's, EXACTLY, over every kind and mesh the
step issues (FSDP2 all-gathers / reduce-scatters, HSDP all-reduces, TP/SP activation
collectives, loss-parallel and norm-gradient all-reduces, CP's K/V collectives, pipeline
send/recv, the loss / grad-norm / MoE-load all-reduces, EP's count exchanges). One exception,
narrow and explicit: the bytes of EP's and ETP's TOKEN all-to-alls (float rows; not the int64
count exchanges) depend on where the router sends each token, which no planner can know. For
them the test compares per rank the number of calls on each mesh exactly, and the bytes summed
over the whole world exactly: every row a rank sends is received by another, so the world's
total equals the planner's balanced-routing assumption summed over the ranks.

Each layout is one real 4-rank launch (``tools.launcher.run_distributed``) training 2 steps of a
2-layer (llama3) / 3-layer (deepseek_v3) debug model, 32 tokens per sequence, 2 micro-batches of
2 sequences per rank (gradient accumulation is part of what is checked), recording step 2
(steady state: step 1 also runs the pipeline's one-off shape exchange). One launch per layout,
not all layouts in one launch: several Trainers in one process share DTensor's sharding caches,
so later layouts' gradients can carry mesh objects (and process groups) of earlier ones, and the
recorded collectives would then name groups of a previous layout. A training job builds one
Trainer per process, so a fresh launch per layout is what a job does.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from tools.launcher import run_distributed

WORLD = 4
SEQ = 32
LOCAL = 2
ACCUM = 2
RECORD_STEP = 2
N_LAYERS = {"llama3": 2, "deepseek_v3": 3}  # deepseek: one dense layer, two MoE layers

# the CPU proof matrix, all on 4 ranks
LAYOUTS = {
    "llama3 fsdp=4": ("llama3", dict(dp_shard=4)),
    "llama3 dp_replicate=2,fsdp=2": ("llama3", dict(dp_replicate=2, dp_shard=2)),
    "llama3 tp=2,fsdp=2": ("llama3", dict(dp_shard=2, tp=2)),
    "llama3 cp=2,tp=2": ("llama3", dict(dp_shard=1, cp=2, tp=2)),
    "llama3 pp=2,fsdp=2": ("llama3", dict(dp_shard=2, pp=2)),
    "deepseek_v3 fsdp=4,ep=2": ("deepseek_v3", dict(dp_shard=4, ep=2)),
    "deepseek_v3 fsdp=2,tp=2,ep=2,etp=2": ("deepseek_v3", dict(dp_shard=2, tp=2, ep=2, etp=2)),
    "deepseek_v3 pp=2,fsdp=2": ("deepseek_v3", dict(dp_shard=2, pp=2)),
}

_KEYS = {
    "dp_replicate": "--parallelism.data_parallel_replicate_degree",
    "dp_shard": "--parallelism.data_parallel_shard_degree",
    "cp": "--parallelism.context_parallel_degree",
    "tp": "--parallelism.tensor_parallel_degree",
    "pp": "--parallelism.pipeline_parallel_degree",
    "ep": "--parallelism.expert_parallel_degree",
    "etp": "--parallelism.expert_tensor_parallel_degree",
}

ROUTED = "routed"  # the bytes key of a token all-to-all (see the module docstring)


def _argv(model: str, degrees: dict, folder: str) -> list[str]:
    batch_degree = degrees.get("dp_replicate", 1) * degrees.get("dp_shard", 1)
    argv = [
        *("--config", f"{model}.toml", "--model.n_layers", str(N_LAYERS[model])),
        *("--training.seq_len", str(SEQ), "--training.local_batch_size", str(LOCAL)),
        *("--training.global_batch_size", str(LOCAL * ACCUM * batch_degree)),
        *("--training.steps", str(RECORD_STEP), "--comm.record_step", str(RECORD_STEP)),
        *("--training.prefetch", "false", "--checkpoint.enable", "false"),
        *("--metrics.enable_tensorboard", "false", "--job.dump_folder", folder),
    ]
    for name, key in _KEYS.items():
        argv += [key, str(degrees.get(name, 1))]
    return argv


def _record(rank: int, world_size: int, folder: str, name: str) -> list[dict]:
    """One layout on this rank through the real Trainer: the records of the recorded step."""
    from trainer.config import load_config
    from trainer.train import Trainer

    model, degrees = LAYOUTS[name]
    Trainer(load_config(_argv(model, degrees, folder))).train()
    with open(Path(folder) / f"comm_rank{rank}.json") as f:
        return json.load(f)["records"]


def _plan(name: str):
    from trainer.config import load_config
    from trainer.plan import plan_job

    model, degrees = LAYOUTS[name]
    return plan_job(load_config(_argv(model, degrees, "unused")), WORLD, tokenizer_vocab=2048)


def predicted(name: str, rank: int) -> list[dict]:
    """The planner's records for ``rank`` of the layout, from the trainer's own job plan of
    the same config (batch split, schedule, micro-batches, dtypes, SP / loss parallel, AC)."""
    from tools.planner.collectives import LayoutChoice, predict_collectives
    from trainer.plan import model_overrides

    plan = _plan(name)
    p, opts, pd = plan.config.parallelism, plan.parallelize, plan.parallel_dims
    pp = pd.degrees.pp > 1
    choice = LayoutChoice(
        global_batch=plan.batch.global_batch_size,
        local_batch=plan.batch.local_batch_size,
        seq_len=plan.batch.seq_len,
        schedule=p.pipeline_parallel_schedule if pp else None,
        n_microbatches=p.pipeline_microbatches() if pp else None,
        ac=opts.ac_mode,
        reshard=opts.reshard_after_forward,
        param_dtype=opts.param_dtype,
        reduce_dtype=opts.reduce_dtype,
        sequence_parallel=opts.sequence_parallel,
        loss_parallel=opts.loss_parallel,
    )
    overrides = model_overrides(plan.config, 2048)
    return predict_collectives(LAYOUTS[name][0], "debugmodel", pd.degrees, choice, rank, **overrides)


def _token_exchange(kind: str, mesh: str) -> bool:
    return kind == "all_to_all" and mesh in ("ep", "etp")


def _routed_predicted(r: dict, count_exchange_bytes: int) -> bool:
    """A planner record of token all-to-alls: all but the int64 count exchange (whose size,
    ``8 * n_routed_experts``, no token exchange has: rows are ``dim`` floats)."""
    return _token_exchange(r["kind"], r["mesh"]) and r["bytes"] != count_exchange_bytes


def _routed_measured(r: dict) -> bool:
    """A recorded token all-to-all: the floating-point ones (the count exchange is int64)."""
    return _token_exchange(r["kind"], r["mesh"]) and r["dtype"] != "int64"


def predicted_calls(records: list[dict], count_exchange_bytes: int) -> Counter:
    """(kind, mesh, bytes) -> calls of the planner's records, token all-to-alls under bytes =
    ROUTED."""
    out: Counter = Counter()
    for r in records:
        out[(r["kind"], r["mesh"], ROUTED if _routed_predicted(r, count_exchange_bytes) else r["bytes"])] += r["count"]
    return out


def measured_calls(records: list[dict]) -> Counter:
    """The same from a recorder's records (one record per call)."""
    out: Counter = Counter()
    for r in records:
        out[(r["kind"], r["mesh"], ROUTED if _routed_measured(r) else r["bytes"])] += 1
    return out


def predicted_routed_bytes(records: list[dict], count_exchange_bytes: int) -> Counter:
    """(kind, mesh) -> bytes of the token all-to-alls the planner predicts in a step."""
    out: Counter = Counter()
    for r in records:
        if _routed_predicted(r, count_exchange_bytes):
            out[(r["kind"], r["mesh"])] += r["bytes"] * r["count"]
    return out


def measured_routed_bytes(records: list[dict]) -> Counter:
    out: Counter = Counter()
    for r in records:
        if _routed_measured(r):
            out[(r["kind"], r["mesh"])] += r["bytes"]
    return out


def compare(want: Counter, got: Counter) -> list[str]:
    """Every (kind, mesh, bytes) whose call count differs, as readable lines ([] = equal)."""
    keys = sorted(set(want) | set(got), key=lambda k: (k[1], k[0], str(k[2])))
    return [
        f"{kind} on {mesh}, {nbytes} B per call: predicted {want.get(k, 0)}, recorded {got.get(k, 0)}"
        for k in keys
        for kind, mesh, nbytes in [k]
        if want.get(k, 0) != got.get(k, 0)
    ]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_predicted_collectives_equal_a_recorded_step(name, tmp_path):
    from tools.planner.inventory import model_inventory

    records = run_distributed(_record, WORLD, str(tmp_path), name, timeout=240)
    _, args = model_inventory(LAYOUTS[name][0], "debugmodel")
    exchange = 8 * args.n_routed_experts if args.has_experts else -1
    predictions = [predicted(name, rank) for rank in range(WORLD)]
    for rank in range(WORLD):
        want, got = predicted_calls(predictions[rank], exchange), measured_calls(records[rank])
        assert got, f"{name} rank {rank}: nothing recorded"
        mismatches = compare(want, got)
        assert not mismatches, f"{name} rank {rank}:\n  " + "\n  ".join(mismatches)
        # the comparison can fail: the prediction without any one of its records differs
        for dropped in want:
            mutated = want.copy()
            del mutated[dropped]
            assert compare(mutated, got), (name, rank, dropped)
    # token all-to-alls: the world's total bytes per mesh equal the planner's
    want_routed = sum((predicted_routed_bytes(p, exchange) for p in predictions), Counter())
    got_routed = sum((measured_routed_bytes(r) for r in records), Counter())
    assert want_routed == got_routed, name
    if LAYOUTS[name][1].get("ep", 1) > 1:
        assert want_routed[("all_to_all", "ep")] > 0


def test_compare_names_each_difference():
    want = Counter({("all_gather", "fsdp", 64): 4, ("all_reduce", "loss", 4): 1})
    assert compare(want, want.copy()) == []
    got = Counter({("all_gather", "fsdp", 64): 3, ("all_reduce", "tp", 4): 1})
    assert compare(want, got) == [
        "all_gather on fsdp, 64 B per call: predicted 4, recorded 3",
        "all_reduce on loss, 4 B per call: predicted 1, recorded 0",
        "all_reduce on tp, 4 B per call: predicted 0, recorded 1",
    ]
