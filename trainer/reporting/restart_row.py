"""The ``restart`` row of metrics.jsonl: a worker started again by torch's elastic agent
(``--max_restarts K``, trainer/lifecycle/restarts.py) writes it before its first step, so the
steps trained a second time are counted and the rows after it are known as the redone ones
(docs/long_runs.md, "Automatic restarts")."""

from __future__ import annotations

import contextlib
import json
import os

__all__ = ["attempt_progress", "last_logged_step", "metrics_size", "restart_row"]


def metrics_size(run_folder: str) -> int:
    """The size in bytes of ``run_folder``'s metrics.jsonl (0: none yet)."""
    try:
        return os.path.getsize(os.path.join(run_folder, "metrics.jsonl"))
    except OSError:
        return 0


def _rows(run_folder: str, offset: int = 0):
    """The rows of ``run_folder``'s metrics.jsonl from byte ``offset``; a last line cut short by
    a kill is not a row."""
    path = os.path.join(run_folder, "metrics.jsonl")
    with contextlib.suppress(OSError), open(path, "rb") as f:
        f.seek(offset)
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict):
                yield row


def last_logged_step(run_folder: str) -> int | None:
    """The step of the last training row of ``run_folder``'s metrics.jsonl (None: none)."""
    last = None
    for row in _rows(run_folder):
        if "loss" in row:
            last = row["step"]
    return last


def attempt_progress(run_folder: str, attempt: int, offset: int = 0) -> tuple[bool, int | None]:
    """How far the workers' start ``attempt`` (TORCHELASTIC_RESTART_COUNT: 0 the first) of the
    launch whose rows begin at byte ``offset`` of metrics.jsonl (:func:`metrics_size` as it
    began) got: ``(started, last_step)``. A restarted start has ``started`` once it wrote its
    ``restart`` row (after it resumed, before its first step); ``last_step`` is the step of its
    last training row, else the step it resumed from. The first start counts as started, its
    rows being those before the first ``restart`` row; ``last_step`` None: it wrote none."""
    started, last = attempt == 0, None
    for row in _rows(run_folder, offset):
        if "restart" in row:
            if row["restart"] == attempt:
                started, last = True, row.get("resumed_from", row["step"])
            elif started:
                break  # a later start's rows
        elif started and "loss" in row:
            last = row["step"]
    return started, last


def restart_row(cfg, resumed: int | None) -> dict | None:
    """In a restarted worker (TORCHELASTIC_RESTART_COUNT > 0), before the first step: the
    metrics.jsonl row that marks the restart, ``{"restart": n, "resumed_from": step,
    "redone_steps": k}``, k the steps done before the failure past the checkpoint resumed from
    (they are trained again, and logged again: the rows after this one hold them a second time,
    and the curve is the last row of each step). None in a first start."""
    count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if count <= 0:
        return None
    start = resumed or 0
    last = last_logged_step(cfg.job.dump_folder) or 0
    return {"restart": count, "resumed_from": start, "redone_steps": max(last - start, 0)}
