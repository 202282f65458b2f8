"""The end-of-run summary: what a launch did, printed by rank 0 as its last lines (at the end of
training, and at a stop by SIGINT or SIGTERM, before the ``stopped at step`` line), so the
numbers and the places a user looks for next do not scroll away behind the step lines:

```
run summary (outputs/run):
  time         3m12s (start-up 9s, training 3m03s)
  steps        21-40 of 40 (20 this launch, resumed from step 20)
  tokens       327,680 this launch (655,360 since step 0)
  loss         final 3.0169 at step 40; best 2.9876 at step 37 (this launch)
  validation   3.1002 at step 40
  checkpoints  outputs/run/checkpoint: written this launch step-30, step-40, step-40-hf
  metrics      outputs/run/metrics.jsonl (plot: python scripts/plot_run.py outputs/run)
```

:class:`RunTotals` collects the figures as the loop runs (every step's loss, not only the
logged ones); :func:`summary_lines` words them.
"""

from __future__ import annotations

import math
import os
import signal
import time

from trainer.reporting.metrics import MetricsLogger, format_duration

__all__ = ["RunTotals", "commit_run", "end_lines", "summary_lines"]


class RunTotals:
    """What one launch did. ``started``: ``time.perf_counter()`` when the process started its
    work (the trainer's construction); ``first_step``: the step it resumed after (0: a fresh run)."""

    def __init__(self, started: float):
        self.started = started
        self.training_started: float | None = None
        self.wall_started = time.time()  # for the checkpoint folder's entries written since
        self.tokens_per_step = 0
        self.first_step = 0
        self.last_step: int | None = None
        self.final: float | None = None
        self.best: tuple[float, int] | None = None
        self.validation: tuple[float, int] | None = None
        self.epoch: int | None = None  # complete passes over the data at the end
        self.epochs, self.epochs_reached = 0, False  # training.epochs, and whether the run stopped for it
        self.targets_begin: dict[str, int] = {}  # target tokens per source at the launch's start
        self.targets: dict[str, int] | None = None  # ... and at its end (masked data only)

    def begin(self, first_step: int, tokens_per_step: int, targets: dict[str, int] | None = None) -> None:
        """The loop starts after step ``first_step``; each step trains ``tokens_per_step`` tokens;
        ``targets``: the target tokens per source counted before (a resumed run's)."""
        self.first_step, self.tokens_per_step = first_step, tokens_per_step
        self.targets_begin = dict(targets or {})
        self.training_started = time.perf_counter()

    def step(self, step: int, loss: float) -> None:
        self.last_step, self.final = step, loss
        if math.isfinite(loss) and (self.best is None or loss < self.best[0]):
            self.best = (loss, step)

    def validated(self, step: int, loss: float) -> None:
        self.validation = (loss, step)

    def data_read(self, progress, epochs: int) -> None:
        """What the data loop read (trainer/reporting/data_progress.py ``DataProgress``) and
        ``training.epochs``: the summary's ``data`` and ``targets`` rows."""
        self.epoch, self.epochs = progress.epoch, epochs
        self.epochs_reached = progress.reached
        self.targets = dict(progress.data.targets) if progress.masked else None

    @property
    def steps(self) -> int:
        return 0 if self.last_step is None else self.last_step - self.first_step


def commit_run(cfg, rank: int, metrics: MetricsLogger) -> None:
    """After a launch's first step the run is committed to going on: only now are the resolved
    config (``<dump>/config.toml``, rank 0), the metrics files and a new W&B run's id written, so
    a run that fails at start-up (bad data in its first batch, W&B refusing, a signal before the
    first step) leaves the folder it resumed byte-identical."""
    if rank == 0:
        os.makedirs(cfg.job.dump_folder, exist_ok=True)
        with open(os.path.join(cfg.job.dump_folder, "config.toml"), "w") as f:
            f.write(cfg.to_toml())
    metrics.commit()


def _written_since(folder: str, since: float) -> list[str]:
    """The entries of ``folder`` (checkpoints, exports) modified at or after ``since``, oldest first."""
    try:
        names = [n for n in os.listdir(folder) if not n.endswith((".tmp", ".old"))]
    except OSError:
        return []
    stamped = []
    for n in names:
        try:
            mtime = os.path.getmtime(os.path.join(folder, n))
        except OSError:
            continue
        if mtime >= since - 1.0:  # file systems round mtimes
            stamped.append((mtime, n))
    return [n for _, n in sorted(stamped)]


def summary_lines(
    totals: RunTotals,
    *,
    run_folder: str,
    total_steps: int,
    checkpoint_folder: str | None,
    metrics_file: str | None,
    now: float | None = None,
) -> list[str]:
    """The summary block, one string per line (the first names the run folder)."""
    now = time.perf_counter() if now is None else now
    t = totals
    timing = format_duration(now - t.started)
    if t.training_started is not None:
        timing += (
            f" (start-up {format_duration(t.training_started - t.started)}, "
            f"training {format_duration(now - t.training_started)})"
        )
    rows = [("time", timing)]
    if t.last_step is None:
        rows.append(("steps", f"none this launch (at step {t.first_step} of {total_steps})"))
    else:
        where = f"{t.first_step + 1}-{t.last_step} of {total_steps} ({t.steps} this launch"
        where += f", resumed from step {t.first_step})" if t.first_step else ")"
        rows.append(("steps", where))
        tokens = f"{t.steps * t.tokens_per_step:,} this launch"
        if t.first_step:
            tokens += f" ({t.last_step * t.tokens_per_step:,} since step 0)"
        rows.append(("tokens", tokens + " (global window positions)"))
        loss = f"final {t.final:.4f} at step {t.last_step}"
        if t.best is not None:
            loss += f"; best {t.best[0]:.4f} at step {t.best[1]}" + (" (this launch)" if t.first_step else "")
        rows.append(("loss", loss))
    rows += _data_rows(t, total_steps)
    if t.validation is not None:
        rows.append(("validation", f"{t.validation[0]:.4f} at step {t.validation[1]}"))
    if checkpoint_folder is not None:
        written = _written_since(checkpoint_folder, t.wall_started)
        rows.append(
            (
                "checkpoints",
                f"{checkpoint_folder}: "
                + ("written this launch " + ", ".join(written) if written else "none written this launch"),
            )
        )
    if metrics_file is not None:
        rows.append(("metrics", f"{metrics_file} (plot: python scripts/plot_run.py {run_folder})"))
    return [f"run summary ({run_folder}):"] + [f"  {k:<12} {v}" for k, v in rows]


def _data_rows(t: RunTotals, total_steps: int) -> list[tuple[str, str]]:
    """The ``targets`` row (masked data: target tokens this launch and per source) and the
    ``data`` row (the epoch, and why the run ended where ``training.epochs`` is set)."""
    rows = []
    if t.targets is not None:
        launch = sum(t.targets.values()) - sum(t.targets_begin.values())
        text = f"{launch:,} target tokens this launch"
        if t.first_step:
            text += f" ({sum(t.targets.values()):,} since step 0)"
        if len(t.targets) > 1:
            text += "; since step 0 per source: " + ", ".join(f"{k} {v:,}" for k, v in t.targets.items())
        rows.append(("targets", text))
    if t.epoch is not None:
        text = f"epoch {t.epoch} (complete passes over the data)"
        if t.epochs_reached:
            text += f"; stopped: training.epochs = {t.epochs} reached at step {t.last_step}"
            if t.last_step is not None and t.last_step < total_steps:
                text += f", before training.steps = {total_steps}"
        elif t.epochs and t.last_step == total_steps:
            text += f"; stopped: training.steps = {total_steps} reached before training.epochs = {t.epochs}"
        rows.append(("data", text))
    return rows


def end_lines(totals: RunTotals, cfg, checkpoint_folder: str, metrics_file: str | None, stopped_by: int | None):
    """The last lines of a launch: the summary block, then, for a run stopped by a signal, the
    ``stopped at step`` line."""
    lines = summary_lines(
        totals,
        run_folder=cfg.job.dump_folder,
        total_steps=cfg.training.steps,
        checkpoint_folder=checkpoint_folder if os.path.isdir(checkpoint_folder) else None,
        metrics_file=metrics_file,
    )
    if stopped_by is not None:
        name, step = (
            signal.Signals(stopped_by).name,
            totals.last_step if totals.last_step is not None else totals.first_step,
        )
        if cfg.checkpoint.enable:
            saved = f"checkpoint step-{step} saved in {checkpoint_folder}; run the same command to resume"
        else:
            saved = "nothing saved (checkpoint.enable = false): the same command starts over"
        lines.append(f"stopped at step {step} by {name}; {saved}")
    return lines
