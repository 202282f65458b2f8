"""Reading the runs' metrics and judging each layout against the baseline.

Why tolerances and not equality: the layouts sum the same numbers in different orders (a
reduce-scatter over 4 ranks, a TP matmul split in two, CP attention over gathered K/V), so float32
results differ in the last bits. Measured in fp32 on CPU over 30 steps (docs/design.md section 5), every
correct layout stays within 1.3e-7 relative of the baseline loss for llama3 debug (FSDP, HSDP, DDP,
TP, CP; about one float32 ulp) and within 1.2e-6 for deepseek_v3 debug (EP, ETP, EP folded over
CP), where a token whose router scores tie to the last bit can pick another expert. The default
check, per step, is ``|loss - baseline| <= atol + rtol*|baseline|`` with ``rtol = atol = 1e-5``
(llama3 used 1% of it, deepseek_v3 9%), and the same rule on the gradient norm with
``--grad-norm-rtol 1e-4`` (a re-routed token changes whole expert gradients: 5e-6 measured, 19%
of the grad-norm tolerance). A layout bug changes the math rather than the last bits: a dropped
micro-batch or a mis-sharded weight moves the loss by far more, and a gradient off by a constant
factor, which AdamW hides from the loss, moves the grad norm by that factor from step 1. Run-to-run
reproducibility of ONE layout is exact, so ``--assert-equal`` demands bitwise-equal losses and
gradient norms.

Validation curves (runs with ``[validation]`` enabled: the records with ``validation_loss`` in
metrics.jsonl) are compared by the same loss rule at every step the runs evaluated; a layout whose
validation loss is beyond tolerance, or that misses an evaluation the baseline has, fails too.
For the validation sets to be the same, ``validation.global_batch_size`` must be fixed (the
preflight refuses -1, as it does for training).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from tools.compare_loss.layouts import Layout

DEFAULT_RTOL = 1e-5
DEFAULT_ATOL = 1e-5
# The grad norm reacts more than the loss to a discrete event such as one token routed to
# another expert after a last-bit difference in its router score (whole expert gradients
# change, the loss only by that token's share): measured 5e-6 relative on DeepSeek-V3 debug.
DEFAULT_GRAD_NORM_RTOL = 1e-4


@dataclass
class RunResult:
    """One layout's run: its exit status, folder, log and the records read back from it."""

    layout: Layout
    folder: str
    returncode: int
    wall_s: float
    log_path: str
    records: dict[int, dict] = field(default_factory=dict)
    validation: dict[int, dict] = field(default_factory=dict)  # step -> evaluation, if any

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def _read_records(path: str) -> list[dict]:
    """Every record of a metrics.jsonl; a truncated last line (killed run) is skipped."""
    out = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(rec, dict) and "step" in rec:
                    out.append(rec)
    except OSError:
        pass
    return out


def load_metrics(path: str) -> dict[int, dict]:
    """step -> training record from a metrics.jsonl (evaluation records and the checkpoint
    record written after the last step are left out: a training record has a loss)."""
    return {int(rec["step"]): rec for rec in _read_records(path) if "loss" in rec}


def load_validation(path: str) -> dict[int, dict]:
    """step -> evaluation record (``validation_loss``, ``validation_perplexity``) from a
    metrics.jsonl; empty when the run had no ``[validation]``."""
    return {int(rec["step"]): rec for rec in _read_records(path) if "validation_loss" in rec}


def num(value) -> float:
    """JSONL writes non-finite floats as null: read them back as NaN."""
    return float("nan") if value is None else float(value)


def beyond_tolerance(value: float, reference: float, rtol: float, atol: float) -> bool:
    """numpy.isclose's rule, asymmetric on purpose (the baseline is the reference); a
    non-finite value is never close."""
    if not (math.isfinite(value) and math.isfinite(reference)):
        return True
    return abs(value - reference) > atol + rtol * abs(reference)


def relative(diff: float, reference: float) -> float:
    """``diff`` relative to ``reference`` (0 when both are 0, inf when only the reference is)."""
    return diff / abs(reference) if reference else (0.0 if diff == 0 else math.inf)


@dataclass
class Comparison:
    """One layout against the baseline, over the steps both logged."""

    steps: list[int]
    max_abs: float  # of the loss
    max_rel: float
    first_beyond: int | None  # first step whose loss or grad norm is off
    first_beyond_metric: str | None  # which of them: "loss" or "grad_norm"
    grad_norm_max_rel: float
    missing_steps: list[int]  # expected steps absent from either run

    @property
    def within(self) -> bool:
        return self.first_beyond is None and not self.missing_steps


def compare(
    baseline: dict[int, dict],
    run: dict[int, dict],
    *,
    rtol: float,
    atol: float,
    grad_norm_rtol: float | None = None,
    exact: bool = False,
    expected_steps: int | None = None,
) -> Comparison:
    """Per-step differences to the baseline: the loss must satisfy the (rtol, atol) rule and the
    gradient norm the (grad_norm_rtol, atol) rule, ``grad_norm_rtol`` defaulting to ``rtol``
    (``exact``, i.e. --assert-equal: both must be bitwise equal).

    The grad norm is part of the verdict because AdamW hides gradient-scale bugs from the loss:
    Adam's update is invariant to a constant factor on a parameter's gradient (and clipping
    scales all of them alike), so e.g. expert gradients summed ep times too often barely move
    the loss curve but do move the norm, from step 1. Measured on correct layouts, its relative
    differences are 2e-7 (dense) to 5e-6 (MoE) over 30 steps; such bugs change it by 1e-2 or more."""
    grad_norm_rtol = rtol if grad_norm_rtol is None else grad_norm_rtol
    expected = set(range(1, expected_steps + 1)) if expected_steps else set(baseline) | set(run)
    steps = sorted(set(baseline) & set(run))
    missing = sorted(expected - set(steps))
    max_abs = max_rel = gn_rel = 0.0
    first = first_metric = None
    for step in steps:
        b, r = num(baseline[step]["loss"]), num(run[step]["loss"])
        gb, gr = num(baseline[step].get("grad_norm")), num(run[step].get("grad_norm"))
        diff = abs(r - b) if math.isfinite(r - b) else math.inf
        max_abs, max_rel = max(max_abs, diff), max(max_rel, relative(diff, b))
        gdiff = abs(gr - gb) if math.isfinite(gr - gb) else math.inf
        gn_rel = max(gn_rel, relative(gdiff, gb))
        if exact:  # NaN != NaN: a NaN is never "equal"
            loss_off, gn_off = not r == b, not gr == gb
        else:
            loss_off, gn_off = beyond_tolerance(r, b, rtol, atol), beyond_tolerance(gr, gb, grad_norm_rtol, atol)
        if (loss_off or gn_off) and first is None:
            first, first_metric = step, ("loss" if loss_off else "grad_norm")
    return Comparison(steps, max_abs, max_rel, first, first_metric, gn_rel, missing)


@dataclass
class ValidationComparison:
    """A layout's validation losses against the baseline's, at the steps both evaluated."""

    steps: list[int]
    max_abs: float
    max_rel: float
    first_beyond: int | None
    missing_steps: list[int]  # evaluations present in only one of the runs

    @property
    def within(self) -> bool:
        return self.first_beyond is None and not self.missing_steps


def compare_validation(
    baseline: dict[int, dict], run: dict[int, dict], *, rtol: float, atol: float, exact: bool = False
) -> ValidationComparison:
    """The loss rule of :func:`compare` (or bitwise equality) on ``validation_loss``."""
    steps = sorted(set(baseline) & set(run))
    missing = sorted(set(baseline) ^ set(run))
    max_abs = max_rel = 0.0
    first = None
    for step in steps:
        b, r = num(baseline[step]["validation_loss"]), num(run[step]["validation_loss"])
        diff = abs(r - b) if math.isfinite(r - b) else math.inf
        max_abs, max_rel = max(max_abs, diff), max(max_rel, relative(diff, b))
        off = not r == b if exact else beyond_tolerance(r, b, rtol, atol)
        if off and first is None:
            first = step
    return ValidationComparison(steps, max_abs, max_rel, first, missing)


def mean_tps(records: dict[int, dict]) -> float | None:
    """Tokens/s per device, excluding step 1 (compilation, allocator and gloo warm-up)."""
    values = [num(r.get("tps")) for s, r in records.items() if s > 1 and r.get("tps") is not None]
    return sum(values) / len(values) if values else None


def summarize(
    results: list[RunResult],
    baseline: RunResult,
    *,
    rtol: float,
    atol: float,
    exact: bool,
    steps: int,
    grad_norm_rtol: float | None = None,
) -> list[dict]:
    """One row per run (baseline included) with the numbers the table and summary.json show."""
    rows = []
    for res in results:
        row = {
            "layout": res.layout.name,
            "degrees": res.layout.degrees,
            "nproc": res.layout.nproc,
            "baseline": res is baseline,
            "returncode": res.returncode,
            "wall_s": round(res.wall_s, 2),
            "steps_logged": len(res.records),
            "final_loss": num(res.records[max(res.records)]["loss"]) if res.records else None,
            "mean_tps": mean_tps(res.records),
            "folder": res.folder,
        }
        if not res.ok:
            row["status"] = f"FAILED (exit {res.returncode})"
        elif not baseline.ok:
            row["status"] = "no baseline"
        else:
            cmp = compare(
                baseline.records,
                res.records,
                rtol=rtol,
                atol=atol,
                grad_norm_rtol=grad_norm_rtol,
                exact=exact,
                expected_steps=steps,
            )
            row.update(
                max_abs_diff=cmp.max_abs,
                max_rel_diff=cmp.max_rel,
                first_step_beyond=cmp.first_beyond,
                first_beyond_metric=cmp.first_beyond_metric,
                grad_norm_max_rel_diff=cmp.grad_norm_max_rel,
                missing_steps=cmp.missing_steps,
            )
            val = None
            if baseline.validation or res.validation:
                val = compare_validation(baseline.validation, res.validation, rtol=rtol, atol=atol, exact=exact)
                last = max(res.validation) if res.validation else None
                row.update(
                    validation_steps=val.steps,
                    final_validation_loss=num(res.validation[last]["validation_loss"]) if last else None,
                    validation_max_abs_diff=val.max_abs,
                    validation_max_rel_diff=val.max_rel,
                    validation_first_step_beyond=val.first_beyond,
                    validation_missing_steps=val.missing_steps,
                )
            if cmp.missing_steps:
                row["status"] = f"INCOMPLETE ({len(cmp.missing_steps)} steps missing)"
            elif val is not None and val.missing_steps:
                row["status"] = f"INCOMPLETE ({len(val.missing_steps)} evaluations missing)"
            elif res is baseline:
                row["status"] = "baseline"
            else:
                within = cmp.within and (val is None or val.within)
                row["status"] = "ok" if within else ("NOT EQUAL" if exact else "DIVERGED")
        rows.append(row)
    return rows


def passed(rows: list[dict]) -> bool:
    return all(row["status"] in ("ok", "baseline") for row in rows)
