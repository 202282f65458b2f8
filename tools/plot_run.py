"""``scripts/plot_run.py DUMP_FOLDER [OTHER ...] [--out PNG]``: one PNG of a run's curves from its
``metrics.jsonl``: the training loss (with the validation loss where the run evaluated), the
learning rate and the throughput (``tps``, tokens/s per device) against the step, several runs
overlaid, one colour per run (labelled by folder). A resumed run's file holds the steps its
launches logged; a step logged twice (a kill after it and before the next checkpoint) is drawn
with its last record, as the trainer's readers take it.

Bad input (a folder without metrics.jsonl, a file with no step record, matplotlib missing) is one
``error:`` line and exit code 2 (trainer/runtime/cli_errors.py). matplotlib is a dev dependency
(``pip install matplotlib``), imported only here.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from trainer.runtime.cli_errors import run_command

__all__ = ["BadInput", "main", "plot_runs", "read_run"]


class BadInput(ValueError):
    pass


def read_run(folder: str) -> tuple[dict[int, dict[str, Any]], dict[int, float]]:
    """(step -> the last training record of that step, step -> the last validation loss) of the
    run in ``folder``."""
    path = os.path.join(folder, "metrics.jsonl")
    if not os.path.isdir(folder):
        raise BadInput(f"{folder}: no such run folder (give a job.dump_folder holding metrics.jsonl)")
    if not os.path.isfile(path):
        raise BadInput(f"{folder} has no metrics.jsonl: not a run folder, or metrics.enable_jsonl was false")
    steps: dict[int, dict[str, Any]] = {}
    validation: dict[int, float] = {}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise BadInput(f"{path} (line {n}): not JSON ({exc.msg})") from None
            if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
                raise BadInput(f"{path} (line {n}): a record without an integer 'step'")
            if rec.get("loss") is not None:
                steps[rec["step"]] = rec
            if rec.get("validation_loss") is not None:
                validation[rec["step"]] = float(rec["validation_loss"])
    if not steps:
        raise BadInput(f"{path} holds no training step yet")
    return steps, validation


def plot_runs(folders: list[str], out: str) -> str:
    """Write the PNG of ``folders``' curves to ``out``; returns ``out``."""
    runs = [(f, *read_run(f)) for f in folders]
    try:
        import matplotlib
    except ImportError:
        raise BadInput("plotting needs matplotlib: pip install matplotlib (or the 'dev' extra)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    loss_ax, lr_ax, tps_ax = axes
    for i, (folder, steps, validation) in enumerate(runs):
        color = f"C{i % 10}"
        label = os.path.basename(os.path.normpath(folder)) or folder
        xs = sorted(steps)
        loss_ax.plot(xs, [steps[s]["loss"] for s in xs], color=color, label=f"{label} loss")
        if validation:
            vs = sorted(validation)
            loss_ax.plot(vs, [validation[s] for s in vs], color=color, ls="--", marker="o", ms=3,
                         label=f"{label} validation")  # fmt: skip
        lr_ax.plot(xs, [steps[s].get("lr") for s in xs], color=color, label=label)
        tps = [s for s in xs if steps[s].get("tps") is not None]
        tps_ax.plot(tps, [steps[s]["tps"] for s in tps], color=color, label=label)
    loss_ax.set_ylabel("loss")
    loss_ax.legend(fontsize="small")
    lr_ax.set_ylabel("learning rate")
    tps_ax.set_ylabel("tokens/s per device")
    tps_ax.set_xlabel("step")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(", ".join(os.path.normpath(f) for f in folders), fontsize="small")
    fig.tight_layout()
    folder = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(folder):
        raise BadInput(f"--out {out}: the folder {folder} does not exist")
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="scripts/plot_run.py",
        description="Plot the loss, validation loss, learning rate and throughput per step of one or more "
        "runs (their job.dump_folder's metrics.jsonl), overlaid, into one PNG.",
    )
    p.add_argument("folders", nargs="+", metavar="DUMP_FOLDER", help="run folders (job.dump_folder)")
    p.add_argument("--out", default=None, help="the PNG to write (default: DUMP_FOLDER/curves.png of the first)")
    return p


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)

    def run() -> int:
        out = ns.out or os.path.join(ns.folders[0], "curves.png")
        print(f"wrote {plot_runs(ns.folders, out)}")
        return 0

    return run_command(run, kinds=(ValueError, OSError))
