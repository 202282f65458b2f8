"""trainer/plan.py: one pure job plan (no process group, no weights), or one error listing
every problem."""

from __future__ import annotations

import pytest

from trainer.config import ConfigError, load_config
from trainer.plan import plan_job
from trainer.plan_report import format_plan


def cfg(*args):
    return load_config(["--config", "llama3.toml", *args])


def test_plan_of_the_debug_config():
    plan = plan_job(cfg("--parallelism.tp", "2", "--training.global_batch_size", "16"), 4)
    d = plan.parallel_dims.degrees
    assert (d.dp_shard, d.tp, d.world_size) == (2, 2, 4)
    assert plan.model_args.vocab_size == 2048 and plan.model_args.max_seq_len >= 128
    b = plan.batch
    assert (b.global_batch_size, b.batch_degree, b.local_batch_size, b.grad_accum_steps) == (16, 2, 4, 2)
    assert b.tokens_per_step == 16 * 128
    assert plan.parallelize.sequence_parallel and plan.stages is None
    text = format_plan(plan)
    assert "dp_shard=2" in text and "2 batch ranks x 2 micro-batch(es) of 4" in text


def test_pipeline_stage_plan():
    plan = plan_job(cfg("--parallelism.pp", "2", "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"), 4)
    s = plan.stages
    assert s.num_stages == 4 and s.stages_per_rank == 2 and s.n_microbatches == 2
    assert s.layer_ranges[0][0] == 0 and s.layer_ranges[-1][1] == plan.model_args.n_layers


@pytest.mark.parametrize("schedule", ["InterleavedZeroBubble", "ZBVZeroBubble"])
def test_resharding_after_forward_is_refused_with_a_split_backward(schedule):
    """A zero-bubble stage's weight half never computes the gradients of FSDP groups resharded
    after forward (recorded: InterleavedZeroBubble, pp=2 x fsdp=2, 8 layers: one block's
    reduce-scatter missing per step on the second pp rank and a smaller step-1 grad norm than
    with 'default'); the combination is refused, the other policies and schedules are not."""
    args = ("--parallelism.pp", "2", "--model.n_layers", "4", "--parallelism.pipeline_parallel_schedule")
    with pytest.raises(ConfigError, match=r"fsdp_reshard_after_forward='always' with the .* schedule"):
        plan_job(cfg(*args, schedule, "--parallelism.fsdp_reshard_after_forward", "always"), 4)
    for policy in ("default", "never"):
        plan_job(cfg(*args, schedule, "--parallelism.fsdp_reshard_after_forward", policy), 4)
    for other in ("1F1B", "GPipe", "Interleaved1F1B", "LoopedBFS"):
        plan_job(cfg(*args, other, "--parallelism.fsdp_reshard_after_forward", "always"), 4)


def test_every_problem_in_one_error():
    bad = cfg(
        "--parallelism.tp",
        "3",  # does not divide the world
        "--model.vocab_size",
        "100",  # smaller than the tokenizer
    )
    with pytest.raises(ConfigError) as err:
        plan_job(bad, 8)
    message = str(err.value)
    assert message.startswith("2 problems with this job on world_size=8:")
    assert "tp=3 does not divide world_size=8" in message
    assert "model.vocab_size=100 is smaller than the tokenizer's vocabulary" in message


def test_model_layout_and_batch_rules_are_checked():
    with pytest.raises(ConfigError) as err:
        plan_job(cfg("--parallelism.tp", "4", "--training.global_batch_size", "12", "--parallelism.dp_shard", "2"), 8)
    message = str(err.value)
    assert "tp=4 does not divide n_kv_heads=8" not in message  # 8 kv heads: tp=4 is legal
    assert "global_batch_size=12 is not divisible by the batch degree dp_replicate*dp_shard = 2" not in message
    assert "local_batch_size=4 does not divide the 6 samples each batch rank gets" in message
    with pytest.raises(ConfigError, match=r"tp=32 does not divide n_heads=16"):
        plan_job(cfg("--parallelism.tp", "32"), 32)


def test_describe_cli_prints_the_plan_of_a_config():
    """``python -m trainer.plan_report --config ...`` (run on a process forked from
    tools/forkserver.py's server; the old form ``python -m parallel_dims --config`` forwards to it:
    tests/unit/test_moved_commands.py)."""
    import json

    from tests.distributed.run_json import run_module_on_own_process

    args = ["--config", "llama3.toml", "--world-size", "4", "--tp", "2", "--rank", "1", "--json"]
    res = run_module_on_own_process("trainer.plan_report", *args)
    assert res.returncode == 0, res.stderr[-2000:]
    info = json.loads(res.stdout)
    assert info["degrees"]["tp"] == 2 and info["degrees"]["dp_shard"] == 2  # the flag overrides
    assert info["batch"]["batch_degree"] == 2 and info["rank"] == 1
    # fsdp=2 x tp=2: each rank holds a quarter (the norms' TP-replicated weights a bit more)
    assert 0.25 <= info["local_params"] / info["model"]["params"] < 0.26
    assert info["memory_gib"]["total"] == 16 * info["local_params"] / 2**30
    bad = run_module_on_own_process("trainer.plan_report", "--config", "llama3.toml", "--world-size", "4", "--tp", "3")
    assert bad.returncode == 2 and "a valid choice for world_size=4" in bad.stderr
    assert "Traceback" not in bad.stderr
