"""--diagnose: where two layouts' gradients differ. Reruns the baseline and each chosen layout up
to one step with :mod:`tools.compare_loss.grad_dump` (through the comparison's launcher: torchrun,
or forked ranks with ``--launcher fork``) and ranks the parameters by how much their gradients
differ."""

from __future__ import annotations

import json
import math
import os
import sys

from tools.compare_loss.compare import relative
from tools.compare_loss.layouts import Layout, Plan, slug
from tools.compare_loss.report import fmt
from tools.compare_loss.runner import Progress, launch, log_excerpt

# Run by each torchrun worker as `python -m`, so the package resolves as it does here (a forked
# rank runs the module's file as __main__, with this process' sys.path).
GRAD_DUMP_MODULE = "tools.compare_loss.grad_dump"


def run_grad_dump(plan: Plan, layout: Layout, folder: str, step: int, timeout: float | None) -> tuple[str, str] | None:
    """Retrace the compared run of ``layout`` (same argv, same LR schedule) up to ``step`` and
    dump every parameter's gradient (before clipping) there; returns the (json, pt) paths, or
    None when the run failed."""
    json_path, grads_path = os.path.join(folder, "grads.json"), os.path.join(folder, "grads.pt")
    args = ["--out", json_path, "--grads", grads_path, "--step", str(step), "--"]
    args += plan.run_argv(layout, folder)
    log_path = os.path.join(folder, "grad_dump.log")
    progress = Progress(f"grad dump {layout.name} ({layout.nproc}p)", step)
    rc = launch(plan.launcher, layout.nproc, GRAD_DUMP_MODULE, args, log_path, progress, timeout, module=True)
    progress.finish("done" if rc == 0 else f"FAILED (exit {rc}); log: {log_path}")
    if rc != 0:
        print(log_excerpt(log_path), file=sys.stderr, flush=True)
        return None
    return json_path, grads_path


def compare_grad_dumps(
    baseline: dict, other: dict, baseline_grads: dict | None = None, other_grads: dict | None = None
) -> list[dict]:
    """Per-parameter gradient differences, largest first.

    ``grad_rel`` = ||g - g_base|| / ||g_base|| needs the full gradients and catches what norms
    cannot (a permuted or sign-flipped shard has the right norm); ``norm_rel`` compares norms only.
    """
    rows = []
    names = sorted(set(baseline["params"]) | set(other["params"]))
    for name in names:
        nb, no = baseline["params"].get(name), other["params"].get(name)
        row = {"param": name, "baseline_norm": nb, "norm": no, "norm_rel": None, "grad_rel": None}
        if nb is None or no is None:
            row["note"] = "only in " + ("layout" if nb is None else "baseline")
            row["norm_rel"] = math.inf
        else:
            row["norm_rel"] = relative(abs(no - nb), nb)
            if name in (baseline_grads or {}) and name in (other_grads or {}):
                gb, go = baseline_grads[name], other_grads[name]
                if gb.shape != go.shape:
                    row["grad_rel"], row["note"] = math.inf, f"shape {tuple(go.shape)} != {tuple(gb.shape)}"
                else:
                    gb, go = gb.double(), go.double()  # float32 norm() is only ~1e-4 accurate on big tensors
                    row["grad_rel"] = relative(float((go - gb).norm()), float(gb.norm()))
        rows.append(row)
    key = "grad_rel" if any(r["grad_rel"] is not None for r in rows) else "norm_rel"
    rows.sort(key=lambda r: -(r[key] if r[key] is not None else math.inf))
    return rows


def format_grad_rows(rows: list[dict], top: int = 10) -> str:
    lines = [f"  {'parameter':<44} {'|g| baseline':>12} {'|g| layout':>12} {'norm rel':>9} {'|dg|/|g|':>9}"]
    for r in rows[:top]:
        lines.append(
            f"  {r['param']:<44} {fmt(r['baseline_norm'], '.5e'):>12} {fmt(r['norm'], '.5e'):>12} "
            f"{fmt(r['norm_rel'], '.1e'):>9} {fmt(r['grad_rel'], '.1e'):>9}"
            + (f"  ({r['note']})" if r.get("note") else "")
        )
    return "\n".join(lines)


def diagnose(plan: Plan, baseline: Layout, layouts: list[Layout], step: int, timeout: float | None) -> None:
    """Rerun the baseline and each layout for ``step`` steps from the seed and name the
    parameters whose gradients differ most: the place to start looking for the bug."""
    import torch

    root = os.path.join(plan.out, "diagnose")
    print(f"\ndiagnose: gradients at step {step} (before clipping), baseline {baseline.name}")
    base_paths = run_grad_dump(plan, baseline, os.path.join(root, "00-baseline-" + slug(baseline.name)), step, timeout)
    if base_paths is None:
        print("diagnose: the baseline grad dump failed; nothing to compare")
        return
    with open(base_paths[0]) as f:
        base = json.load(f)
    base_grads = torch.load(base_paths[1], weights_only=True)
    for i, layout in enumerate(layouts, 1):
        paths = run_grad_dump(plan, layout, os.path.join(root, f"{i:02d}-{slug(layout.name)}"), step, timeout)
        if paths is None:
            continue
        with open(paths[0]) as f:
            other = json.load(f)
        rows = compare_grad_dumps(base, other, base_grads, torch.load(paths[1], weights_only=True))
        with open(os.path.join(root, f"{i:02d}-{slug(layout.name)}", "grad_diff.json"), "w") as f:
            json.dump(rows, f, indent=1)
        print(
            f"\n{layout.name} vs {baseline.name}: step {step} loss {other['loss']!r} vs {base['loss']!r}, "
            f"grad norm {other['grad_norm']!r} vs {base['grad_norm']!r}; top parameters by relative "
            f"gradient difference:"
        )
        print(format_grad_rows(rows))
