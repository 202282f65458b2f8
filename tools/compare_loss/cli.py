"""Prove that a change of parallelism layout did not change the math: train the same model from
the same seed checkpoint on the same data under several layouts and compare the loss curves.

    python -m tools.compare_loss --config train_configs/llama3.toml --steps 30 \\
        --layouts "fsdp=4" "dp_replicate=2,fsdp=2" "tp=2,fsdp=2" "cp=2,tp=2" \\
        [--baseline NAME] [--rtol R --atol A] [--assert-equal] [--out DIR] [--plot PATH] \\
        [--diagnose [all]] [--launcher {torchrun,fork}] [-- extra train.py overrides for every run]

(``meshtrain-compare-loss`` is the same command.) The layout syntax is described in
:mod:`tools.compare_loss.layouts`, why and how the losses are compared within a tolerance in
:mod:`tools.compare_loss.compare`.

Exit status: 0 every layout within tolerance, 1 a layout beyond tolerance or a run that failed,
2 bad usage or a layout that cannot run (rejected before anything starts).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from tools.compare_loss import runner
from tools.compare_loss.compare import DEFAULT_ATOL, DEFAULT_GRAD_NORM_RTOL, DEFAULT_RTOL, passed, summarize
from tools.compare_loss.diagnose import diagnose
from tools.compare_loss.layouts import (
    LAUNCHERS,
    Layout,
    Plan,
    UsageError,
    check_extra_overrides,
    parse_layouts,
    pick_baseline,
    preflight,
)
from tools.compare_loss.report import format_table, plot_runs, write_summary
from trainer.runtime.cli_errors import report_user_error

CONSOLE_SCRIPT = "meshtrain-compare-loss"


def _prog() -> str:
    """How the user started the tool, for the usage line."""
    if os.path.basename(sys.argv[0]) == CONSOLE_SCRIPT:
        return CONSOLE_SCRIPT
    return "python -m tools.compare_loss"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=_prog(),
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
    p.add_argument(
        "--rtol",
        type=float,
        default=DEFAULT_RTOL,
        help=f"relative loss tolerance per step (default {DEFAULT_RTOL:g}); a step is off when "
        "|loss - baseline| > atol + rtol*|baseline|. Measured fp32/CPU over 30 steps: <= 1.3e-7 "
        "(llama3 debug), <= 1.2e-6 (deepseek_v3 debug)",
    )
    p.add_argument(
        "--atol",
        type=float,
        default=DEFAULT_ATOL,
        help=f"absolute tolerance per step, for the loss and the grad norm (default {DEFAULT_ATOL:g})",
    )
    p.add_argument(
        "--grad-norm-rtol",
        type=float,
        default=DEFAULT_GRAD_NORM_RTOL,
        help=f"relative grad-norm tolerance per step (default {DEFAULT_GRAD_NORM_RTOL:g}; measured "
        "<= 2e-7 dense, <= 5e-6 MoE, where one token's expert choice can flip); the grad norm "
        "catches gradient-scale bugs that AdamW hides from the loss",
    )
    p.add_argument(
        "--assert-equal",
        action="store_true",
        help="demand bitwise-equal losses and grad norms (reproducibility of one layout, e.g. --layouts fsdp=4 "
        "fsdp=4); on CUDA the runs get --training.deterministic true (CPU kernels are deterministic as they are)",
    )
    p.add_argument("--out", help="output folder (default outputs/compare_loss/<timestamp>)")
    p.add_argument("--plot", help="PNG path for the plot (default <out>/loss_comparison.png)")
    p.add_argument("--seed-checkpoint", help="reuse this seed checkpoint (a step-0 folder) instead of creating one")
    p.add_argument("--timeout", type=float, default=0, help="seconds after which a run is killed (default: none)")
    p.add_argument(
        "--comm-mode",
        choices=("default", "local_tensor"),
        default="default",
        help="default: each layout on real processes (torchrun); local_tensor: each layout's ranks "
        "simulated in one process with real values (comm.mode = local_tensor; no pp)",
    )
    p.add_argument(
        "--launcher",
        choices=LAUNCHERS,
        default="torchrun",
        help="how each layout's ranks start on this host: torchrun (default), or fork: forked from "
        "one server process that imported torch and the trainer once (bitwise the torchrun "
        "results, ~1.5 CPU s less per rank; --diagnose's gradient dumps too; not with --comm-mode local_tensor)",
    )
    p.add_argument(
        "--diagnose",
        nargs="?",
        const="diverged",
        choices=("diverged", "all"),
        help="after the comparison, dump per-parameter gradients of the baseline and of each "
        "diverged layout ('all': every layout) and list the parameters that differ most",
    )
    p.add_argument(
        "--diagnose-step",
        type=int,
        default=1,
        help="step whose gradients --diagnose compares (default 1: identical weights and data, so "
        "any difference is the layout's math; a later step, e.g. the first one beyond "
        "tolerance, retraces the compared runs exactly up to there)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    args = build_parser().parse_args(argv)
    # a fork server this process had before the tool started is its caller's: left running
    callers_server = runner.fork_server_running()
    try:
        plan, layouts, baseline = _prepare(args, extra)
    except ValueError as exc:  # UsageError and the config's ConfigError: before anything runs or is written
        return report_user_error(exc)

    try:
        return _compare(args, plan, layouts, baseline)
    except KeyboardInterrupt:  # run_streaming (run_forked_streaming) has already stopped the running job
        print("\ninterrupted", file=sys.stderr)
        return 130
    finally:
        if plan.launcher == "fork" and not callers_server:
            runner.stop_fork_server()


def _prepare(args: argparse.Namespace, extra: list[str]) -> tuple[Plan, list[Layout], Layout]:
    """Every check that needs no run: the layouts, the overrides, the config, the folders."""
    if args.steps < 1:
        raise UsageError(f"--steps must be >= 1, got {args.steps}")
    if not 1 <= args.diagnose_step <= args.steps:
        raise UsageError(f"--diagnose-step must be between 1 and --steps ({args.steps}), got {args.diagnose_step}")
    if args.diagnose and args.comm_mode == "local_tensor":
        raise UsageError(
            "--diagnose dumps gradients from real processes (torchrun or --launcher fork); drop "
            "--comm-mode local_tensor to diagnose"
        )
    if args.launcher == "fork" and args.comm_mode == "local_tensor":
        raise UsageError(
            "--launcher fork starts each layout's ranks as real processes; --comm-mode local_tensor runs "
            "them all in one process with no launcher: drop one of the two"
        )
    layouts = parse_layouts(args.layouts)
    baseline = pick_baseline(layouts, args.baseline)
    check_extra_overrides(extra)
    from trainer.config import resolve_config_path

    config = os.path.abspath(resolve_config_path(args.config))
    out = os.path.abspath(args.out or os.path.join("outputs", "compare_loss", time.strftime("%Y%m%d-%H%M%S")))
    if os.path.isdir(out) and os.listdir(out):
        # runs append to metrics.jsonl: an old run's records must not mix with new ones
        raise UsageError(f"--out {out} already holds files; pick a new folder or delete it")
    if os.path.exists(out) and not os.path.isdir(out):
        raise UsageError(f"--out {out} is a file, not a folder; pick a new folder")
    probe = out
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe) or not os.access(probe, os.W_OK | os.X_OK):
        raise UsageError(f"--out {out} cannot be created ({probe} is not a writable folder); pick another folder")
    if args.seed_checkpoint and not os.path.isdir(args.seed_checkpoint):
        raise UsageError(f"--seed-checkpoint {args.seed_checkpoint} is not a folder")
    seed = (
        os.path.abspath(args.seed_checkpoint)
        if args.seed_checkpoint
        else os.path.join(out, "seed", "checkpoint", "step-0")
    )
    if args.assert_equal:
        extra = deterministic_overrides(config, extra, run_device_type())
    plan = Plan(
        config=config,
        steps=args.steps,
        out=out,
        extra=extra,
        seed_checkpoint=seed,
        comm_mode=args.comm_mode,
        launcher=args.launcher,
    )
    preflight(plan, layouts)
    return plan, layouts, baseline


def run_device_type() -> str:
    """The device the runs will train on: train.py's own choice (``default_device_type``, cuda
    when a GPU is visible), made on this machine, where torchrun starts them."""
    from parallel_dims import default_device_type

    return default_device_type()


def deterministic_overrides(config: str, extra: list[str], device_type: str) -> list[str]:
    """``--assert-equal``'s claim, bitwise-equal repeats, holds on CPU as it is (its kernels are
    deterministic run to run) but on CUDA only with deterministic kernels: there the runs get
    ``--training.deterministic true`` (unless the config or the overrides already set it), and an
    explicit ``--training.deterministic false`` after ``--`` is refused (UsageError, exit 2)."""
    if device_type != "cuda":
        return extra
    from trainer.config import load_config

    explicit = any(arg[2:].partition("=")[0] == "training.deterministic" for arg in extra if arg.startswith("--"))
    if load_config(["--config", config, *extra]).training.deterministic:
        return extra
    if explicit:
        raise UsageError(
            "--assert-equal on CUDA demands bitwise-equal runs, which needs deterministic kernels "
            "(atomics in index_add, gather/index_select backward and attention backward differ run to "
            "run); remove '--training.deterministic false' after '--' (the tool then sets it true)"
        )
    print(
        "compare_loss: --assert-equal on CUDA: every run gets --training.deterministic true "
        "(deterministic kernels; slower)"
    )
    return [*extra, "--training.deterministic", "true"]


def _compare(args: argparse.Namespace, plan: Plan, layouts: list[Layout], baseline: Layout) -> int:
    out, extra, seed = plan.out, plan.extra, plan.seed_checkpoint
    timeout = args.timeout or None
    os.makedirs(out, exist_ok=True)
    launched = ", ranks forked (--launcher fork)" if plan.launcher == "fork" else ""
    print(
        f"compare_loss: {len(layouts)} layouts x {args.steps} steps, baseline {baseline.name}{launched}, output {out}"
    )
    for layout in layouts:
        print(f"  {layout.name:<28} {layout.describe()}")
    if not args.seed_checkpoint:
        runner.create_seed_checkpoint(plan, timeout)
    results = runner.run_layouts(plan, layouts, timeout)
    base_result = results[layouts.index(baseline)]
    rows = summarize(
        results,
        base_result,
        rtol=args.rtol,
        atol=args.atol,
        grad_norm_rtol=args.grad_norm_rtol,
        exact=args.assert_equal,
        steps=args.steps,
    )

    tol = (
        "bitwise equality (--assert-equal)"
        if args.assert_equal
        else (
            f"|dloss| <= {args.atol:g} + {args.rtol:g}*|loss|, |dgrad_norm| <= {args.atol:g} + "
            f"{args.grad_norm_rtol:g}*|grad_norm|"
        )
    )
    print(f"\nloss vs baseline {baseline.name} over {args.steps} steps; tolerance: {tol}")
    print(format_table(rows))
    if base_result.validation:
        print(
            f"validation loss (columns 'val rel', 'val >tol') compared at steps {sorted(base_result.validation)} "
            "by the same loss tolerance"
        )
    plot_path = os.path.abspath(args.plot or os.path.join(out, "loss_comparison.png"))
    plotted = [(r.layout.name, r.records) for r in results if r.records]
    if base_result.records:
        plot_runs(plot_path, plotted, baseline.name, args.rtol, args.atol, exact=args.assert_equal)
        print(f"plot: {plot_path}")
    summary_path = write_summary(
        out,
        config=plan.config,
        steps=args.steps,
        baseline=baseline.name,
        rtol=args.rtol,
        atol=args.atol,
        grad_norm_rtol=args.grad_norm_rtol,
        assert_equal=args.assert_equal,
        extra_overrides=extra,
        seed_checkpoint=seed,
        rows=rows,
    )
    print(f"summary: {summary_path}")

    if args.diagnose and base_result.ok:
        wanted = [
            r.layout
            for r, row in zip(results, rows)
            if r is not base_result and r.ok and (args.diagnose == "all" or row["status"] != "ok")
        ]
        if wanted:
            diagnose(plan, baseline, wanted, args.diagnose_step, timeout)
        else:
            print("diagnose: every layout is within tolerance; use --diagnose all to compare gradients anyway")
    ok = passed(rows)
    print("PASS: every layout matches the baseline" if ok else "FAIL: see the status column")
    return 0 if ok else 1
