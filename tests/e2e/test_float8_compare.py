"""Tier 3: float8 training (``--model.converters float8``, tensorwise recipe) gives the same
loss curve under the layouts of docs/compare_loss.md as on one process, within a float8-sized
tolerance, and the layouts whose float8 scales are all the single process's agree at fp32
round-off on the first step.

Why two levels. A tensorwise scale is ``fp8_max / amax`` of one operand:

* weights: torchao takes the amax of a DTensor weight (TP) over all its shards, and FSDP
  all-gathers before the cast (or, with float8 all-gather, all-reduces the amax over the FSDP
  mesh): the scale is the single process's, bit for bit (tests/distributed/test_float8_layouts.py);
* activations and output gradients: the amax of the tensor THIS RANK holds. Under fsdp /
  dp_replicate each rank holds ``local_batch_size`` samples, exactly the samples of one of the
  single process's gradient-accumulation micro-batches (same local batch 2), so the scales are
  the same; under TP the colwise inputs are all-gathered (sequence parallel) and the rowwise
  inputs and colwise output grads are DTensors whose amax torchao reduces over the shards. But
  under cp a rank holds half of each sequence, and under pp a micro-batch is 1 sample
  (``pipeline_parallel_microbatches`` = pp = 2): a smaller tensor, a smaller amax, other
  float8 roundings.

So at step 1 (same seed weights) fsdp, dp_replicate and tp layouts differ from the single
process by fp32 summation order only, cp and pp by float8 rounding. From step 2 on, the fp32
round-off in the updated weights moves some elements across a float8 rounding boundary (one
e4m3 step is 6-12% of the value), and every layout drifts at the float8 level.

Measured (CPU, 2 shared cores, seq_len 64, global batch 8, local batch 2, 6 blocks, max
relative gap to the single-process float8 run, loss / grad norm; "3 steps" is this test's run,
the others ran 10 / 5 steps, whose longer learning-rate schedule gives other trajectories). The
step-1 and "3 steps (here)" columns were re-measured at issue 37 (forked ranks, which give the
torchrun runs' metrics bit for bit: checked on single, fsdp=4 and cp=2 x fsdp=2); the 10-step
column and the 5-step deepseek_v3 figures below are the earlier measurements, not re-run:

==============================  ===============  ===============  ===============
layout (tensorwise)             step 1           3 steps (here)   10 steps
==============================  ===============  ===============  ===============
llama3 fsdp=4                   0 / 0            0 / 8.8e-8       4.9e-5 / 1.6e-4
llama3 tp=2,fsdp=2              1.2e-7 / 0       1.0e-6 / 1.9e-5  2.5e-5 / 1.7e-4
llama3 dp_replicate=2,fsdp=2    0 / 0            0 / 0            4.0e-5 / 2.0e-4
llama3 cp=2,fsdp=2              2.9e-6 / 3.3e-5  5.1e-6 / 3.6e-5  2.0e-4 / 5.8e-4
llama3 pp=2,fsdp=2              2.5e-6 / 8.0e-5  4.2e-5 / 8.0e-5  1.1e-4 / 4.6e-4
no float8, one process          2.2e-5 / 8.9e-4  2.3e-4 / 1.5e-3  1.0e-3 / 3.2e-3
==============================  ===============  ===============  ===============

deepseek_v3, float8 linears only (5 steps, step 1 | max): fsdp=4, fsdp=4 x ep=2 and dp_replicate=2 x fsdp=2 x ep=2
0 / 0 | <= 3.0e-5 / 9.1e-5; fsdp=2 x cp=2 x ep=4 8.9e-6 / 7.5e-5 | 6.7e-5 / 3.7e-4; pp=2 x
fsdp=2 x ep=2 4.5e-6 / 1.6e-4 | 7.6e-5 / 2.7e-4; fsdp=2 x tp=2 x ep=2 x etp=2 0 / 1.6e-6 |
1.7e-5 / 7.1e-5 (forward identical; in backward MLA's replicated low-rank projections quantize
this tp rank's PARTIAL output gradient, summed over tp only afterwards).

deepseek_v3 with float8 linears AND routed experts (``float8,float8_experts``, 5 steps, step 1 |
max): fsdp=4, fsdp=4 x ep=2 and dp_replicate=2 x fsdp=2 x ep=2 0 / 0 | <= 3.0e-5 / 6.6e-5;
fsdp=2 x tp=2 x ep=2 x etp=2 1.1e-6 / 3.2e-6 | 4.5e-5 / 1.6e-4; fsdp=2 x cp=2 x ep=4 6.2e-6 /
3.8e-5 | 1.2e-4 / 2.3e-4; pp=2 x fsdp=2 x ep=2 3.8e-6 / 1.2e-4 | 4.2e-5 / 2.1e-4. The same 5
steps with the experts in the parameter dtype are 1.5e-4 / 1.5e-4 from the experts run, and
without float8 at all 5.0e-4 / 2.2e-3: after a few steps float8 layouts drift apart by about
as much as the experts' own float8 rounding moves the curve, so only step 1 tells them apart.
Run here, 2 steps, with the experts: single, fsdp=4 x ep=2, fsdp=2 x tp=2 x ep=2 x etp=2 and
fsdp=2 x cp=2 x ep=4 (the tests' docstrings have the figures); the rest of the matrix repeats
the llama3 mechanisms (fsdp, hsdp, pp) at 5x the cost.

The rowwise recipe (not run here; llama3, 10 steps, step 1 | max) is not fully token-local
either: fsdp=4 and dp_replicate=2 x fsdp=2 1.2e-7 / 0 | <= 2.7e-5 / 8.6e-5; cp=2 x fsdp=2
0 / 8.3e-7 | 2.8e-5 / 1.7e-4 and pp=2 x fsdp=2 0 / 7.4e-7 | 2.0e-5 / 1.6e-4 (forward identical,
but the grad-weight GEMM contracts over tokens and scales its operands along them, so its
scales see only the local tokens); tp=2 x fsdp=2 9.4e-7 / 4.1e-6 | 4.9e-5 / 1.3e-4 (torchao's
rowwise GEMM returns bf16 for a float32 output, so each tp rank rounds its PARTIAL row-wise
product to bf16 before the sum).

Tolerances, from this test's run. Every step of every layout within ``F8_RTOL`` = 1e-4 (loss)
and ``F8_GNORM_RTOL`` = 3.5e-4 (grad norm): 2.4x and 4.4x the largest gaps (4.2e-5, 8.0e-5,
both pp). The scale-equal layouts at step 1 within ``STEP1_RTOL`` = 1e-6 (8x the 1.2e-7
measured, one fp32 ulp of the loss), and cp / pp at step 1 NOT within it (their per-rank
scales must be visible: measured 33x and 80x above it in the grad norm). Negative control: the
same single-process run without float8 (fp32 GEMMs) is beyond both float8 tolerances (2.3x
and 4.3x) and 890x beyond ``STEP1_RTOL`` in its step-1 grad norm. The margins are thin by
nature: float8 layouts drift apart at the float8 level (fp32 round-off in the updated weights
flips float8 roundings, one e4m3 step being 6-12% of a value), so after step 1 a layout is
only 5-10x closer to the single float8 run than fp32 training is; the step-1 checks are the
sharp ones. All figures are CPU ones (deterministic kernels); another CPU may draw other
roundings and need a re-measurement.

Cost, and why the shapes are NOT smaller (issue 37). Both comparisons run with ``compare_loss
--launcher fork`` (each layout's ranks forked from a server that imported torch once, instead of
a torchrun launch per layout; bitwise the same metrics) and the controls on forked ranks
(helpers.run_forked): about 52 CPU s each on 2 cores (34 s wall), from 100 and 77 under
torchrun. The llama3 matrix runs as three launches, each a test (as one it took up to 61 s on
a loaded host, over the 60 s budget; the three scale-equal layouts with the control 90 s in a
fresh-clone run on the Intel AMX host): fsdp and dp_replicate x fsdp with the control, tp x
fsdp alone (its float8 casts all-reduce their amax over tp: about as costly as the other two),
cp and pp; all from one seed checkpoint and judged against one single-process run, a module
fixture's (issue 49: each launch made its own before, bitwise the same; the tool's own verdict
in a launch is then against the launch's first layout, at twice the float8 tolerances, and the
test's against the single process). The deepseek_v3 matrix runs as three tests sharing one
launch's seed checkpoint and single-process run (a module fixture, with fsdp x ep): its tp x ep
x etp layout alone took 74 s of the 139 s one launch took on the loaded Intel AMX host (most of
it DTensor's first-step sharding propagation for the float8 subclasses over that mesh, measured
with cProfile), and single, ep and cp x ep 64 s in a fresh-clone run there, so cp x ep and tp x
ep x etp are each judged in a test of their own. The
models keep their 6 blocks because fewer blocks break the margins above, which
come from the float8 roundings of every block: measured with 2 blocks, llama3's run without
float8 is only 1.2x / 1.7x beyond the float8 tolerances (stated: 2.3x / 4.3x); deepseek_v3's
cp x ep is 1.2x ``STEP1_RTOL`` at step 1 (38x with 6 blocks) and its linears-only control 14x
(25x); with 4 blocks that control is 8.9x, under the 10x the test asserts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.helpers import read_metrics, run_compare_loss, run_forked
from tests.e2e.test_compare_loss import TINY, _explain

STEPS = 3
F8 = ["--model.converters", "float8"]
F8_RTOL, F8_GNORM_RTOL = 1e-4, 3.5e-4
STEP1_RTOL = 1e-6
# every float8 scale is the single process's at step 1: only fp32 summation order differs
SCALE_EQUAL = ["fsdp=4", "tp=2,fsdp=2", "dp_replicate=2,fsdp=2"]
SCALE_EQUAL_DP, SCALE_EQUAL_TP = ["fsdp=4", "dp_replicate=2,fsdp=2"], ["tp=2,fsdp=2"]  # two tests (below)
# tensorwise activation / grad-output scales per rank's local tokens (cp) or micro-batch (pp)
SCALE_LOCAL = ["cp=2,fsdp=2", "pp=2,fsdp=2"]


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def _compare(
    model: str,
    steps: int,
    layouts: list[str],
    out: Path,
    converters=F8,
    seed: Path | None = None,
    tool_rtol: tuple[float, float] = (F8_RTOL, F8_GNORM_RTOL),
) -> tuple[dict, dict]:
    """The comparison tool over ``layouts`` with float8 on and the float8 tolerances (``tool_rtol``:
    loss, grad norm; from ``seed``, a step-0 folder, if given); its summary and every run's
    metrics by layout, after checking it passed with every layout."""
    proc = run_compare_loss(
        *("--config", f"train_configs/{model}.toml", "--steps", str(steps), "--out", str(out)),
        *("--rtol", str(tool_rtol[0]), "--grad-norm-rtol", str(tool_rtol[1])),
        *("--timeout", "300", "--launcher", "fork"),
        *(("--seed-checkpoint", str(seed)) if seed else ()),
        *("--layouts", *layouts, "--", *TINY, *converters),
    )
    assert proc.returncode == 0, _explain(proc)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["passed"] and [r["layout"] for r in summary["runs"]] == layouts
    runs = {r["layout"]: read_metrics(r["folder"]) for r in summary["runs"]}
    assert sorted(runs[layouts[0]]) == list(range(1, steps + 1))
    return summary, runs


@pytest.fixture(scope="module")
def llama3_single(tmp_path_factory):
    """The reference both llama3 layout classes are judged against, made once: the comparison
    tool's seed checkpoint and its single-process float8 run (``--layouts single``; before issue
    49 each class's launch made its own, the same seed and bitwise the same metrics). The seed
    folder and the single run's metrics."""
    out = tmp_path_factory.mktemp("llama3") / "cmp"
    summary, runs = _compare("llama3", STEPS, ["single"], out)
    folder = summary["runs"][0]["folder"]
    log = (Path(folder) / "train.log").read_text()
    assert "float8: recipe tensorwise" in log and "linear layers in float8" in log
    return out / "seed" / "checkpoint" / "step-0", runs["single"]


def _llama3_float8_layouts(tmp_path, layouts: list[str], reference: tuple) -> dict:
    """The llama3 matrix over ``layouts``, from the reference's seed checkpoint: every step of
    every layout within the float8 tolerances OF THE SINGLE PROCESS (judged here by the tool's
    own rule, ``tools.compare_loss.compare.compare``, as the tool judges a layout against its
    baseline), the step-1 checks of each layout's class; the single run's metrics.

    The tool itself runs the class's layouts alone (their ranks forked), so its own verdict is
    against the class's first layout: there it gets twice the float8 tolerances, which two
    layouts each within them of the single process cannot exceed (up to the tiny difference of
    relative to which loss); the verdict that is this test's claim is the one against the single
    process, below."""
    from tools.compare_loss.compare import DEFAULT_ATOL, compare

    seed, base = reference
    summary, runs = _compare(
        "llama3", STEPS, layouts, tmp_path / "cmp", seed=seed, tool_rtol=(2 * F8_RTOL, 2 * F8_GNORM_RTOL)
    )
    for run in summary["runs"]:
        log = (Path(run["folder"]) / "train.log").read_text()
        assert "float8: recipe tensorwise" in log and "linear layers in float8" in log, run["layout"]
        metrics = runs[run["layout"]]
        judged = compare(
            base, metrics, rtol=F8_RTOL, atol=DEFAULT_ATOL, grad_norm_rtol=F8_GNORM_RTOL, expected_steps=STEPS
        )
        step1 = metrics[1]
        gaps = (_rel(step1["loss"], base[1]["loss"]), _rel(step1["grad_norm"], base[1]["grad_norm"]))
        print(
            f"{run['layout']:<16} step 1 rel gap loss {gaps[0]:.1e} grad norm {gaps[1]:.1e}; steps 1-{STEPS} "
            f"max {judged.max_rel:.1e} / {judged.grad_norm_max_rel:.1e}; wall {run['wall_s']:.0f}s"
        )
        assert judged.within and judged.steps == list(range(1, STEPS + 1)), (run["layout"], judged)
        if run["layout"] in SCALE_EQUAL:
            assert max(gaps) <= STEP1_RTOL, (run["layout"], gaps)
        elif run["layout"] in SCALE_LOCAL:
            assert gaps[1] > STEP1_RTOL, (run["layout"], gaps)
    return base


# The llama3 matrix in three launches, all from the one seed checkpoint and judged against the one
# single-process run of the module fixture above: one launch of all six took 55-61 s on a loaded
# 2-core host, at the 60 s per-test budget, and the three scale-equal layouts with the control
# 90 s in a fresh-clone run on the Intel AMX host (tp x fsdp, whose float8 casts all-reduce
# their amax over tp, costs about as much as the other two together).
def test_llama3_float8_scale_equal_layouts_agree(tmp_path, llama3_single):
    """fsdp, dp_replicate x fsdp: within the float8 tolerances at every step and at fp32
    round-off at step 1 (tp x fsdp, the third scale-equal layout: the next test); the negative
    control (one process without float8) beyond both."""
    base = _llama3_float8_layouts(tmp_path, SCALE_EQUAL_DP, llama3_single)

    # negative control: one process without float8, from the same seed checkpoint
    seed = llama3_single[0]
    folder = tmp_path / "no_float8"
    plain = run_forked(
        1,
        *("--config", "train_configs/llama3.toml", "--training.steps", str(STEPS), "--metrics.log_freq", "1"),
        *("--metrics.enable_jsonl", "true", "--checkpoint.enable", "false"),
        *("--checkpoint.initial_load_path", str(seed), "--job.dump_folder", str(folder), *TINY),
        timeout=300,
    )
    assert plain.returncode == 0, plain.stdout[-3000:] + plain.stderr[-3000:]
    fp32 = read_metrics(folder)
    loss_gap = max(_rel(fp32[s]["loss"], base[s]["loss"]) for s in base)
    norm_gap = max(_rel(fp32[s]["grad_norm"], base[s]["grad_norm"]) for s in base)
    step1 = (_rel(fp32[1]["loss"], base[1]["loss"]), _rel(fp32[1]["grad_norm"], base[1]["grad_norm"]))
    print(
        f"no float8 vs float8, one process: max rel gap loss {loss_gap:.1e} grad norm {norm_gap:.1e}; "
        f"step 1 {step1[0]:.1e} / {step1[1]:.1e}"
    )
    assert loss_gap > F8_RTOL and norm_gap > F8_GNORM_RTOL, (loss_gap, norm_gap)
    assert _rel(fp32[1]["grad_norm"], base[1]["grad_norm"]) > 100 * STEP1_RTOL


def test_llama3_float8_scale_equal_tp_layout_agrees(tmp_path, llama3_single):
    """tp x fsdp: within the float8 tolerances at every step and at fp32 round-off at step 1
    (its weights' and sequence-parallel activations' amax reduced over the tp shards; the
    negative control of this class: the previous test)."""
    _llama3_float8_layouts(tmp_path, SCALE_EQUAL_TP, llama3_single)


def test_llama3_float8_scale_local_layouts_agree(tmp_path, llama3_single):
    """cp x fsdp, pp x fsdp: within the float8 tolerances at every step, and visibly not at
    fp32 round-off at step 1 (their activation and grad-output scales see local tokens)."""
    _llama3_float8_layouts(tmp_path, SCALE_LOCAL, llama3_single)


DEEPSEEK_STEPS = 2
DEEPSEEK_LAYOUTS = ["single", "fsdp=4,ep=2"]
CP_EP = "fsdp=2,cp=2,ep=4"
ETP = "fsdp=2,tp=2,ep=2,etp=2"
# the float8 routed experts too (rowwise grouped GEMMs), as torchtitan's DeepSeek float8 runs them
F8_EXPERTS = ["--model.converters", "float8,float8_experts"]


def _deepseek_gaps(layout: str, folder: str, run: dict, base: dict, max_rel: tuple[float, float]) -> tuple:
    """Checks a deepseek_v3 run's log for both float8 conversions; its step-1 relative gaps
    (loss, grad norm) to the single process, printed with its maximum gaps over the steps."""
    log = (Path(folder) / "train.log").read_text()
    assert "linear layers in float8" in log and "routed-expert modules' grouped GEMMs in float8" in log, layout
    gaps = (_rel(run[1]["loss"], base[1]["loss"]), _rel(run[1]["grad_norm"], base[1]["grad_norm"]))
    print(
        f"{layout:<24} step 1 rel gap loss {gaps[0]:.1e} grad norm {gaps[1]:.1e}; steps 1-{DEEPSEEK_STEPS} "
        f"max {max_rel[0]:.1e} / {max_rel[1]:.1e}"
    )
    return gaps


@pytest.fixture(scope="module")
def deepseek_matrix(tmp_path_factory):
    """The deepseek_v3 comparison (single, ep) with float8 linears and experts: its output
    folder, summary and runs' metrics. The cp x ep and tp x ep x etp layouts run in tests of
    their own from the same seed checkpoint and are judged against this single run (one launch
    of all four took 139 s on a loaded host, and of the first three 64 s in a fresh-clone run on
    the Intel AMX host: over the 60 s per-test budget)."""
    out = tmp_path_factory.mktemp("deepseek") / "cmp"
    summary, runs = _compare("deepseek_v3", DEEPSEEK_STEPS, DEEPSEEK_LAYOUTS, out, F8_EXPERTS)
    return out, summary, runs


def _deepseek_alone(tmp_path, deepseek_matrix, layout: str) -> tuple:
    """``layout`` with float8 linears and experts, from the matrix's seed checkpoint, within the
    float8 tolerances of its single process at both steps, judged by the comparison tool's own
    rule (``tools.compare_loss.compare.compare``, the default atol) over the run the tool
    launches for it (alone, so that run is its own baseline there); its step-1 gaps."""
    from tools.compare_loss.compare import DEFAULT_ATOL, compare, load_metrics

    out, matrix, runs = deepseek_matrix
    seed = out / "seed" / "checkpoint" / "step-0"
    summary, alone = _compare("deepseek_v3", DEEPSEEK_STEPS, [layout], tmp_path / "cmp", F8_EXPERTS, seed)
    folders = [matrix["runs"][0]["folder"], summary["runs"][0]["folder"]]
    base, run = (load_metrics(str(Path(f) / "metrics.jsonl")) for f in folders)
    judged = compare(
        base, run, rtol=F8_RTOL, atol=DEFAULT_ATOL, grad_norm_rtol=F8_GNORM_RTOL, expected_steps=DEEPSEEK_STEPS
    )
    gaps = _deepseek_gaps(layout, folders[1], alone[layout], runs["single"], (judged.max_rel, judged.grad_norm_max_rel))
    assert judged.within and judged.steps == [1, 2], judged
    return gaps


def test_deepseek_v3_float8_layouts_agree(tmp_path, deepseek_matrix):
    """MoE + MLA with float8 linears AND float8 routed experts, 2 steps: ep within the float8
    tolerances (cp x ep and tp x ep x etp: the next tests). The experts' rowwise scales are per
    token (forward, input gradient) and per whole expert weight column (EP moves whole experts),
    so fsdp=4 x ep=2 is at fp32 round-off at step 1 (measured bitwise).

    Negative control for the sharp step-1 check: the single process with float8 linears only
    (experts in the parameter dtype) is 25x ``STEP1_RTOL`` away from it in the step-1 grad norm
    (measured 1.4e-6 / 2.5e-5; 1.8e-6 / 3.4e-5 on the Intel AMX host), so the fsdp=4 x ep=2
    equality shows the experts ran the same float8 GEMMs, not that they skipped float8. Measured
    over 2 steps (max loss / grad norm): fsdp=4 x ep=2 4.4e-6 / 3.5e-5 (re-measured at issue 37
    with forked ranks: every figure of this docstring the same)."""
    out, summary, runs = deepseek_matrix
    base = runs["single"]
    gaps = {}
    for run in summary["runs"]:
        max_rel = (run["max_rel_diff"], run["grad_norm_max_rel_diff"])
        gaps[run["layout"]] = _deepseek_gaps(run["layout"], run["folder"], runs[run["layout"]], base, max_rel)
    assert max(gaps["fsdp=4,ep=2"]) <= STEP1_RTOL, gaps

    folder = tmp_path / "linears_only"
    linears = run_forked(
        1,
        *("--config", "train_configs/deepseek_v3.toml", "--training.steps", "1", "--metrics.log_freq", "1"),
        *("--metrics.enable_jsonl", "true", "--checkpoint.enable", "false", "--model.converters", "float8"),
        *("--checkpoint.initial_load_path", str(out / "seed" / "checkpoint" / "step-0")),
        *("--job.dump_folder", str(folder), *TINY),
        timeout=300,
    )
    assert linears.returncode == 0, linears.stdout[-3000:] + linears.stderr[-3000:]
    control = read_metrics(folder)[1]
    gap = (_rel(control["loss"], base[1]["loss"]), _rel(control["grad_norm"], base[1]["grad_norm"]))
    print(f"float8 linears only vs with experts, one process, step 1: rel gap loss {gap[0]:.1e} grad norm {gap[1]:.1e}")
    assert gap[1] > 10 * STEP1_RTOL


def test_deepseek_v3_float8_cp_layout_agrees(tmp_path, deepseek_matrix):
    """fsdp=2 x cp=2 x ep=4 with float8 linears and experts, from the matrix's seed checkpoint:
    within the float8 tolerances of its single process at both steps, and visibly not at fp32
    round-off at step 1 (its tensorwise linears' activation scales see half of each sequence,
    as in the llama3 test). Measured over 2 steps: 6.2e-6 / 8.7e-5 (re-measured at issue 37
    with forked ranks)."""
    gaps = _deepseek_alone(tmp_path, deepseek_matrix, CP_EP)
    assert gaps[1] > STEP1_RTOL, gaps


def test_deepseek_v3_float8_etp_layout_agrees(tmp_path, deepseek_matrix):
    """fsdp=2 x tp=2 x ep=2 x etp=2 with float8 linears and experts, from the matrix's seed
    checkpoint, within the float8 tolerances of its single process at both steps (judged as the
    previous test's layout). At step 1 it sits between the two classes (measured 1.1e-6 /
    3.2e-6; 9.4e-7 / 1.2e-5 on the Intel AMX host): etp slices the experts' hidden dimension,
    which w2's GEMM contracts over, so its token and weight scales see one etp rank's slice.
    Measured over 2 steps: 5.1e-6 / 3.7e-6 (9.4e-7 / 2.4e-5 on the Intel AMX host)."""
    _deepseek_alone(tmp_path, deepseek_matrix, ETP)
