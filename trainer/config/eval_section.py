"""The ``[eval]`` section: lm-eval tasks scored on the live model between training steps
(trainer/inference/eval_during_training.py, docs/evaluation.md), apart from
trainer/config/schema.py so the schema stays one page; it registers the section there. Its
checks (:func:`validate_eval`) run with the config's other checks (trainer/config/loader.py)."""

from __future__ import annotations

from dataclasses import dataclass

from trainer.config.errors import ConfigError
from trainer.config.fields import opt as _opt

__all__ = ["Eval", "validate_eval"]


@dataclass
class Eval:
    tasks: list[str] = _opt(
        [],
        "lm-eval task, group or tag names scored between steps on the live model (empty: off); found in "
        "eval.include_path first, then among lm-eval's built-in tasks (their data from the datasets cache).",
    )
    interval: int = _opt(
        500, "Score the tasks after every `interval` training steps, and after the last step of the run."
    )
    limit: float = _opt(
        0.0, "Documents per task: 0 = all, a number >= 1 = that many, below 1 = that fraction (lm-eval's --limit)."
    )
    num_fewshot: int = _opt(-1, "Few-shot examples per prompt; -1 = each task's own setting (lm-eval's default).")
    include_path: str = _opt("", "A folder of lm-eval task YAMLs (your own tasks, over local data_files).")
    batch_size: int = _opt(1, "Loglikelihood requests (or generation prompts) per forward.")
    max_gen_toks: int = _opt(256, "New tokens of a generation task that sets no generation_kwargs.max_gen_toks.")


def validate_eval(cfg) -> None:
    """The [eval] values a run could not use (the task names and eval.include_path are
    checked as training starts, where lm-eval's task index is read:
    trainer/inference/eval_during_training.py)."""
    ev = cfg.eval
    if not ev.tasks:
        return
    if cfg.comm.mode != "default":
        raise ConfigError(
            f"eval.tasks: a simulated run (comm.mode = '{cfg.comm.mode}', one process standing for the job's "
            "ranks) does not run lm-eval between steps; leave eval.tasks empty there, or score a real run's "
            "checkpoints with scripts/eval.py"
        )
    if ev.interval < 1:
        raise ConfigError(f"eval.interval must be >= 1 (steps between evaluations), got {ev.interval}")
    if ev.limit < 0:
        raise ConfigError(f"eval.limit must be >= 0 (0: every document), got {ev.limit}")
    if ev.num_fewshot < -1:
        raise ConfigError(f"eval.num_fewshot must be >= 0, or -1 for each task's own, got {ev.num_fewshot}")
    if ev.batch_size < 1 or ev.max_gen_toks < 1:
        raise ConfigError("eval.batch_size and eval.max_gen_toks must be >= 1")
