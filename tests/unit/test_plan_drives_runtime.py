"""The job plan is the runtime's only input about layout and batch.

After ``plan_job`` the trainer builds its pipeline stages, schedule, data loader and validation
schedule from the :class:`~trainer.plan.JobPlan` alone: a trainer whose ``cfg.parallelism``
raises on any access once the plan exists still builds, and builds what the plan says even when
the plan disagrees with the config it came with. A static check keeps the runtime modules from
reading ``.parallelism`` at all (only the planner and the config code may).
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]

# the modules that may read [parallelism]: the planner and the config code
ALLOWED = {"trainer/plan.py"}
ALLOWED_DIRS = ("trainer/config/",)
RUNTIME_DIRS = ("trainer", "models/parallel/pipeline")


class PoisonError(AssertionError):
    pass


class _Poison:
    """Stands for cfg.parallelism once the plan exists: any read is a bug."""

    def __getattr__(self, name: str):
        raise PoisonError(f"the runtime read cfg.parallelism.{name} after planning")


def _parallelism_reads(source: str, filename: str = "<src>") -> list[int]:
    """Line numbers of ``X.parallelism`` attribute reads and ``getattr(X, "parallelism")``."""
    lines = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Attribute) and node.attr == "parallelism":
            lines.append(node.lineno)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "getattr"
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value == "parallelism"
        ):
            lines.append(node.lineno)
    return lines


def _runtime_files() -> list[Path]:
    files = []
    for folder in RUNTIME_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel in ALLOWED or rel.startswith(ALLOWED_DIRS):
                continue
            files.append(path)
    return files


def test_runtime_modules_do_not_read_cfg_parallelism():
    files = _runtime_files()
    names = {p.relative_to(ROOT).as_posix() for p in files}
    # the check covers the runtime: the loop, validation, the forward, the builders, splitting
    assert {"trainer/trainer.py", "trainer/validation.py", "models/parallel/pipeline/split.py"} <= names
    offenders = {
        p.relative_to(ROOT).as_posix(): lines for p in files if (lines := _parallelism_reads(p.read_text(), str(p)))
    }
    assert not offenders, f"runtime modules read .parallelism (use the JobPlan): {offenders}"


def test_static_check_negative_control():
    """The check sees the reads it is there to forbid (and not the word in strings)."""
    assert _parallelism_reads("p = cfg.parallelism\nq = plan.config.parallelism.tp\n") == [1, 2]
    assert _parallelism_reads("x = getattr(plan.config, 'parallelism')\n") == [1]
    assert _parallelism_reads("msg = 'set parallelism.tp'\n") == []
    # and the planner, which must read it, is seen doing so
    assert _parallelism_reads((ROOT / "trainer/plan.py").read_text())


# ------------------------------------------------------------------ the built trainer

FAKE_WORLD = 4  # pp 2 x dp_shard 2, rank 1 of them played on the fake backend
ARGV = [
    "--config", "llama3.toml",
    "--model.n_layers", "4",
    "--training.seq_len", "32", "--training.global_batch_size", "8", "--training.local_batch_size", "2",
    "--training.steps", "2", "--training.prefetch", "false",
    "--metrics.enable_tensorboard", "false", "--checkpoint.enable", "false",
    "--parallelism.pp", "2", "--parallelism.dp_shard", "2",
    "--parallelism.pipeline_parallel_schedule", "1F1B",
    "--parallelism.pipeline_parallel_microbatches", "2",
    "--validation.enable", "--validation.steps", "1", "--validation.seq_len", "32",
    "--validation.global_batch_size", "4", "--validation.local_batch_size", "2",
    "--comm.mode", "fake_backend", "--comm.fake_world_size", str(FAKE_WORLD), "--comm.fake_rank", "1",
]  # fmt: skip
# the plan the trainer is handed instead: another schedule, stage split and batch
OTHER = [
    "--parallelism.pipeline_parallel_schedule", "GPipe",
    "--parallelism.pipeline_parallel_split_points", "layers.1",
    "--parallelism.pipeline_parallel_microbatches", "1",
    "--training.local_batch_size", "4", "--training.global_batch_size", "16",
]  # fmt: skip


@pytest.fixture(autouse=True)
def _no_process_group():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _build(tmp_path, monkeypatch, *, plan_argv=(), poison_before_plan=False):
    """A Trainer of ARGV whose plan_job returns the plan of ARGV + ``plan_argv`` and whose
    cfg.parallelism is poisoned right after planning (or, the negative control, before)."""
    import trainer.startup as startup_mod  # the Trainer plans through trainer.startup.plan_startup
    import trainer.trainer as train_mod
    from trainer.config import load_config
    from trainer.plan import plan_job as real_plan_job

    cfg = load_config([*ARGV, "--job.dump_folder", str(tmp_path)])
    planned = {}

    def plan_then_poison(c, world_size, vocab=None, **kwargs):
        plan = real_plan_job(
            load_config([*ARGV, *plan_argv, "--job.dump_folder", str(tmp_path)]), world_size, vocab, **kwargs
        )
        plan = dataclasses.replace(plan, config=c)
        c.parallelism = _Poison()
        planned["plan"] = plan
        return plan

    monkeypatch.setattr(startup_mod, "plan_job", plan_then_poison)
    if poison_before_plan:
        monkeypatch.setattr(startup_mod, "plan_job", real_plan_job)
        cfg.parallelism = _Poison()
    return train_mod.Trainer(cfg), planned.get("plan")


@pytest.mark.fake_backend
@pytest.mark.parametrize("plan_argv", [(), OTHER], ids=["own-plan", "other-plan"])
def test_the_plan_alone_determines_what_the_trainer_builds(tmp_path, monkeypatch, plan_argv):
    trainer, plan = _build(tmp_path, monkeypatch, plan_argv=plan_argv)
    assert isinstance(trainer.cfg.parallelism, _Poison)
    stages, batch = plan.stages, plan.batch
    pp_rank = trainer.pd.coordinate("pp")
    # the stages: this pp rank's, with exactly the plan's layers
    assert trainer.pipeline.schedule_name == stages.schedule
    assert [s.stage_index for s in trainer.pipeline.stages] == stages.stages_for_rank(pp_rank)
    for part, stage in zip(trainer.model_parts, stages.stages_for_rank(pp_rank)):
        start, end = stages.layer_ranges[stage]
        assert list(part.layers) == [str(i) for i in range(start, end)]
    # the schedule: the plan's micro-batches over the plan's local batch
    assert trainer.pipeline.n_microbatches == stages.n_microbatches
    assert trainer.pipeline.local_batch_size == batch.local_batch_size
    # the loader: the plan's batch
    assert trainer.data.global_batch_size == batch.global_batch_size
    assert trainer.data.grad_accum_steps == batch.grad_accum_steps
    assert trainer.data.tokens_per_step == batch.tokens_per_step
    # validation: the training schedule's class and micro-batches, its own batch
    assert trainer.validator.pipeline.schedule_name == stages.schedule
    assert trainer.validator.pipeline.n_microbatches == stages.n_microbatches
    if plan_argv:  # the handed plan, not the config, decided: the config says 1F1B, 2 micro-batches
        assert (stages.schedule, stages.n_microbatches, batch.global_batch_size) == ("GPipe", 1, 16)
        assert stages.layer_ranges == ((0, 1), (1, 4))


@pytest.mark.fake_backend
def test_negative_control_a_runtime_that_reads_the_config_is_caught(tmp_path, monkeypatch):
    """The old way (the schedule's micro-batch count from cfg.parallelism after planning) fails
    on the poisoned config; and poisoned before planning, the config cannot even be planned."""
    import trainer.trainer as train_mod

    real = train_mod.build_pipeline

    def reads_the_config(plan, *args, **kwargs):
        plan.config.parallelism.pipeline_microbatches()
        return real(plan, *args, **kwargs)

    monkeypatch.setattr(train_mod, "build_pipeline", reads_the_config)
    with pytest.raises(PoisonError, match=r"cfg\.parallelism\.pipeline_microbatches"):
        _build(tmp_path, monkeypatch)
    dist.destroy_process_group()
    monkeypatch.setattr(train_mod, "build_pipeline", real)
    with pytest.raises(PoisonError, match=r"cfg\.parallelism\."):
        _build(tmp_path / "before", monkeypatch, poison_before_plan=True)
