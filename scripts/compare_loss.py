"""Prove that a change of parallelism layout did not change the math: train the same model from
the same seed checkpoint on the same data under several layouts and compare the loss curves.

    python scripts/compare_loss.py --config train_configs/llama3.toml --steps 30 \\
        --layouts "fsdp=4" "dp_replicate=2,fsdp=2" "tp=2,fsdp=2" "cp=2,tp=2" \\
        [--baseline NAME] [--rtol R --atol A] [--assert-equal] [--out DIR] [--plot PATH] \\
        [--diagnose [all]] [-- extra train.py overrides for every run]

Layout syntax: comma-separated ``key=value`` over the ``[parallelism]`` degrees ``dp_replicate,
dp_shard (alias fsdp), cp, tp, pp, ep, etp`` (the long config names work too), plus ``nproc=N``
for the process count. Unspecified degrees are 1 -- including ``dp_shard``, so that a layout
string says everything that runs and ``nproc`` defaults to ``dp_replicate*dp_shard*cp*tp*pp``;
``dp_shard=-1`` infers it from an explicit ``nproc``. ``ep`` and ``etp`` add no processes (experts
fold over the dp_shard*cp*tp ranks). ``1`` or ``single`` is one process; ``NAME:SPEC`` names a
layout. The first layout is the baseline unless ``--baseline`` names another.

Why tolerances and not equality: the layouts sum the same numbers in different orders (a
reduce-scatter over 4 ranks, a TP matmul split in two, CP attention over gathered K/V), so float32
results differ in the last bits. Measured in fp32 on CPU over 30 steps (DESIGN.md section 5), every
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

Exit status: 0 every layout within tolerance, 1 a layout beyond tolerance or a run that failed,
2 bad usage or a layout that cannot run (rejected before anything starts).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:  # `python scripts/compare_loss.py` puts scripts/ first, not the root
    sys.path.insert(0, REPO_ROOT)

from parallel_dims import validate_degrees  # noqa: E402
from parallel_dims.axes import AXES, DEGREE_NAMES, PROCESS_AXES  # noqa: E402
from trainer.config import PARALLELISM_ALIASES  # noqa: E402

TRAIN_PY = os.path.join(REPO_ROOT, "train.py")
GRAD_DUMP_PY = os.path.join(REPO_ROOT, "scripts", "grad_dump.py")

DEFAULT_RTOL = 1e-5
DEFAULT_ATOL = 1e-5
# The grad norm reacts more than the loss to a discrete event such as one token routed to
# another expert after a last-bit difference in its router score (whole expert gradients
# change, the loss only by that token's share): measured 5e-6 relative on DeepSeek-V3 debug.
DEFAULT_GRAD_NORM_RTOL = 1e-4
# |difference| plotted on a log axis: exact zeros (bitwise-equal steps) are drawn at this floor.
DIFF_FLOOR = 1e-9

DEGREE_KEYS = DEGREE_NAMES
# PROCESS_AXES (parallel_dims/axes.py): the degrees that multiply into the process count; ep
# and etp fold over dp_shard*cp*tp. Layout keys also accept each axis' aliases and config key.
KEY_ALIASES = {
    **{alias: a.name for a in AXES for alias in a.layout_aliases},
    **{a.config_key: a.name for a in AXES},
}
LAYOUT_KEYS = DEGREE_KEYS + ("nproc",)
SINGLE_PROCESS = ("1", "single")

# Config keys each run gets from this tool; setting them after `--` would silently fight it.
CONTROLLED_KEYS = {
    **{f"parallelism.{long}": "the layout strings (--layouts)" for long in PARALLELISM_ALIASES.values()},
    "training.steps": "--steps",
    "job.dump_folder": "--out",
    "metrics.log_freq": "compare_loss (every step is logged)",
    "metrics.enable_jsonl": "compare_loss (the comparison reads metrics.jsonl)",
    "checkpoint.enable": "compare_loss (runs do not save checkpoints)",
    "checkpoint.initial_load_path": "--seed-checkpoint (or the seed checkpoint compare_loss creates)",
    "checkpoint.create_seed_checkpoint": "compare_loss",
}

STEP_LINE = re.compile(r"\bstep\s+(\d+)(?:/\d+)?\s+loss\s+(\S+)")


class UsageError(ValueError):
    """Bad command line or a layout that cannot run: reported before any run starts (exit 2)."""


# ------------------------------------------------------------------------------ layouts


@dataclass(frozen=True)
class Layout:
    """One parallelism layout to train under. ``degrees`` are resolved (dp_shard never -1)."""

    name: str
    degrees: dict[str, int]
    nproc: int

    def train_args(self) -> list[str]:
        """Every degree explicitly, so nothing is inherited from the TOML (its dp_shard=-1 would
        otherwise silently absorb a typo in the layout)."""
        return [arg for k in DEGREE_KEYS for arg in (f"--parallelism.{k}", str(self.degrees[k]))]

    def describe(self) -> str:
        shown = [f"{k}={v}" for k, v in self.degrees.items() if v != 1]
        return f"{', '.join(shown) or 'no parallelism'}; {self.nproc} process{'es' if self.nproc > 1 else ''}"


def _canonical_key(key: str, spec: str) -> str:
    key = key.strip()
    if key in LAYOUT_KEYS:
        return key
    if key in KEY_ALIASES:
        return KEY_ALIASES[key]
    known = list(LAYOUT_KEYS) + list(KEY_ALIASES)
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.5)
    close = close or [k for k in known if key and k.startswith(key)][:1]  # 'tensor' -> tp
    if close:
        # suggest the short spelling: a near-miss of a long config name gets its alias
        suggestion = close[0] if close[0] in LAYOUT_KEYS or close[0] == "fsdp" else KEY_ALIASES[close[0]]
        hint = f"did you mean '{suggestion}'?"
    else:
        hint = f"valid keys: {', '.join(LAYOUT_KEYS)} (fsdp = dp_shard)"
    raise UsageError(f"layout '{spec}': unknown key '{key}'; {hint}")


def parse_layout(text: str) -> Layout:
    """``[NAME:]key=value,...``, ``1`` or ``single`` -> a validated :class:`Layout`."""
    name, sep, spec = text.partition(":")
    if not sep:
        name, spec = text, text
    name, spec = name.strip(), spec.strip()
    if not spec:
        raise UsageError(f"layout '{text}' is empty; write e.g. 'fsdp=4' or 'single'")
    if not name:
        raise UsageError(f"layout '{text}': empty name before ':'")
    values: dict[str, int] = {}
    if spec.lower() not in SINGLE_PROCESS:
        for item in spec.split(","):
            key, eq, value = item.partition("=")
            if not eq:
                raise UsageError(f"layout '{text}': '{item}' is not key=value (e.g. tp=2)")
            key = _canonical_key(key, text)
            if key in values:
                raise UsageError(f"layout '{text}': {key} is given twice (fsdp is an alias of dp_shard)")
            try:
                values[key] = int(value.strip())
            except ValueError:
                raise UsageError(f"layout '{text}': {key}={value.strip()!r} is not an integer") from None
    degrees = {k: values.get(k, 1) for k in DEGREE_KEYS}
    product = math.prod(degrees[k] for k in PROCESS_AXES)
    if "nproc" in values:
        nproc = values["nproc"]
        if nproc < 1:
            raise UsageError(f"layout '{text}': nproc={nproc} must be >= 1")
    elif degrees["dp_shard"] == -1:
        raise UsageError(f"layout '{text}': dp_shard=-1 infers the degree from the process count; add nproc=N")
    else:
        # a degree < 1 makes the product meaningless; validate_degrees then names that degree
        nproc = max(product, 1)
    try:
        resolved = validate_degrees(**degrees, world_size=nproc)
    except ValueError as exc:
        given = f" (nproc={nproc})" if "nproc" in values else ""
        raise UsageError(f"layout '{text}'{given}: {exc}") from None
    return Layout(name=name, degrees={k: getattr(resolved, k) for k in DEGREE_KEYS}, nproc=nproc)


def parse_layouts(texts: Iterable[str]) -> list[Layout]:
    """Parse all layouts; repeated names (e.g. the same layout twice for --assert-equal) get
    '#2', '#3' so every run has its own row and folder."""
    layouts, seen = [], {}
    for text in texts:
        layout = parse_layout(text)
        seen[layout.name] = seen.get(layout.name, 0) + 1
        if seen[layout.name] > 1:
            layout = dataclasses.replace(layout, name=f"{layout.name}#{seen[layout.name]}")
        layouts.append(layout)
    if not layouts:
        raise UsageError("give at least one layout")
    return layouts


def pick_baseline(layouts: list[Layout], name: str | None) -> Layout:
    if name is None:
        return layouts[0]
    for layout in layouts:
        if layout.name == name:
            return layout
    names = [l.name for l in layouts]
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.5)
    hint = f"did you mean '{close[0]}'? " if close else ""
    raise UsageError(f"--baseline '{name}' is not one of the layouts; {hint}layouts: {', '.join(names)}")


def check_extra_overrides(extra: list[str]) -> None:
    """Refuse overrides after `--` that the tool sets itself, instead of letting one side win."""
    for arg in extra:
        if not arg.startswith("--"):
            continue
        name = arg[2:].partition("=")[0]
        if name in ("config", "job.config_file"):
            raise UsageError(f"'{arg}' after '--': pass the config as compare_loss --config")
        section, _, key = name.partition(".")
        if section == "parallelism":
            key = PARALLELISM_ALIASES.get(key, key)
        full = f"{section}.{key}"
        if full in CONTROLLED_KEYS:
            raise UsageError(f"'{arg}' after '--': {full} is set by {CONTROLLED_KEYS[full]}; remove it")


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.#-]+", "_", name.replace("=", "")).strip("_") or "run"


# ---------------------------------------------------------------------------- planning


@dataclass
class Plan:
    """What every run shares; ``run_argv`` adds one layout's degrees and folder."""

    config: str
    steps: int
    out: str
    extra: list[str]
    seed_checkpoint: str

    def run_folder(self, index: int, layout: Layout) -> str:
        return os.path.join(self.out, f"{index:02d}-{slug(layout.name)}")

    def run_argv(self, layout: Layout, dump_folder: str) -> list[str]:
        return (
            ["--config", self.config]
            + layout.train_args()
            + [
                "--training.steps", str(self.steps),
                "--metrics.log_freq", "1",
                "--metrics.enable_jsonl", "true",
                "--checkpoint.enable", "false",
                "--checkpoint.initial_load_path", self.seed_checkpoint,
                "--job.dump_folder", dump_folder,
            ]
            + self.extra
        )


def torchrun_cmd(nproc: int, script: str, args: list[str]) -> list[str]:
    # `python -m torch.distributed.run` is torchrun without depending on PATH.
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", script, *args]


def preflight(plan: Plan, layouts: list[Layout]) -> None:
    """Every check train.py would make before its first collective, for every layout, now:
    config and override errors, degrees vs the model (heads % tp, experts % ep, seq_len vs cp*tp,
    layers vs pp) and vs the batch (global batch % batch degree * local batch)."""
    from models.parallelize import check_model_fits_layout
    from models.registry import get_model_spec
    from parallel_dims import ParallelDims
    from trainer.config import load_config

    try:  # the TOML and the overrides after `--` on their own, so their errors read as such
        base = load_config(["--config", plan.config, *plan.extra])
    except ValueError as exc:
        raise UsageError(f"config {plan.config} with overrides {' '.join(plan.extra) or '(none)'}: {exc}") from None
    if base.training.global_batch_size == -1:
        raise UsageError(
            "training.global_batch_size = -1 means local_batch_size x batch degree, a different global "
            "batch for each layout, so the losses would not be comparable; set it, e.g. "
            f"-- --training.global_batch_size {base.training.local_batch_size * 4}"
        )
    for layout in layouts:
        try:
            cfg = load_config(plan.run_argv(layout, os.path.join(plan.out, "preflight")))
            pd = ParallelDims(**layout.degrees, world_size=layout.nproc)
            args = get_model_spec(cfg.model.name, cfg.model.flavor).args
            check_model_fits_layout(args, pd, cfg.training.seq_len, cfg.parallelism.enable_sequence_parallel)
            pd.check_model(
                global_batch_size=cfg.training.global_batch_size, local_batch_size=cfg.training.local_batch_size
            )
            cfg.training.gradient_accumulation_steps(pd.dp_replicate * pd.dp_shard)
        except ValueError as exc:
            raise UsageError(f"layout '{layout.name}' ({layout.describe()}): {exc}") from None


# ----------------------------------------------------------------------------- running


@dataclass
class RunResult:
    layout: Layout
    folder: str
    returncode: int
    wall_s: float
    log_path: str
    records: dict[int, dict] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def run_streaming(
    cmd: list[str], log_path: str, on_line: Callable[[str], None], timeout: float | None = None
) -> int:
    """Run ``cmd``, copy its merged stdout/stderr to ``log_path`` and hand each line to ``on_line``.

    The child gets its own session so a timeout or Ctrl-C stops torchrun *and* its workers
    (signalling the group of the process we started, nothing else)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=env,
            start_new_session=True,
        )
        timed_out = threading.Event()

        def kill() -> None:
            timed_out.set()
            _kill_group(proc)

        timer = threading.Timer(timeout, kill) if timeout else None
        if timer:
            timer.start()
        try:
            for line in proc.stdout:
                log.write(line)
                on_line(line)
            rc = proc.wait()
        except BaseException:
            _kill_group(proc)
            raise
        finally:
            if timer:
                timer.cancel()
        if timed_out.is_set():
            log.write(f"\ncompare_loss: killed after the {timeout:.0f}s --timeout\n")
            return 124
        return rc


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class Progress:
    """One compact line per run: layout, step, loss, elapsed. Rewritten in place on a terminal;
    on a log (CI) only a few steps per run are printed."""

    def __init__(self, label: str, steps: int, stream=None):
        self.label, self.steps = label, steps
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty()
        self.start = time.perf_counter()
        self.every = max(1, steps // 5)

    def __call__(self, line: str) -> None:
        m = STEP_LINE.search(line)
        if not m:
            return
        step = int(m.group(1))
        text = f"{self.label}  step {step}/{self.steps}  loss {m.group(2)}  {time.perf_counter() - self.start:5.1f}s"
        if self.tty:
            self.stream.write("\r\033[K" + text)
            self.stream.flush()
        elif step == 1 or step == self.steps or step % self.every == 0:
            print(text, file=self.stream, flush=True)

    def finish(self, status: str) -> None:
        text = f"{self.label}  {status}  {time.perf_counter() - self.start:5.1f}s"
        if self.tty:
            self.stream.write("\r\033[K")
        print(text, file=self.stream, flush=True)


def log_excerpt(log_path: str, tail: int = 25) -> str:
    """The trainer's own ``error:`` lines (torchrun's traceback tends to bury them) + the tail."""
    try:
        with open(log_path, errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return f"(no log at {log_path})"
    errors = [l for l in lines if l.lstrip().startswith("error:") or "Error:" in l][:5]
    parts = []
    if errors:
        parts += ["  errors:"] + [f"    {l}" for l in errors] + ["  last lines:"]
    parts += [f"    {l}" for l in lines[-tail:]]
    return "\n".join(parts)


def create_seed_checkpoint(plan: Plan, timeout: float | None) -> str:
    """One process writes the initial weights every layout starts from."""
    folder = os.path.join(plan.out, "seed")
    args = ["--config", plan.config, "--checkpoint.create_seed_checkpoint", "--job.dump_folder", folder]
    args += plan.extra
    log_path = os.path.join(folder, "seed.log")
    progress = Progress("seed checkpoint", 1)
    rc = run_streaming([sys.executable, TRAIN_PY, *args], log_path, lambda line: None, timeout)
    if rc != 0:
        progress.finish(f"FAILED (exit {rc})")
        print(log_excerpt(log_path), file=sys.stderr)
        raise SystemExit(1)
    from trainer.config import load_config

    cfg = load_config(args)
    path = os.path.join(cfg.resolve_path(cfg.checkpoint.folder), "step-0")
    progress.finish(f"-> {path}")
    return path


def run_layouts(plan: Plan, layouts: list[Layout], timeout: float | None) -> list[RunResult]:
    """Sequentially (CPU runs share the cores); a failed run is reported and the rest go on."""
    results = []
    for i, layout in enumerate(layouts, 1):
        folder = plan.run_folder(i, layout)
        log_path = os.path.join(folder, "train.log")
        label = f"[{i}/{len(layouts)}] {layout.name} ({layout.nproc}p)"
        progress = Progress(label, plan.steps)
        start = time.perf_counter()
        rc = run_streaming(
            torchrun_cmd(layout.nproc, TRAIN_PY, plan.run_argv(layout, folder)), log_path, progress, timeout
        )
        result = RunResult(layout, folder, rc, time.perf_counter() - start, log_path)
        result.records = load_metrics(os.path.join(folder, "metrics.jsonl"))
        progress.finish("done" if rc == 0 else f"FAILED (exit {rc}); log: {log_path}")
        if rc != 0:
            print(log_excerpt(log_path), file=sys.stderr, flush=True)
        results.append(result)
    return results


# -------------------------------------------------------------------------- comparing


def load_metrics(path: str) -> dict[int, dict]:
    """step -> record from a metrics.jsonl; a truncated last line (killed run) is skipped."""
    records: dict[int, dict] = {}
    try:
        with open(path) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                records[int(rec["step"])] = rec
    except OSError:
        pass
    return records


def _num(value) -> float:
    """JSONL writes non-finite floats as null: read them back as NaN."""
    return float("nan") if value is None else float(value)


def beyond_tolerance(value: float, reference: float, rtol: float, atol: float) -> bool:
    """numpy.isclose's rule, asymmetric on purpose (the baseline is the reference); a
    non-finite value is never close."""
    if not (math.isfinite(value) and math.isfinite(reference)):
        return True
    return abs(value - reference) > atol + rtol * abs(reference)


def _rel(diff: float, reference: float) -> float:
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
        b, r = _num(baseline[step]["loss"]), _num(run[step]["loss"])
        gb, gr = _num(baseline[step].get("grad_norm")), _num(run[step].get("grad_norm"))
        diff = abs(r - b) if math.isfinite(r - b) else math.inf
        max_abs, max_rel = max(max_abs, diff), max(max_rel, _rel(diff, b))
        gdiff = abs(gr - gb) if math.isfinite(gr - gb) else math.inf
        gn_rel = max(gn_rel, _rel(gdiff, gb))
        if exact:  # NaN != NaN: a NaN is never "equal"
            loss_off, gn_off = not r == b, not gr == gb
        else:
            loss_off, gn_off = beyond_tolerance(r, b, rtol, atol), beyond_tolerance(gr, gb, grad_norm_rtol, atol)
        if (loss_off or gn_off) and first is None:
            first, first_metric = step, ("loss" if loss_off else "grad_norm")
    return Comparison(steps, max_abs, max_rel, first, first_metric, gn_rel, missing)


def mean_tps(records: dict[int, dict]) -> float | None:
    """Tokens/s per device, excluding step 1 (compilation, allocator and gloo warm-up)."""
    values = [_num(r.get("tps")) for s, r in records.items() if s > 1 and r.get("tps") is not None]
    return sum(values) / len(values) if values else None


def _fmt(x: float | None, spec: str = ".2e") -> str:
    if x is None:
        return "-"
    return format(x, spec) if math.isfinite(x) else str(x)


def summarize(
    results: list[RunResult], baseline: RunResult, *, rtol: float, atol: float, exact: bool, steps: int,
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
            "final_loss": _num(res.records[max(res.records)]["loss"]) if res.records else None,
            "mean_tps": mean_tps(res.records),
            "folder": res.folder,
        }
        if not res.ok:
            row["status"] = f"FAILED (exit {res.returncode})"
        elif not baseline.ok:
            row["status"] = "no baseline"
        else:
            cmp = compare(baseline.records, res.records, rtol=rtol, atol=atol, grad_norm_rtol=grad_norm_rtol,
                          exact=exact, expected_steps=steps)
            row.update(
                max_abs_diff=cmp.max_abs,
                max_rel_diff=cmp.max_rel,
                first_step_beyond=cmp.first_beyond,
                first_beyond_metric=cmp.first_beyond_metric,
                grad_norm_max_rel_diff=cmp.grad_norm_max_rel,
                missing_steps=cmp.missing_steps,
            )
            if cmp.missing_steps:
                row["status"] = f"INCOMPLETE ({len(cmp.missing_steps)} steps missing)"
            elif res is baseline:
                row["status"] = "baseline"
            else:
                row["status"] = "ok" if cmp.within else ("NOT EQUAL" if exact else "DIVERGED")
        rows.append(row)
    return rows


def passed(rows: list[dict]) -> bool:
    return all(row["status"] in ("ok", "baseline") for row in rows)


def format_table(rows: list[dict]) -> str:
    headers = ["layout", "nproc", "max|dloss|", "max rel", "first >tol", "final loss", "gnorm rel",
               "tok/s/dev", "wall s", "status"]
    table = [headers]
    for r in rows:
        first = r.get("first_step_beyond")
        table.append([
            r["layout"],
            str(r["nproc"]),
            _fmt(r.get("max_abs_diff")),
            _fmt(r.get("max_rel_diff")),
            "-" if first is None else f"{first}" + (" (gnorm)" if r.get("first_beyond_metric") == "grad_norm" else ""),
            _fmt(r["final_loss"], ".6f"),
            _fmt(r.get("grad_norm_max_rel_diff")),
            _fmt(r["mean_tps"], ",.0f"),
            f"{r['wall_s']:.1f}",
            r["status"],
        ])
    widths = [max(len(row[i]) for row in table) for i in range(len(headers))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# -------------------------------------------------------------------------------- plot


def plot_runs(path: str, runs: list[tuple[str, dict[int, dict]]], baseline: str, rtol: float, atol: float,
              exact: bool = False) -> str:
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
            steps, [_num(records[s]["loss"]) for s in steps], color=color,
            linestyle=styles[i % len(styles)], marker=markers[i % len(markers)], markevery=max(1, len(steps) // 8),
            markersize=4, linewidth=2.5 if is_base else 1.2, label=name + (" (baseline)" if is_base else ""),
        )
        if is_base:
            continue
        common = [s for s in steps if s in base]
        diffs = [abs(_num(records[s]["loss"]) - _num(base[s]["loss"])) for s in common]
        diffs = [d if math.isfinite(d) else float("nan") for d in diffs]
        offset = (j - (others - 1) / 2) * nudge
        bottom.plot([s + offset for s in common], [max(d, DIFF_FLOOR) for d in diffs], color=color,
                    linestyle="none", marker=markers[i % len(markers)], markersize=4)
        j += 1
    bsteps = sorted(base)
    if not exact:
        bottom.plot(bsteps, [atol + rtol * abs(_num(base[s]["loss"])) for s in bsteps], color="black",
                    linestyle="--", linewidth=1, label=f"tolerance {atol:g} + {rtol:g}*|loss|")
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


# ---------------------------------------------------------------------------- diagnose


def run_grad_dump(plan: Plan, layout: Layout, folder: str, step: int, timeout: float | None) -> tuple[str, str] | None:
    """Retrace the compared run of ``layout`` (same argv, same LR schedule) up to ``step`` and
    dump every parameter's gradient (before clipping) there; returns the (json, pt) paths, or
    None when the run failed."""
    json_path, grads_path = os.path.join(folder, "grads.json"), os.path.join(folder, "grads.pt")
    args = ["--out", json_path, "--grads", grads_path, "--step", str(step), "--"]
    args += plan.run_argv(layout, folder)
    log_path = os.path.join(folder, "grad_dump.log")
    progress = Progress(f"grad dump {layout.name} ({layout.nproc}p)", step)
    rc = run_streaming(torchrun_cmd(layout.nproc, GRAD_DUMP_PY, args), log_path, progress, timeout)
    progress.finish("done" if rc == 0 else f"FAILED (exit {rc}); log: {log_path}")
    if rc != 0:
        print(log_excerpt(log_path), file=sys.stderr, flush=True)
        return None
    return json_path, grads_path


def compare_grad_dumps(baseline: dict, other: dict, baseline_grads: dict | None = None,
                       other_grads: dict | None = None) -> list[dict]:
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
            row["norm_rel"] = _rel(abs(no - nb), nb)
            if name in (baseline_grads or {}) and name in (other_grads or {}):
                gb, go = baseline_grads[name], other_grads[name]
                if gb.shape != go.shape:
                    row["grad_rel"], row["note"] = math.inf, f"shape {tuple(go.shape)} != {tuple(gb.shape)}"
                else:
                    gb, go = gb.double(), go.double()  # float32 norm() is only ~1e-4 accurate on big tensors
                    row["grad_rel"] = _rel(float((go - gb).norm()), float(gb.norm()))
        rows.append(row)
    key = "grad_rel" if any(r["grad_rel"] is not None for r in rows) else "norm_rel"
    rows.sort(key=lambda r: -(r[key] if r[key] is not None else math.inf))
    return rows


def format_grad_rows(rows: list[dict], top: int = 10) -> str:
    lines = [f"  {'parameter':<44} {'|g| baseline':>12} {'|g| layout':>12} {'norm rel':>9} {'|dg|/|g|':>9}"]
    for r in rows[:top]:
        lines.append(
            f"  {r['param']:<44} {_fmt(r['baseline_norm'], '.5e'):>12} {_fmt(r['norm'], '.5e'):>12} "
            f"{_fmt(r['norm_rel'], '.1e'):>9} {_fmt(r['grad_rel'], '.1e'):>9}"
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
        print(f"\n{layout.name} vs {baseline.name}: step {step} loss {other['loss']!r} vs {base['loss']!r}, "
              f"grad norm {other['grad_norm']!r} vs {base['grad_norm']!r}; top parameters by relative "
              f"gradient difference:")
        print(format_grad_rows(rows))


# -------------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="compare_loss.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "Layouts: comma-separated key=value over dp_replicate, dp_shard (= fsdp), cp, tp, pp, ep, etp\n"
            "and nproc. Unspecified degrees are 1 (dp_shard too), nproc defaults to\n"
            "dp_replicate*dp_shard*cp*tp*pp (ep/etp fold over dp_shard*cp*tp and add no processes);\n"
            "dp_shard=-1 infers it from an explicit nproc. '1' or 'single' = one process.\n"
            "'NAME:SPEC' names a layout. Examples: fsdp=4  dp_replicate=2,fsdp=2  tp=2,cp=2\n"
            "  fsdp=2,cp=2,ep=4  tp=2,fsdp=2,ep=2,etp=2  nproc=8,tp=2,dp_shard=-1  hsdp:dp_replicate=2,fsdp=2\n\n"
            "Everything after '--' is passed to every train.py run, e.g. -- --training.seq_len 64.\n"
            "Exit status: 0 all within tolerance, 1 divergence or a failed run, 2 bad usage/layout."
        ),
    )
    p.add_argument("--config", required=True, help="train config (path or a name in train_configs/)")
    p.add_argument("--layouts", nargs="+", required=True, metavar="LAYOUT", help="layouts to compare (see below)")
    p.add_argument("--steps", type=int, default=30, help="training steps per run (default 30)")
    p.add_argument("--baseline", help="name of the reference layout (default: the first)")
    p.add_argument("--rtol", type=float, default=DEFAULT_RTOL,
                   help=f"relative loss tolerance per step (default {DEFAULT_RTOL:g}); a step is off when "
                        "|loss - baseline| > atol + rtol*|baseline|. Measured fp32/CPU over 30 steps: <= 1.3e-7 "
                        "(llama3 debug), <= 1.2e-6 (deepseek_v3 debug)")
    p.add_argument("--atol", type=float, default=DEFAULT_ATOL,
                   help=f"absolute tolerance per step, for the loss and the grad norm (default {DEFAULT_ATOL:g})")
    p.add_argument("--grad-norm-rtol", type=float, default=DEFAULT_GRAD_NORM_RTOL,
                   help=f"relative grad-norm tolerance per step (default {DEFAULT_GRAD_NORM_RTOL:g}; measured "
                        "<= 2e-7 dense, <= 5e-6 MoE, where one token's expert choice can flip); the grad norm "
                        "catches gradient-scale bugs that AdamW hides from the loss")
    p.add_argument("--assert-equal", action="store_true",
                   help="demand bitwise-equal losses and grad norms (reproducibility of one layout, e.g. "
                        "--layouts fsdp=4 fsdp=4)")
    p.add_argument("--out", help="output folder (default outputs/compare_loss/<timestamp>)")
    p.add_argument("--plot", help="PNG path for the plot (default <out>/loss_comparison.png)")
    p.add_argument("--seed-checkpoint", help="reuse this seed checkpoint (a step-0 folder) instead of creating one")
    p.add_argument("--timeout", type=float, default=0, help="seconds after which a run is killed (default: none)")
    p.add_argument("--diagnose", nargs="?", const="diverged", choices=("diverged", "all"),
                   help="after the comparison, dump per-parameter gradients of the baseline and of each "
                        "diverged layout ('all': every layout) and list the parameters that differ most")
    p.add_argument("--diagnose-step", type=int, default=1,
                   help="step whose gradients --diagnose compares (default 1: identical weights and data, so "
                        "any difference is the layout's math; a later step, e.g. the first one beyond "
                        "tolerance, retraces the compared runs exactly up to there)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    args = build_parser().parse_args(argv)
    try:
        if args.steps < 1:
            raise UsageError(f"--steps must be >= 1, got {args.steps}")
        if not 1 <= args.diagnose_step <= args.steps:
            raise UsageError(f"--diagnose-step must be between 1 and --steps ({args.steps}), got {args.diagnose_step}")
        layouts = parse_layouts(args.layouts)
        baseline = pick_baseline(layouts, args.baseline)
        check_extra_overrides(extra)
        from trainer.config import resolve_config_path

        config = os.path.abspath(resolve_config_path(args.config))
        out = os.path.abspath(args.out or os.path.join("outputs", "compare_loss", time.strftime("%Y%m%d-%H%M%S")))
        if os.path.isdir(out) and os.listdir(out):
            # runs append to metrics.jsonl: an old run's records must not mix with new ones
            raise UsageError(f"--out {out} already holds files; pick a new folder or delete it")
        if args.seed_checkpoint and not os.path.isdir(args.seed_checkpoint):
            raise UsageError(f"--seed-checkpoint {args.seed_checkpoint} is not a folder")
        seed = (os.path.abspath(args.seed_checkpoint) if args.seed_checkpoint
                else os.path.join(out, "seed", "checkpoint", "step-0"))
        plan = Plan(config=config, steps=args.steps, out=out, extra=extra, seed_checkpoint=seed)
        preflight(plan, layouts)
    except ValueError as exc:  # UsageError and the config's ConfigError
        print(f"error: {exc}", file=sys.stderr)
        return 2

    try:
        return _compare(args, plan, layouts, baseline)
    except KeyboardInterrupt:  # run_streaming has already stopped the running job
        print("\ninterrupted", file=sys.stderr)
        return 130


def _compare(args: argparse.Namespace, plan: Plan, layouts: list[Layout], baseline: Layout) -> int:
    out, extra, seed = plan.out, plan.extra, plan.seed_checkpoint
    timeout = args.timeout or None
    os.makedirs(out, exist_ok=True)
    print(f"compare_loss: {len(layouts)} layouts x {args.steps} steps, baseline {baseline.name}, output {out}")
    for layout in layouts:
        print(f"  {layout.name:<28} {layout.describe()}")
    if not args.seed_checkpoint:
        create_seed_checkpoint(plan, timeout)
    results = run_layouts(plan, layouts, timeout)
    base_result = results[layouts.index(baseline)]
    rows = summarize(results, base_result, rtol=args.rtol, atol=args.atol, grad_norm_rtol=args.grad_norm_rtol,
                     exact=args.assert_equal, steps=args.steps)

    tol = "bitwise equality (--assert-equal)" if args.assert_equal else (
        f"|dloss| <= {args.atol:g} + {args.rtol:g}*|loss|, |dgrad_norm| <= {args.atol:g} + "
        f"{args.grad_norm_rtol:g}*|grad_norm|")
    print(f"\nloss vs baseline {baseline.name} over {args.steps} steps; tolerance: {tol}")
    print(format_table(rows))
    plot_path = os.path.abspath(args.plot or os.path.join(out, "loss_comparison.png"))
    plotted = [(r.layout.name, r.records) for r in results if r.records]
    if base_result.records:
        plot_runs(plot_path, plotted, baseline.name, args.rtol, args.atol, exact=args.assert_equal)
        print(f"plot: {plot_path}")
    summary = {
        "config": plan.config, "steps": args.steps, "baseline": baseline.name, "rtol": args.rtol, "atol": args.atol,
        "grad_norm_rtol": args.grad_norm_rtol,
        "assert_equal": args.assert_equal, "extra_overrides": extra, "seed_checkpoint": seed, "runs": rows,
        "passed": passed(rows),
    }
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    print(f"summary: {os.path.join(out, 'summary.json')}")

    if args.diagnose and base_result.ok:
        wanted = [r.layout for r, row in zip(results, rows) if r is not base_result and r.ok
                  and (args.diagnose == "all" or row["status"] != "ok")]
        if wanted:
            diagnose(plan, baseline, wanted, args.diagnose_step, timeout)
        else:
            print("diagnose: every layout is within tolerance; use --diagnose all to compare gradients anyway")
    ok = passed(rows)
    print("PASS: every layout matches the baseline" if ok else "FAIL: see the status column")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
