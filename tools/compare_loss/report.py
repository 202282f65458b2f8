"""What a comparison leaves behind: the table printed, summary.json and the plot."""

from __future__ import annotations

import json
import math
import os

from tools.compare_loss.compare import num, passed

# |difference| plotted on a log axis: exact zeros (bitwise-equal steps) are drawn at this floor.
DIFF_FLOOR = 1e-9


def fmt(x: float | None, spec: str = ".2e") -> str:
    """A table cell: '-' for a missing number, 'inf'/'nan' as such."""
    if x is None:
        return "-"
    return format(x, spec) if math.isfinite(x) else str(x)


def format_table(rows: list[dict]) -> str:
    headers = [
        "layout",
        "nproc",
        "max|dloss|",
        "max rel",
        "first >tol",
        "final loss",
        "gnorm rel",
        "tok/s/dev",
        "wall s",
        "status",
    ]
    with_validation = any("validation_steps" in r for r in rows)
    if with_validation:  # validation loss vs the baseline's: max relative difference, first step off
        headers[-3:-3] = ["val rel", "val >tol"]
    table = [headers]
    for r in rows:
        first = r.get("first_step_beyond")
        vfirst = r.get("validation_first_step_beyond")
        validation = [fmt(r.get("validation_max_rel_diff")), "-" if vfirst is None else str(vfirst)]
        table.append(
            [
                r["layout"],
                str(r["nproc"]),
                fmt(r.get("max_abs_diff")),
                fmt(r.get("max_rel_diff")),
                "-"
                if first is None
                else f"{first}" + (" (gnorm)" if r.get("first_beyond_metric") == "grad_norm" else ""),
                fmt(r["final_loss"], ".6f"),
                fmt(r.get("grad_norm_max_rel_diff")),
                *(validation if with_validation else []),
                fmt(r["mean_tps"], ",.0f"),
                f"{r['wall_s']:.1f}",
                r["status"],
            ]
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(headers))]
    lines = [
        "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
        for row in table
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_summary(
    out: str,
    *,
    config: str,
    steps: int,
    baseline: str,
    rtol: float,
    atol: float,
    grad_norm_rtol: float,
    assert_equal: bool,
    extra_overrides: list[str],
    seed_checkpoint: str,
    rows: list[dict],
) -> str:
    """``<out>/summary.json``: the settings of the comparison, one row per run and the verdict."""
    summary = {
        "config": config,
        "steps": steps,
        "baseline": baseline,
        "rtol": rtol,
        "atol": atol,
        "grad_norm_rtol": grad_norm_rtol,
        "assert_equal": assert_equal,
        "extra_overrides": extra_overrides,
        "seed_checkpoint": seed_checkpoint,
        "runs": rows,
        "passed": passed(rows),
    }
    path = os.path.join(out, "summary.json")
    with open(path, "w") as f:
        json.dump(summary, f, indent=1, default=str)
    return path


def plot_runs(
    path: str, runs: list[tuple[str, dict[int, dict]]], baseline: str, rtol: float, atol: float, exact: bool = False
) -> str:
    """Loss curves on top; |loss - baseline| per step below on a log axis, with the tolerance.

    Correct layouts lie on top of each other in the upper panel (hence a dash pattern and marker
    each); the lower panel is where they differ. Its differences hop between exact zero and an
    ulp or two, so they are drawn as markers, not lines, each layout nudged sideways so that
    equal values stay visible; colours match the upper panel's legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    base = dict(runs)[baseline]
    fig, (top, bottom) = plt.subplots(
        2, 1, sharex=True, figsize=(8, 6.5), dpi=90, gridspec_kw={"height_ratios": [3, 2]}
    )
    styles = ["-", "--", "-.", ":"]
    markers = ["o", "s", "^", "v", "D", "x", "+", "*"]
    others = max(1, len(runs) - 1)
    nudge = min(0.5 / others, 0.1)
    j = 0
    for i, (name, records) in enumerate(runs):
        steps = sorted(records)
        is_base = name == baseline
        color = f"C{i % 10}"
        top.plot(
            steps,
            [num(records[s]["loss"]) for s in steps],
            color=color,
            linestyle=styles[i % len(styles)],
            marker=markers[i % len(markers)],
            markevery=max(1, len(steps) // 8),
            markersize=4,
            linewidth=2.5 if is_base else 1.2,
            label=name + (" (baseline)" if is_base else ""),
        )
        if is_base:
            continue
        common = [s for s in steps if s in base]
        diffs = [abs(num(records[s]["loss"]) - num(base[s]["loss"])) for s in common]
        diffs = [d if math.isfinite(d) else float("nan") for d in diffs]
        offset = (j - (others - 1) / 2) * nudge
        bottom.plot(
            [s + offset for s in common],
            [max(d, DIFF_FLOOR) for d in diffs],
            color=color,
            linestyle="none",
            marker=markers[i % len(markers)],
            markersize=4,
        )
        j += 1
    bsteps = sorted(base)
    if not exact:
        bottom.plot(
            bsteps,
            [atol + rtol * abs(num(base[s]["loss"])) for s in bsteps],
            color="black",
            linestyle="--",
            linewidth=1,
            label=f"tolerance {atol:g} + {rtol:g}*|loss|",
        )
    top.set_ylabel("loss")
    top.set_title(f"loss by layout (baseline: {baseline})")
    top.legend(fontsize=8)
    top.grid(alpha=0.3)
    bottom.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    bottom.set_yscale("log")
    bottom.set_xlabel("step")
    bottom.set_ylabel("|loss - baseline|")
    bottom.set_title(f"difference to baseline (log scale; exact zeros drawn at {DIFF_FLOOR:g})", fontsize=10)
    bottom.grid(alpha=0.3, which="both")
    if bottom.get_legend_handles_labels()[0]:
        bottom.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
