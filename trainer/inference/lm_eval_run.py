"""lm-eval's tasks run on an :class:`~trainer.inference.lm_eval_model.MeshLM`: which tasks, their
checks, the run, the scores. Shared by ``scripts/eval.py`` and the evaluation during training
(trainer/inference/eval_during_training.py).

* :func:`task_manager`: lm-eval's own ``TaskManager`` over ``include_path`` (the user's task
  YAMLs) and, only when a task is not found there, lm-eval's built-in tasks too (indexing the
  built-in tasks reads about 14 000 YAML files: seconds a run that names only its own tasks
  need not pay). Bad input, one line each (``ValueError``): an ``include_path`` that does not
  exist, a task YAML under it that does not parse (lm-eval would skip it and then call the
  task unknown), a task name lm-eval does not know.
* :func:`evaluate`: ``lm_eval.simple_evaluate`` with that manager (lm-eval's own seeds,
  few-shot sampling, filters and metrics): the results dict lm-eval's CLI writes, on rank 0
  (None on the other ranks).
* :func:`scores`: the flat ``{"<task>/<metric>": value}`` of a results dict (lm-eval's metric
  keys are ``<metric>,<filter>``: ``acc,none`` becomes ``<task>/acc``, another filter keeps
  its name: ``<task>/exact_match,strict-match``).
"""

from __future__ import annotations

import math
import os
from typing import Any

__all__ = ["check_task_files", "evaluate", "scores", "task_manager"]


def _yaml_loader():
    import yaml

    class _AnyTag(yaml.SafeLoader):
        """lm-eval's tags (``!function utils.process_docs``) parse as their text."""

    _AnyTag.add_multi_constructor("", lambda loader, suffix, node: None)
    return _AnyTag


def check_task_files(include_path: str, option: str = "--include_path") -> None:
    """Every ``*.yaml`` / ``*.yml`` under ``include_path`` (a folder or one file) parses;
    ``option`` names it in the messages."""
    import yaml

    if not os.path.exists(include_path):
        raise ValueError(
            f"{option} {include_path} does not exist: point it at a folder of lm-eval task YAMLs (or one YAML file)"
        )
    files = [include_path] if os.path.isfile(include_path) else []
    for root, _dirs, names in os.walk(include_path):
        files += [os.path.join(root, n) for n in sorted(names) if n.endswith((".yaml", ".yml"))]
    loader = _yaml_loader()
    for path in files:
        try:
            with open(path, encoding="utf-8") as f:
                yaml.load(f, Loader=loader)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise ValueError(f"task file {path} does not parse as YAML{where}: {problem}; fix or remove it") from None


def task_manager(tasks: list[str], include_path: str = "", option: str = "--include_path"):
    """lm-eval's ``TaskManager`` that knows every name of ``tasks`` (see the module docstring);
    ``option``: how the messages name ``include_path`` (``eval.include_path`` for [eval])."""
    from lm_eval.tasks import TaskManager

    if not tasks:
        raise ValueError("no task: give --tasks NAME[,NAME] (lm-eval task, group or tag names)")
    if include_path:
        check_task_files(include_path, option)
        manager = TaskManager(include_path=include_path, include_defaults=False)
        if all(t in manager.all_tasks for t in tasks):
            return manager
    manager = TaskManager(include_path=include_path or None, include_defaults=True)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        where = f"in {option} {include_path} nor " if include_path else "among "
        raise ValueError(
            f"unknown task {unknown[0]!r}: lm-eval finds no task, group or tag of that name {where}its built-in "
            f"tasks; check the spelling (`lm-eval ls tasks` lists them) or pass {option} with the folder of its YAML"
        )
    return manager


def evaluate(
    lm: Any,
    manager: Any,
    tasks: list[str],
    *,
    num_fewshot: int | None = None,
    limit: float | None = None,
    log_samples: bool = False,
    bootstrap_iters: int = 100000,
) -> dict | None:
    """lm-eval's ``simple_evaluate`` of ``tasks`` on ``lm``: its results dict on rank 0, None on
    the other ranks (lm-eval returns results where ``LOCAL_RANK`` is 0; every rank runs every
    request, trainer/inference/lm_eval_model.py)."""
    from lm_eval import simple_evaluate

    results = simple_evaluate(
        model=lm,
        tasks=list(tasks),
        num_fewshot=num_fewshot,
        limit=limit,
        task_manager=manager,
        log_samples=log_samples,
        bootstrap_iters=bootstrap_iters,
        batch_size=getattr(lm, "batch_size", None),
    )
    rank = int(os.environ.get("RANK", "0"))
    return results if rank == 0 else None


def scores(results: dict) -> dict[str, float]:
    """``{"<task>/<metric>": value}`` of lm-eval's ``results["results"]`` (standard errors and
    non-numbers left out; a metric under the ``none`` filter keeps its bare name)."""
    out: dict[str, float] = {}
    for task, metrics in sorted(results.get("results", {}).items()):
        for key, value in metrics.items():
            metric, comma, filt = key.partition(",")  # lm-eval's metrics are "<metric>,<filter>"
            if not comma or "_stderr" in metric or isinstance(value, bool) or not isinstance(value, int | float):
                continue
            name = metric if filt in ("", "none") else key
            out[f"{task}/{name}"] = float(value) if math.isfinite(value) else float("nan")
    return out
