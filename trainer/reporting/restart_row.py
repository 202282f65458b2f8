"""The ``restart`` row of metrics.jsonl: a worker started again by torch's elastic agent
(``--max_restarts K``, trainer/lifecycle/restarts.py) writes it before its first step, so the
steps trained a second time are counted and the rows after it are known as the redone ones
(docs/long_runs.md, "Automatic restarts")."""

from __future__ import annotations

import contextlib
import json
import os

__all__ = ["last_logged_step", "restart_row"]


def last_logged_step(run_folder: str) -> int | None:
    """The step of the last training row of ``run_folder``'s metrics.jsonl (None: none); a
    last line cut short by a kill is not a row."""
    path = os.path.join(run_folder, "metrics.jsonl")
    last = None
    with contextlib.suppress(OSError), open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if "loss" in row:
                last = row["step"]
    return last


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
