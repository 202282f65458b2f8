"""``checkpoint.async_mode = async`` on every layout of the README matrices, in-process.

For each layout (llama3: single, fsdp=4, dp_replicate=2 x fsdp=2, tp=2 x fsdp=2, cp=2 x fsdp=2,
cp=2 x tp=2, dp_replicate=4, pp=2 x fsdp=2; deepseek_v3: fsdp=4, fsdp=4 x ep=2,
fsdp=2 x cp=2 x ep=4, fsdp=2 x tp=2 x ep=2 x etp=2, dp_replicate=2 x fsdp=2 x ep=2,
pp=2 x fsdp=2 x ep=2), on gloo ranks:

1. build the layout's model (the harness's small, seeded model) and the trainer's optimizer
   (one AdamW per part, FQN-keyed state; its fused implementation, the GPU default: the same
   state as the CPU default foreach, at a fifth less of this test's CPU time, the optimizer ops'
   sharding propagation on every new mesh), take one training step as the trainer does (the
   pipeline schedule under pp; MoE expert-bias update, so the persistent ``expert_bias``
   buffers change too), snapshot this rank's model and
   optimizer state (local shards), start an async save (:class:`BackgroundSaver`, one per
   launch) into ``CheckpointFolder.begin``;
2. at once take another training step: parameters, Adam moments, the step counts and the
   expert biases change in place while the background write runs (the torn-checkpoint check);
3. ``poll(block=True)``, ``publish``;
4. load the checkpoint into a fresh model + optimizer of the same layout and compare every
   model and optimizer state entry with the snapshot, bit for bit (bitwise is right: a file
   round trip of the same tensors on the same layout). Negative controls: every entry's live
   value after step 2 differs from the snapshot (so a save that wrote the live tensors would
   fail), and every model entry of the fresh model differs from it before the load (so a load
   that restored nothing would fail). And the check is shown to fail on a torn save: the same
   save under fsdp=4 without the staging copy (DCP handed the live tensors, the file writes held
   back until the second step is done) loads the second step's values, every tensor different.

pp layouts run the trainer's pipeline schedule (trainer/build.py ``build_pipeline``) for both
steps; no step is replaced by an in-place edit. All layouts of 4 ranks run in one launch with
one ``BackgroundSaver``; ``single`` runs on one rank.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from unittest import mock

import pytest
import torch

from tools.forkserver import run_distributed

GLOBAL_BS, SEQ = 4, 16
LLAMA3 = [
    {},
    dict(dp_shard=4),
    dict(dp_replicate=2, dp_shard=2),
    dict(tp=2, dp_shard=2),
    dict(cp=2, dp_shard=2),
    dict(cp=2, tp=2),
    dict(dp_replicate=4),
    dict(pp=2, dp_shard=2),
]
DEEPSEEK = [
    dict(dp_shard=4),
    dict(dp_shard=4, ep=2),
    dict(dp_shard=2, cp=2, ep=4),
    dict(dp_shard=2, tp=2, ep=2, etp=2),
    dict(dp_replicate=2, dp_shard=2, ep=2),
    dict(pp=2, dp_shard=2, ep=2),
]
CASES = [("llama3", d) for d in LLAMA3] + [("deepseek_v3", d) for d in DEEPSEEK]
# negative control: the same save without the staging copy, its write held back until the
# second step is done, must be caught (loaded == the live values after the second step)
TORN = ("llama3", dict(dp_shard=4), True)


def _name(case) -> str:
    model, degrees, *torn = case
    return f"{model}-" + ("x".join(f"{k}{v}" for k, v in degrees.items()) or "single") + ("-torn" if torn else "")


def _local(t) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


def _snapshot(parts, optimizer) -> dict[str, torch.Tensor]:
    """This rank's local shard of every tensor the checkpoint holds for it."""
    from trainer.checkpoint.state import model_state_dict

    out = {f"model.{k}": _local(v) for k, v in model_state_dict(parts).items()}
    out.update({f"optimizer.{k}": _local(v) for k, v in optimizer.state_dict().items() if isinstance(v, torch.Tensor)})
    return out


class _Layout:
    """One layout's model parts, optimizer and training step, built as the trainer builds them."""

    def __init__(self, plan):
        from tests.distributed.parallel_harness import build_layout_model, build_layout_stages
        from trainer.build import build_pipeline
        from trainer.forward import ModelForward, cross_entropy_sum
        from trainer.optim.optimizers import build_optimizer

        torch.manual_seed(0)
        self.plan, pd = plan, plan.parallel_dims
        self.parts = list(build_layout_stages(plan).modules) if pd.pp > 1 else [build_layout_model(plan)]
        loss_parallel = pd.tp > 1 and plan.parallelize.loss_parallel
        pipeline = build_pipeline(plan, self.parts, cross_entropy_sum, loss_parallel=loss_parallel)
        self.forward = ModelForward(
            pd, self.parts, cross_entropy_sum, torch.device("cpu"), loss_parallel=loss_parallel, pipeline=pipeline
        )
        self.optimizer = build_optimizer(self.parts, plan.config)

    def train_step(self, inputs: torch.Tensor, labels: torch.Tensor) -> None:
        """The trainer's step (trainer/trainer.py Trainer.train_step), one micro-batch, no lr
        schedule: forward + backward, grad finalize and clip, AdamW, expert-bias update."""
        from trainer.optim.grad_clip import clip_grad_norm_, finalize_grads
        from trainer.step import update_expert_bias

        pd = self.plan.parallel_dims
        moes = [moe for part in self.parts for moe in part.moe_layers()]
        b, n = pd.coordinate("batch"), GLOBAL_BS // pd.size("batch")
        rows = slice(b * n, (b + 1) * n)
        self.forward(
            inputs[rows], labels[rows], GLOBAL_BS * SEQ, backward=True, aux_loss_sequences=GLOBAL_BS, moes=moes
        )
        params = [p for part in self.parts for p in part.parameters()]
        finalize_grads(params)
        clip_grad_norm_(params, self.plan.config.training.max_norm, pd.get_optional_mesh("pp"))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if moes:
            update_expert_bias(moes, pd)


def _mismatches(want: dict, got: dict, *, equal: bool) -> list[str]:
    """Keys whose tensors are not bitwise equal (``equal``) / are bitwise equal (not ``equal``)."""
    if sorted(want) != sorted(got):
        return [f"keys differ: {sorted(set(want) ^ set(got))[:5]}"]
    return [k for k in want if (want[k].dtype == got[k].dtype and torch.equal(want[k], got[k])) != equal]


class _NoCopyStager:
    """The negative control's stager: hands DCP the live tensors (no copy), as a save that
    forgot to stage would."""

    should_synchronize_after_execute = False

    def stage(self, state_dict):
        return state_dict

    def synchronize_staging(self):
        pass

    def close(self):
        pass


@contextlib.contextmanager
def _torn_save(saver):
    """A save that does not copy, whose file writes wait until ``gate`` is set (so the write
    surely sees the second step's values)."""
    from trainer.checkpoint.async_save import DrillWriter

    gate = threading.Event()
    write_data = DrillWriter.write_data

    def late_write(self, plan, planner):
        gate.wait(60)
        return write_data(self, plan, planner)

    # the saver builds its stager through _new_stager (every save on torch 2.11, whose stager
    # cannot be reused): hand it the no-copy one
    kept, saver._stager = saver._stager, None
    try:
        with (
            mock.patch.object(DrillWriter, "write_data", late_write),
            mock.patch("trainer.checkpoint.async_save._new_stager", lambda _mode: _NoCopyStager()),
        ):
            yield gate
    finally:
        gate.set()
        saver._stager = kept


def _one_layout(model_name: str, degrees: dict, saver, root: str, torn: bool = False) -> dict:
    from tests.distributed.parallel_harness import VOCAB, harness_plan, make_batch
    from trainer.checkpoint.dcp import CheckpointFolder

    t0 = time.monotonic()
    # two layers (DeepSeek: the dense one and a MoE one, whose experts and expert-bias buffers
    # are sharded apart from the dense weights): every kind of state entry of the model
    config = ("--optimizer.implementation", "fused")
    plan = harness_plan(model_name, degrees, GLOBAL_BS, SEQ, n_layers=2, config=config)
    plan.parallel_dims.build_mesh("cpu")
    layout = _Layout(plan)
    inputs, labels = make_batch(GLOBAL_BS, SEQ, VOCAB)
    layout.train_step(inputs, labels)

    folder = CheckpointFolder(root)
    saved = _snapshot(layout.parts, layout.optimizer)
    state = folder.state(1, layout.parts, layout.optimizer, extra={"layout": _name((model_name, degrees))})
    with _torn_save(saver) if torn else contextlib.nullcontext() as gate:
        saver.start(1, state, folder.begin(1))
        # the weights, moments and step counts change while the save is being written
        layout.train_step(inputs, labels)
        live = _snapshot(layout.parts, layout.optimizer)
        if gate is not None:
            gate.set()
        done = saver.poll(block=True)
    assert done is not None and done.step == 1
    folder.publish(1)

    fresh = _Layout(plan)
    before = {k: v for k, v in _snapshot(fresh.parts, fresh.optimizer).items() if k.startswith("model.")}
    extra = folder.load(fresh.parts, fresh.optimizer, step=1)
    loaded = _snapshot(fresh.parts, fresh.optimizer)
    return {
        "wall_s": time.monotonic() - t0,
        "keys": len(saved),
        "optimizer_keys": sum(k.startswith("optimizer.") for k in saved),
        "extra": extra,
        "loaded_differs": _mismatches(saved, loaded, equal=True),
        "live_equal": _mismatches(saved, live, equal=False),
        "loaded_differs_from_live": _mismatches(live, loaded, equal=True),
        # the fresh optimizer's state before the load is not comparable: the model entries
        "fresh_equal": _mismatches({k: v for k, v in saved.items() if k in before}, before, equal=False),
    }


def _worker(rank, world_size, cases, root):
    from trainer.checkpoint.async_save import BackgroundSaver

    saver = BackgroundSaver("async", timeout_s=120)  # collective: two process groups, once
    out = []
    try:
        for i, (model_name, degrees, *torn) in enumerate(cases):
            try:
                out.append(_one_layout(model_name, degrees, saver, os.path.join(root, str(i)), *torn))
            except Exception as exc:
                raise RuntimeError(f"layout failed: {model_name} {degrees}") from exc
    finally:
        saver.close()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    root = str(tmp_path_factory.mktemp("async_layouts"))
    out = {}
    for world in (1, 4):
        cases = [c for c in [*CASES, TORN] if _world(c[1]) == world]
        per_rank = run_distributed(_worker, world, cases, os.path.join(root, f"w{world}"), timeout=600)
        for i, case in enumerate(cases):
            out[_name(case)] = [r[i] for r in per_rank]
            print(
                f"{_name(case):<45} {out[_name(case)][0]['keys']:>4} tensors on rank 0  {per_rank[0][i]['wall_s']:.2f}s"
            )
    return out


def _world(degrees: dict) -> int:
    from tests.distributed.parallel_harness import world_size_of

    return world_size_of(degrees)


@pytest.mark.parametrize("case", CASES, ids=[_name(c) for c in CASES])
def test_async_save_under_layout_is_not_torn(results, case):
    name = _name(case)
    for rank, r in enumerate(results[name]):
        assert r["keys"] > 0 and r["optimizer_keys"] > 0, (rank, r)
        assert r["extra"]["step"] == 1 and r["extra"]["layout"] == name, (rank, r["extra"])
        assert r["loaded_differs"] == [], f"rank {rank}: loaded != state at save start: {r['loaded_differs'][:5]}"
        # negative controls: the save raced with real changes, and the load had something to do
        assert r["live_equal"] == [], f"rank {rank}: unchanged by the second step: {r['live_equal'][:5]}"
        assert r["fresh_equal"] == [], f"rank {rank}: fresh model already equal: {r['fresh_equal'][:5]}"


def test_a_save_without_its_staging_copy_is_caught(results):
    """The check above fails on a torn save: without the copy, the file holds the second
    step's values."""
    for rank, r in enumerate(results[_name(TORN)]):
        assert r["live_equal"] == [] and r["loaded_differs_from_live"] == [], rank
        assert len(r["loaded_differs"]) == r["keys"], (rank, r["loaded_differs"][:5])
