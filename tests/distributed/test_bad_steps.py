"""``training.on_nonfinite = skip`` on real layouts (trainer/bad_steps.py): a step made non-finite
by ``debug.fault nan_loss@2`` is not applied on any rank: every rank's weights and optimizer
state (moments and step counts, its own shards) are bitwise what they were before the step,
with the fused AdamW kernel (skipped on the device, ``found_inf``), with foreach (the
optimizer step not called) and with bf16 moments (``optimizer.state_dtype``, on fsdp=2 x tp=2:
the step not called either); the next step trains (finite, the weights move), and replicas stay
equal. Layouts on 4 ranks, one launch: dp_replicate=2 x fsdp=2, fsdp=2 x tp=2, pp=2 x fsdp=2.

Negative control: the replica check is real: where rank 0 alone applies the bad step (its
policy patched), its weights differ from its replica's (rank 2 holds the same shard), and the
check says so.

Trainers built in the forked ranks as train.py builds them; steps driven by ``train_step``."""

from __future__ import annotations

import hashlib

import pytest
import torch

from tools.forkserver import run_distributed

pytestmark = pytest.mark.distributed

ARGS = [
    "--model.n_layers", "2", "--training.seq_len", "16", "--training.local_batch_size", "1",
    "--training.global_batch_size", "4", "--checkpoint.enable", "false", "--metrics.enable_tensorboard", "false",
    "--training.on_nonfinite", "skip", "--debug.fault", "nan_loss@2",
]  # fmt: skip
LAYOUTS = {
    "dp_replicate2_fsdp2": ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.fsdp", "2"],
    "fsdp2_tp2": ["--parallelism.fsdp", "2", "--parallelism.tp", "2"],
    "pp2_fsdp2": ["--parallelism.pp", "2", "--parallelism.fsdp", "2", "--parallelism.pipeline_parallel_schedule",
                  "1F1B", "--training.local_batch_size", "2"],
}  # fmt: skip


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _digests(trainer) -> tuple[str, str]:
    """This rank's weights, and its optimizer state (every tensor, the step counts too)."""
    w, s = hashlib.sha256(), hashlib.sha256()
    for part in trainer.model_parts:
        for name, p in part.named_parameters():
            w.update(name.encode() + _local(p.detach()).float().numpy().tobytes())
    for opt in trainer.optimizer.optimizers:
        for state in opt.state.values():
            for k in sorted(state):
                s.update(k.encode() + _local(state[k]).detach().float().reshape(-1).numpy().tobytes())
    return w.hexdigest(), s.hexdigest()


def _run(layout: str, implementation: str, folder: str, rank: int, rank0_applies: bool = False) -> dict:
    import torch.distributed as dist

    from trainer.config import load_config
    from trainer.trainer import Trainer

    args = ["--config", "llama3.toml", "--job.dump_folder", f"{folder}/{layout}_{implementation}", *ARGS]
    opt_args = ["--optimizer.implementation", implementation]
    if implementation == "bf16":  # bf16 moments (trainer/optim/low_precision.py): the step not called
        opt_args = ["--optimizer.state_dtype", "bfloat16"]
    trainer = Trainer(load_config([*args, *LAYOUTS[layout], *opt_args]))
    if rank0_applies and rank == 0:  # the negative control: a policy that skips on every rank but this one
        trainer.bad_steps.judge = lambda *a: False
        trainer.bad_steps.no_step = lambda scalars, targets: None
    out = {"bad": []}
    for step in (1, 2, 3):
        before = _digests(trainer)
        result = trainer.train_step(trainer.data.next_step())
        trainer.step += 1
        after = _digests(trainer)
        out["bad"].append(result.bad)
        out[step] = {"weights_same": after[0] == before[0], "state_same": after[1] == before[1], "loss": result.loss}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, _digests(trainer)[0])
    out["weights_by_rank"] = every
    return out


def _all(rank: int, world_size: int, folder: str) -> dict:
    out = {}
    for layout in LAYOUTS:
        for implementation in ("fused", "foreach"):
            out[(layout, implementation)] = _run(layout, implementation, folder, rank)
    out[("fsdp2_tp2", "bf16")] = _run("fsdp2_tp2", "bf16", folder, rank)
    out["control"] = _run("dp_replicate2_fsdp2", "foreach", folder, rank, rank0_applies=True)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_distributed(_all, 4, str(tmp_path_factory.mktemp("bad_steps")))


@pytest.mark.parametrize(
    "layout, implementation",
    [(layout, impl) for layout in LAYOUTS for impl in ("fused", "foreach")] + [("fsdp2_tp2", "bf16")],
)
def test_a_skipped_step_leaves_every_rank_as_it_was_and_the_run_goes_on(results, layout, implementation):
    for rank, r in enumerate(results):
        got = r[(layout, implementation)]
        assert got["bad"] == [False, True, False], (rank, got)
        assert got[2]["weights_same"] and got[2]["state_same"], (rank, got[2])  # the skipped step
        for step in (1, 3):  # the steps around it trained
            assert not got[step]["weights_same"] and not got[step]["state_same"], (rank, step, got[step])
            assert torch.isfinite(torch.tensor(got[step]["loss"])), (rank, got[step])
    if layout == "dp_replicate2_fsdp2":  # rank r and r + 2 hold the same shard
        weights = results[0][(layout, implementation)]["weights_by_rank"]
        assert weights[0] == weights[2] and weights[1] == weights[3], weights


def test_negative_control_a_step_applied_on_one_rank_only_diverges_its_replica(results):
    weights = results[0]["control"]["weights_by_rank"]
    assert weights[0] != weights[2], "the replica check did not see rank 0's applied NaN step"
    assert weights[1] == weights[3], weights  # the ranks that skipped stay equal
    assert results[0]["control"][2]["weights_same"] is False and results[2]["control"][2]["weights_same"], results
