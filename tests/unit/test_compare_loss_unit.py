"""tools.compare_loss without training: layout parsing, the comparison math on synthetic
metrics.jsonl files, the verdict/exit codes of the whole CLI (with the runs faked), the plot, and
the gradient-dump comparison that --diagnose prints."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from tools.compare_loss import runner
from tools.compare_loss.cli import main
from tools.compare_loss.compare import (
    DEFAULT_RTOL,
    RunResult,
    beyond_tolerance,
    compare,
    compare_validation,
    load_metrics,
    load_validation,
    mean_tps,
    passed,
    summarize,
)
from tools.compare_loss.diagnose import compare_grad_dumps, format_grad_rows
from tools.compare_loss.layouts import (
    DEGREE_KEYS,
    UsageError,
    check_extra_overrides,
    parse_layout,
    parse_layouts,
    pick_baseline,
    slug,
)
from tools.compare_loss.report import format_table, plot_runs
from tools.compare_loss.runner import STEP_LINE, log_excerpt, run_streaming


def write_metrics(path: Path, losses, grad_norms=None, tps=1000.0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for step, loss in enumerate(losses, 1):
            gn = grad_norms[step - 1] if grad_norms is not None else 1.0
            f.write(json.dumps({"step": step, "loss": loss, "grad_norm": gn, "lr": 1e-3, "tps": tps * step}) + "\n")
    return path


def records(losses, grad_norms=None):
    return {
        s: {"step": s, "loss": l, "grad_norm": (grad_norms[s - 1] if grad_norms else 1.0), "tps": 100.0}
        for s, l in enumerate(losses, 1)
    }


# ----------------------------------------------------------------------------- layouts


@pytest.mark.parametrize(
    "text, degrees, nproc",
    [
        ("fsdp=4", dict(dp_shard=4), 4),
        ("dp_replicate=2,fsdp=2", dict(dp_replicate=2, dp_shard=2), 4),
        ("tp=2, cp=2", dict(tp=2, cp=2), 4),
        ("single", {}, 1),
        ("1", {}, 1),
        ("dp_shard=2,cp=2,ep=4", dict(dp_shard=2, cp=2, ep=4), 4),  # ep folds: no extra processes
        ("fsdp=2,tp=2,ep=2,etp=2", dict(dp_shard=2, tp=2, ep=2, etp=2), 4),
        ("nproc=8,tp=2,dp_shard=-1", dict(tp=2, dp_shard=4), 8),  # -1 inferred from nproc
        ("tensor_parallel_degree=2,data_parallel_shard_degree=2", dict(tp=2, dp_shard=2), 4),
        ("nproc=4,fsdp=4", dict(dp_shard=4), 4),
    ],
)
def test_parse_valid_layouts(text, degrees, nproc):
    layout = parse_layout(text)
    expected = {k: 1 for k in DEGREE_KEYS} | degrees
    assert layout.degrees == expected
    assert layout.nproc == nproc
    assert layout.name == text.strip()
    # every degree goes to train.py explicitly, so nothing is inherited from the TOML
    args = layout.train_args()
    assert args[::2] == [f"--parallelism.{k}" for k in DEGREE_KEYS]
    assert args[1::2] == [str(expected[k]) for k in DEGREE_KEYS]


def test_named_layout_and_duplicate_names():
    layouts = parse_layouts(["hsdp:dp_replicate=2,fsdp=2", "fsdp=4", "fsdp=4"])
    assert [l.name for l in layouts] == ["hsdp", "fsdp=4", "fsdp=4#2"]
    assert layouts[0].degrees["dp_replicate"] == 2 and layouts[0].nproc == 4
    assert pick_baseline(layouts, None) is layouts[0]
    assert pick_baseline(layouts, "fsdp=4#2") is layouts[2]
    with pytest.raises(UsageError, match=r"--baseline 'hsd' is not one of the layouts; did you mean 'hsdp'"):
        pick_baseline(layouts, "hsd")


@pytest.mark.parametrize(
    "text, pattern",
    [
        ("tpp=2", r"layout 'tpp=2': unknown key 'tpp'; did you mean 'tp'\?"),
        ("fdsp=4", r"unknown key 'fdsp'; did you mean 'fsdp'\?"),
        ("dp_replica=2,fsdp=2", r"unknown key 'dp_replica'; did you mean 'dp_replicate'\?"),
        ("tensor=2", r"unknown key 'tensor'; did you mean 'tp'\?"),
        ("zz=2", r"unknown key 'zz'; valid keys: dp_replicate, dp_shard, cp, tp, pp, ep, etp, nproc"),
        ("tp", r"'tp' is not key=value"),
        ("tp=two", r"tp='two' is not an integer"),
        ("fsdp=2,dp_shard=2", r"dp_shard is given twice"),
        ("dp_shard=-1,tp=2", r"dp_shard=-1 infers the degree from the process count; add nproc=N"),
        ("", r"is empty"),
        ("nproc=0", r"nproc=0 must be >= 1"),
    ],
)
def test_parse_rejects(text, pattern):
    with pytest.raises(UsageError, match=pattern):
        parse_layout(text)


@pytest.mark.parametrize(
    "text, pattern",
    [
        # the validate_degrees message, with the layout and its process count in front
        (
            "tp=2,nproc=8",
            r"layout 'tp=2,nproc=8' \(nproc=8\): dp_replicate\*dp_shard\*cp\*tp\*pp = 1\*1\*1\*2\*1 = 2 "
            r"!= world_size=8.*use dp_shard=4 or dp_shard=-1",
        ),
        ("fsdp=3,tp=2,nproc=4", r"dp_shard=3 does not divide world_size=4; legal dp_shard values: 1, 2, 4"),
        ("fsdp=2,ep=4", r"ep\*etp = 4\*1 = 4 does not divide dp_shard\*cp\*tp = 2\*1\*1 = 2"),
        ("tp=4,etp=2", r"etp=2 is not supported with tp=4"),
        ("tp=0", r"layout 'tp=0': tp=0 is invalid"),
        ("fsdp=-2", r"dp_shard=-2 is invalid"),
    ],
)
def test_degrees_must_fit_the_process_count(text, pattern):
    with pytest.raises(UsageError, match=pattern):
        parse_layout(text)


def test_extra_overrides_the_tool_owns_are_refused():
    check_extra_overrides(["--training.seq_len", "64", "--metrics.enable_tensorboard=false"])
    for arg, owner in [
        ("--parallelism.tp", "layout strings"),
        ("--parallelism.data_parallel_shard_degree=2", "layout strings"),
        ("--training.steps", "--steps"),
        ("--job.dump_folder", "--out"),
        ("--checkpoint.initial_load_path", "--seed-checkpoint"),
        ("--config", "compare_loss --config"),
    ]:
        with pytest.raises(UsageError, match=owner):
            check_extra_overrides([arg, "x"])


# -------------------------------------------------------------------------- comparison


def test_first_step_beyond_tolerance_and_max_differences(tmp_path):
    base = load_metrics(write_metrics(tmp_path / "a.jsonl", [8.0, 7.0, 6.0, 5.0]))
    run = load_metrics(
        write_metrics(tmp_path / "b.jsonl", [8.0, 7.0 + 5e-6, 6.0 + 1e-4, 5.0 - 2e-4], grad_norms=[1.0, 1.0, 1.1, 1.0])
    )
    cmp = compare(base, run, rtol=1e-5, atol=1e-5, expected_steps=4)
    assert cmp.first_beyond == 3  # 5e-6 < 1e-5 + 7e-5; 1e-4 > 1e-5 + 6e-5
    assert cmp.first_beyond_metric == "loss"  # the grad norm is off at step 3 too; the loss is named
    assert cmp.max_abs == pytest.approx(2e-4, rel=1e-6)
    assert cmp.max_rel == pytest.approx(2e-4 / 5.0, rel=1e-6)
    assert cmp.grad_norm_max_rel == pytest.approx(0.1)
    assert not cmp.within
    loose = compare(base, run, rtol=0.2, atol=0.0, expected_steps=4)
    assert loose.first_beyond is None and loose.within  # 2e-4 <= 0.2 * 5.0 and 0.1 <= 0.2 * 1.0


def test_grad_norm_is_part_of_the_verdict(tmp_path):
    """Equal losses but a grad norm off from step 2 (what a gradient-scale bug under AdamW
    looks like) is a divergence, reported as such in the table."""
    base = _result(tmp_path, "fsdp=4", [8.0, 7.0, 6.0], grad_norms=[1.0, 1.0, 1.0])
    off = _result(tmp_path, "fsdp=2,ep=2", [8.0, 7.0, 6.0], grad_norms=[1.0, 1.5, 1.0])
    cmp = compare(base.records, off.records, rtol=1e-5, atol=1e-5)
    assert (cmp.first_beyond, cmp.first_beyond_metric, cmp.max_abs) == (2, "grad_norm", 0.0)
    rows = summarize([base, off], base, rtol=1e-5, atol=1e-5, exact=False, steps=3)
    assert rows[1]["status"] == "DIVERGED" and rows[1]["grad_norm_max_rel_diff"] == pytest.approx(0.5)
    assert "2 (gnorm)" in format_table(rows).splitlines()[3]
    # the grad norm has its own relative tolerance (default 1e-4: MoE re-routing moves it more)
    near = records([8.0, 7.0, 6.0], [1.0, 1.0 + 5e-5, 1.0])
    assert compare(base.records, near, rtol=1e-5, atol=0.0).first_beyond == 2  # defaults to rtol
    assert compare(base.records, near, rtol=1e-5, atol=0.0, grad_norm_rtol=1e-4).within


def test_tolerance_rule_is_relative_to_the_baseline():
    assert not beyond_tolerance(10.0 + 1e-4, 10.0, rtol=1e-5, atol=0.0)
    assert beyond_tolerance(10.0 + 1.1e-4, 10.0, rtol=1e-5, atol=0.0)
    assert beyond_tolerance(float("nan"), 10.0, rtol=1.0, atol=1.0)
    assert beyond_tolerance(10.0, float("inf"), rtol=1.0, atol=1.0)


def test_exact_mode_demands_bitwise_equal_loss_and_grad_norm():
    base = records([8.0, 7.0, 6.0], [1.0, 2.0, 3.0])
    assert compare(base, records([8.0, 7.0, 6.0], [1.0, 2.0, 3.0]), rtol=0, atol=0, exact=True).within
    # one ulp in the loss at step 2
    off = records([8.0, math.nextafter(7.0, 8.0), 6.0], [1.0, 2.0, 3.0])
    assert compare(base, off, rtol=1e-3, atol=1e-3, exact=True).first_beyond == 2
    # equal losses, a grad norm off at step 3
    gn = records([8.0, 7.0, 6.0], [1.0, 2.0, 3.0000001])
    assert compare(base, gn, rtol=1e-3, atol=1e-3, exact=True).first_beyond == 3
    assert compare(base, gn, rtol=1e-3, atol=1e-3, exact=False).first_beyond is None
    assert compare(base, gn, rtol=0.0, atol=0.0, exact=False).first_beyond_metric == "grad_norm"


def test_nan_loss_is_beyond_and_missing_steps_fail(tmp_path):
    base = records([8.0, 7.0, 6.0])
    path = tmp_path / "nan.jsonl"
    path.write_text(
        '{"step": 1, "loss": 8.0, "grad_norm": 1.0}\n{"step": 2, "loss": null, "grad_norm": null}\n'
        '{"step": 3, "loss": 6.0, "gr'
    )  # killed mid-line: the partial record is skipped
    run = load_metrics(path)
    assert sorted(run) == [1, 2]
    cmp = compare(base, run, rtol=1e-5, atol=1e-5, expected_steps=3)
    assert cmp.first_beyond == 2 and math.isinf(cmp.max_abs)
    assert cmp.missing_steps == [3] and not cmp.within


def test_mean_tps_skips_the_warmup_step():
    recs = {1: {"tps": 1.0}, 2: {"tps": 100.0}, 3: {"tps": 200.0}}
    assert mean_tps(recs) == 150.0
    assert mean_tps({1: {"tps": 5.0}}) is None


def _result(tmp_path, name, losses, rc=0, grad_norms=None):
    layout = parse_layout(name)
    folder = tmp_path / slug(name)
    write_metrics(folder / "metrics.jsonl", losses, grad_norms)
    res = RunResult(layout, str(folder), rc, 1.0, str(folder / "train.log"))
    res.records = load_metrics(str(folder / "metrics.jsonl"))
    return res


def test_summary_rows_statuses_and_table(tmp_path):
    base = _result(tmp_path, "fsdp=4", [8.0, 7.0, 6.0])
    good = _result(tmp_path, "tp=2,fsdp=2", [8.0, 7.0 + 1e-6, 6.0 - 2e-6])
    bad = _result(tmp_path, "cp=2,tp=2", [8.0, 7.01, 6.02])
    crashed = _result(tmp_path, "dp_replicate=4", [8.0], rc=1)
    rows = summarize([base, good, bad, crashed], base, rtol=1e-5, atol=1e-5, exact=False, steps=3)
    assert [r["status"] for r in rows] == ["baseline", "ok", "DIVERGED", "FAILED (exit 1)"]
    assert rows[2]["first_step_beyond"] == 2
    assert rows[2]["max_abs_diff"] == pytest.approx(0.02)
    assert rows[1]["final_loss"] == 6.0 - 2e-6
    assert not passed(rows) and passed(rows[:2])
    table = format_table(rows)
    lines = table.splitlines()
    assert lines[0].split()[:3] == ["layout", "nproc", "max|dloss|"]
    assert lines[4].startswith("cp=2,tp=2") and " 2 " in lines[4] and "DIVERGED" in lines[4]
    assert "FAILED (exit 1)" in lines[5]
    # a failed baseline leaves nothing to compare against
    rows = summarize([crashed, good], crashed, rtol=1e-5, atol=1e-5, exact=False, steps=3)
    assert [r["status"] for r in rows] == ["FAILED (exit 1)", "no baseline"] and not passed(rows)


def _with_validation(res, losses):
    """Append evaluation records (as the trainer writes them, after their step's record)."""
    path = Path(res.folder) / "metrics.jsonl"
    with open(path, "a") as f:
        for step, loss in losses.items():
            f.write(json.dumps({"step": step, "validation_loss": loss, "validation_perplexity": math.exp(loss)}) + "\n")
    res.records, res.validation = load_metrics(str(path)), load_validation(str(path))
    return res


def test_validation_curves_are_compared_with_the_loss_tolerance(tmp_path):
    base = _with_validation(_result(tmp_path, "fsdp=4", [8.0, 7.0, 6.0]), {2: 7.5, 3: 6.5})
    # the evaluation records do not replace the training records of their steps
    assert [base.records[s]["loss"] for s in (1, 2, 3)] == [8.0, 7.0, 6.0] and sorted(base.validation) == [2, 3]
    good = _with_validation(_result(tmp_path, "tp=2,fsdp=2", [8.0, 7.0, 6.0]), {2: 7.5 + 1e-6, 3: 6.5})
    bad = _with_validation(_result(tmp_path, "pp=2", [8.0, 7.0, 6.0]), {2: 7.5, 3: 6.6})  # training equal
    short = _with_validation(_result(tmp_path, "tp=2", [8.0, 7.0, 6.0]), {2: 7.5})
    rows = summarize([base, good, bad, short], base, rtol=1e-5, atol=1e-5, exact=False, steps=3)
    assert [r["status"] for r in rows] == ["baseline", "ok", "DIVERGED", "INCOMPLETE (1 evaluations missing)"]
    assert rows[1]["validation_max_rel_diff"] == pytest.approx(1e-6 / 7.5) and rows[1]["final_validation_loss"] == 6.5
    assert rows[2]["validation_first_step_beyond"] == 3 and rows[2]["first_step_beyond"] is None
    assert rows[3]["validation_missing_steps"] == [3]
    lines = format_table(rows).splitlines()
    assert "val rel" in lines[0] and "val >tol" in lines[0]
    assert lines[4].startswith("pp=2") and " 3 " in lines[4]
    cmp = compare_validation(base.validation, good.validation, rtol=0, atol=0, exact=True)
    assert cmp.first_beyond == 2 and not cmp.within
    # no validation anywhere: no validation keys, the table as before
    single = _result(tmp_path, "single", [8.0])
    plain = summarize([single], single, rtol=1e-5, atol=1e-5, exact=False, steps=1)
    assert "validation_steps" not in plain[0] and "val rel" not in format_table(plain)


def test_run_streaming_logs_and_returns_the_exit_code(tmp_path):
    lines = []
    code = (
        "import sys; print('step      1  loss   8.1005  grad_norm 1.0'); "
        "print('error: boom', file=sys.stderr); sys.exit(3)"
    )
    rc = run_streaming([sys.executable, "-c", code], str(tmp_path / "run" / "log.txt"), lines.append)
    assert rc == 3
    assert STEP_LINE.search(lines[0]).groups() == ("1", "8.1005")
    # the trainer's line with the step count
    assert STEP_LINE.search("step  7/30  loss   5.2500  grad_norm 1.0").groups() == ("7", "5.2500")
    excerpt = log_excerpt(str(tmp_path / "run" / "log.txt"))
    assert "errors:" in excerpt and "error: boom" in excerpt
    rc = run_streaming(
        [sys.executable, "-c", "import time; time.sleep(30)"], str(tmp_path / "slow.txt"), lambda line: None, timeout=1
    )
    assert rc == 124 and "--timeout" in (tmp_path / "slow.txt").read_text()


# ------------------------------------------------------------------- the CLI, runs faked


@pytest.fixture
def fake_runs(tmp_path, monkeypatch):
    """Replace the torchrun launches by synthetic metrics: layout name -> losses."""
    losses: dict[str, list[float]] = {}

    def run_layouts(plan, layouts, timeout):
        results = []
        for i, layout in enumerate(layouts, 1):
            folder = Path(plan.run_folder(i, layout))
            write_metrics(folder / "metrics.jsonl", losses[layout.name])
            res = RunResult(layout, str(folder), 0, 0.1, str(folder / "train.log"))
            res.records = load_metrics(str(folder / "metrics.jsonl"))
            results.append(res)
        return results

    monkeypatch.setattr(runner, "run_layouts", run_layouts)
    seed = tmp_path / "seed"
    seed.mkdir()
    return losses, seed


def _main(out, seed, *args):
    return main(
        [
            "--config",
            "llama3",
            "--steps",
            "3",
            "--out",
            str(out),
            "--seed-checkpoint",
            str(seed),
            *args,
            "--",
            "--training.seq_len",
            "64",
        ]
    )


def test_cli_exit_codes(tmp_path, fake_runs, capsys):
    losses, seed = fake_runs
    losses.update({"fsdp=4": [8.0, 7.0, 6.0], "tp=2,fsdp=2": [8.0, 7.0 + 1e-6, 6.0], "cp=2,tp=2": [8.0, 7.0, 6.1]})
    out = tmp_path / "pass"
    assert _main(out, seed, "--layouts", "fsdp=4", "tp=2,fsdp=2") == 0
    printed = capsys.readouterr().out
    assert "PASS" in printed and "tp=2,fsdp=2" in printed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["passed"] and summary["rtol"] == DEFAULT_RTOL
    assert summary["extra_overrides"] == ["--training.seq_len", "64"]
    assert (out / "loss_comparison.png").stat().st_size > 0
    # an output folder that already holds runs is refused (metrics.jsonl would mix old and new records)
    assert _main(out, seed, "--layouts", "fsdp=4") == 2
    assert "already holds files" in capsys.readouterr().err

    assert _main(tmp_path / "fail", seed, "--layouts", "fsdp=4", "tp=2,fsdp=2", "cp=2,tp=2") == 1
    assert "FAIL" in capsys.readouterr().out
    # --baseline: compared against cp=2,tp=2 the other layout is off
    assert _main(tmp_path / "baseline", seed, "--layouts", "fsdp=4", "cp=2,tp=2", "--baseline", "cp=2,tp=2") == 1
    # --assert-equal: a 1e-6 difference fails, a bitwise repeat passes
    assert _main(tmp_path / "eq1", seed, "--assert-equal", "--layouts", "fsdp=4", "tp=2,fsdp=2") == 1
    losses["fsdp=4#2"] = list(losses["fsdp=4"])
    assert _main(tmp_path / "eq2", seed, "--assert-equal", "--layouts", "fsdp=4", "fsdp=4") == 0


@pytest.fixture
def recorded_runs(tmp_path, fake_runs, monkeypatch):
    """fake_runs, keeping each run's train.py overrides (plan.extra: what torchrun would pass)."""
    losses, seed = fake_runs
    fake = runner.run_layouts
    extras: list[list[str]] = []

    def run_layouts(plan, layouts, timeout):
        extras.append(list(plan.extra))
        return fake(plan, layouts, timeout)

    monkeypatch.setattr(runner, "run_layouts", run_layouts)
    losses.update({"fsdp=4": [8.0, 7.0, 6.0], "fsdp=4#2": [8.0, 7.0, 6.0]})
    return seed, extras


def _fake_cuda(monkeypatch):
    """The device train.py would pick (parallel_dims.default_device_type) reads CUDA as present."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def test_assert_equal_on_cuda_runs_with_deterministic_kernels(tmp_path, recorded_runs, monkeypatch, capsys):
    seed, extras = recorded_runs
    _fake_cuda(monkeypatch)
    assert _main(tmp_path / "eq", seed, "--assert-equal", "--layouts", "fsdp=4", "fsdp=4") == 0
    assert extras[-1] == ["--training.seq_len", "64", "--training.deterministic", "true"]
    assert "every run gets --training.deterministic true" in capsys.readouterr().out
    summary = json.loads((tmp_path / "eq" / "summary.json").read_text())
    assert summary["extra_overrides"][-2:] == ["--training.deterministic", "true"]  # recorded with the runs
    # already deterministic (here by the overrides): nothing added
    argv = ["--config", "llama3", "--steps", "3", "--out", str(tmp_path / "eq2"), "--seed-checkpoint", str(seed)]
    assert main([*argv, "--assert-equal", "--layouts", "fsdp=4", "fsdp=4", "--", "--training.deterministic"]) == 0
    assert extras[-1] == ["--training.deterministic"]
    # a comparison within tolerances needs no bitwise equality: nothing added on CUDA either
    assert _main(tmp_path / "tol", seed, "--layouts", "fsdp=4", "fsdp=4") == 0
    assert extras[-1] == ["--training.seq_len", "64"]


def test_assert_equal_on_cuda_refuses_nondeterministic_kernels(tmp_path, recorded_runs, monkeypatch, capsys):
    seed, extras = recorded_runs
    _fake_cuda(monkeypatch)
    argv = ["--config", "llama3", "--out", str(tmp_path / "out"), "--seed-checkpoint", str(seed), "--assert-equal"]
    for off in (["--training.deterministic", "false"], ["--training.deterministic=false"]):
        assert main([*argv, "--layouts", "fsdp=4", "fsdp=4", "--", *off]) == 2
        err = capsys.readouterr().err
        assert "--assert-equal on CUDA" in err and "remove '--training.deterministic false'" in err
    assert extras == [] and not (tmp_path / "out").exists()  # refused before anything ran


def test_assert_equal_on_cpu_changes_nothing(tmp_path, recorded_runs, monkeypatch):
    import torch

    seed, extras = recorded_runs
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _main(tmp_path / "eq", seed, "--assert-equal", "--layouts", "fsdp=4", "fsdp=4") == 0
    assert extras[-1] == ["--training.seq_len", "64"]
    # CPU kernels are deterministic without the option, so an explicit false is fine there
    argv = ["--config", "llama3", "--steps", "3", "--out", str(tmp_path / "off"), "--seed-checkpoint", str(seed)]
    assert (
        main([*argv, "--assert-equal", "--layouts", "fsdp=4", "fsdp=4", "--", "--training.deterministic", "false"]) == 0
    )


def test_cli_rejects_bad_layouts_before_running(tmp_path, monkeypatch, capsys):
    def must_not_run(*a, **k):
        raise AssertionError("nothing may run for a bad layout")

    monkeypatch.setattr(runner, "run_layouts", must_not_run)
    monkeypatch.setattr(runner, "create_seed_checkpoint", must_not_run)
    out = tmp_path / "out"
    for args, message in [
        (["--layouts", "fsdp=4", "tpp=2"], "did you mean 'tp'?"),
        (["--layouts", "fsdp=4", "tp=2,nproc=8"], "use dp_shard=4 or dp_shard=-1"),
        (["--layouts", "fsdp=4", "tp=3"], "tp=3 does not divide n_heads"),  # model rule, from the config
        (["--layouts", "fsdp=3"], "global_batch_size=16 is not divisible by the batch degree"),
        (["--layouts", "fsdp=4", "--baseline", "tp=2"], "--baseline 'tp=2' is not one of the layouts"),
        (["--layouts", "fsdp=4", "--", "--training.steps", "5"], "set by --steps"),
        (["--layouts", "fsdp=4", "--", "--training.seq_lne", "5"], "did you mean 'training.seq_len'"),
        (
            ["--layouts", "fsdp=4", "--", "--training.global_batch_size", "-1"],
            "a different global batch for each layout",
        ),
        (["--layouts", "fsdp=4", "--steps", "3", "--diagnose", "--diagnose-step", "4"], "between 1 and --steps (3)"),
        (
            ["--layouts", "fsdp=4", "--", "--validation.enable", "--validation.steps", "2"],
            "a different validation set for each layout",
        ),
    ]:
        rc = main(["--config", "llama3", "--out", str(out), *args])
        assert rc == 2, args
        assert message in capsys.readouterr().err
    assert not out.exists()


# ------------------------------------------------------------------------- --launcher


def test_launcher_option_reaches_every_run(tmp_path, recorded_runs, monkeypatch, capsys):
    """``--launcher`` defaults to torchrun (the behaviour without the option) and is carried to
    the runs (Plan.launcher); with fork the tool stops the fork server at the end, if it started
    it (not a server its caller already had: a test worker that runs it in-process)."""
    seed, _ = recorded_runs
    launchers: list[str] = []
    stops: list[bool] = []
    fake = runner.run_layouts
    monkeypatch.setattr(
        runner, "run_layouts", lambda plan, layouts, t: launchers.append(plan.launcher) or fake(plan, layouts, t)
    )
    monkeypatch.setattr(runner, "stop_fork_server", lambda: stops.append(True))
    monkeypatch.setattr(runner, "fork_server_running", lambda: False)  # as in its own process
    assert _main(tmp_path / "default", seed, "--layouts", "fsdp=4", "fsdp=4") == 0
    assert "ranks forked" not in capsys.readouterr().out and stops == []
    assert _main(tmp_path / "torchrun", seed, "--launcher", "torchrun", "--layouts", "fsdp=4", "fsdp=4") == 0
    assert stops == []
    assert _main(tmp_path / "fork", seed, "--launcher", "fork", "--assert-equal", "--layouts", "fsdp=4", "fsdp=4") == 0
    out = capsys.readouterr().out
    assert "ranks forked (--launcher fork)" in out and "bitwise equality (--assert-equal)" in out
    assert launchers == ["torchrun", "torchrun", "fork"] and stops == [True]
    # a caller's server is the caller's: left running
    monkeypatch.setattr(runner, "fork_server_running", lambda: True)
    assert _main(tmp_path / "fork2", seed, "--launcher", "fork", "--layouts", "fsdp=4", "fsdp=4") == 0
    assert launchers[-1] == "fork" and stops == [True]


def test_launcher_refusals_and_bad_values(tmp_path, monkeypatch, capsys):
    """fork starts real ranks: with --comm-mode local_tensor (no ranks, no launcher) it is refused
    in one line, exit 2, before anything runs; an unknown launcher is argparse's usage error."""

    def must_not_run(*a, **k):
        raise AssertionError("nothing may run")

    monkeypatch.setattr(runner, "run_layouts", must_not_run)
    monkeypatch.setattr(runner, "create_seed_checkpoint", must_not_run)
    out = tmp_path / "out"
    argv = ["--config", "llama3", "--out", str(out), "--layouts", "fsdp=2", "--launcher", "fork"]
    assert main([*argv, "--comm-mode", "local_tensor"]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("error: --launcher fork starts each layout's ranks as real processes") and err.count("\n") == 1
    )
    assert "--comm-mode local_tensor runs them all in one process" in err and not out.exists()
    with pytest.raises(SystemExit) as exc:
        main(["--config", "llama3", "--layouts", "fsdp=2", "--launcher", "mpirun"])
    assert (
        exc.value.code == 2 and "invalid choice: 'mpirun' (choose from 'torchrun', 'fork')" in capsys.readouterr().err
    )


def test_runs_are_launched_through_the_chosen_launcher(tmp_path, monkeypatch):
    """runner and diagnose send every launch (seed checkpoint, layouts, grad dumps) through the
    plan's launcher: torchrun commands, or run_forked_streaming with the ranks' count and the
    same train.py argv (grad_dump's file for the module torchrun runs with -m)."""
    from tools.compare_loss import diagnose
    from tools.compare_loss.layouts import Plan

    calls: list[tuple] = []

    def streaming(cmd, log_path, on_line, timeout=None):
        calls.append(("popen", cmd))
        return 0

    def forked(nproc, argv, log_path, on_line, timeout=None, script=runner.TRAIN_PY):
        calls.append(("fork", nproc, script, argv))
        return 0

    monkeypatch.setattr(runner, "run_streaming", streaming)
    monkeypatch.setattr(runner, "run_forked_streaming", forked)
    layout = parse_layout("tp=2,fsdp=2")
    for launcher in ("torchrun", "fork"):
        calls.clear()
        plan = Plan(config="llama3.toml", steps=2, out=str(tmp_path / launcher), extra=[], seed_checkpoint="seed")
        plan.launcher = launcher
        runner.create_seed_checkpoint(plan, None)
        (result,) = runner.run_layouts(plan, [layout], None)
        assert result.returncode == 0
        diagnose.run_grad_dump(plan, layout, str(tmp_path / launcher / "dump"), 1, None)
        argv = plan.run_argv(layout, plan.run_folder(1, layout))
        if launcher == "torchrun":
            (_, seed_cmd), (_, run_cmd), (_, dump_cmd) = calls
            assert (
                seed_cmd[:2] == [sys.executable, runner.TRAIN_PY] and "--checkpoint.create_seed_checkpoint" in seed_cmd
            )
            assert run_cmd == runner.torchrun_cmd(4, runner.TRAIN_PY, argv)
            assert dump_cmd[:6] == runner.torchrun_cmd(4, "x", [], module=True)[:5] + ["-m"]
            assert dump_cmd[6] == diagnose.GRAD_DUMP_MODULE
        else:
            seed_call, run_call, dump_call = calls
            assert (
                seed_call[:3] == ("fork", 1, runner.TRAIN_PY) and "--checkpoint.create_seed_checkpoint" in seed_call[3]
            )
            assert run_call == ("fork", 4, runner.TRAIN_PY, argv)
            assert dump_call[1] == 4 and Path(dump_call[2]) == Path(diagnose.__file__).with_name("grad_dump.py")
            assert dump_call[3][dump_call[3].index("--") + 1 :][:2] == ["--config", "llama3.toml"]
    # local_tensor: one python process per layout, whatever the launcher field says
    calls.clear()
    plan = Plan(
        config="llama3.toml", steps=2, out=str(tmp_path / "lt"), extra=[], seed_checkpoint="s", comm_mode="local_tensor"
    )
    runner.run_layouts(plan, [layout], None)
    assert calls[0][0] == "popen" and calls[0][1][:2] == [sys.executable, runner.TRAIN_PY]


def test_main_module_starts_nothing_at_import():
    """The fork launcher's children import the parent's __main__ module again (multiprocessing's
    rule for forkserver/spawn): ``python -m tools.compare_loss`` must guard its main()."""
    import runpy

    ran = []
    import tools.compare_loss.cli as cli

    original = cli.main
    cli.main = lambda *a, **k: ran.append(True) or 0
    try:
        runpy.run_module("tools.compare_loss.__main__", run_name="__mp_main__")
    finally:
        cli.main = original
    assert ran == []


# ------------------------------------------------------------------------------- plot


def test_plot_is_written(tmp_path):
    base = records([8.0, 7.5, 7.0, 6.5])
    runs = [
        ("single", base),
        ("fsdp=4", records([8.0, 7.5, 7.0 + 3e-7, 6.5 - 1e-6])),
        ("broken", records([8.0, float("nan"), 7.2, 6.9])),
    ]
    path = plot_runs(str(tmp_path / "sub" / "plot.png"), runs, "single", rtol=1e-5, atol=1e-5)
    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert 5_000 < len(data) < 200_000


# ---------------------------------------------------------------------------- diagnose


def test_grad_dump_comparison_ranks_parameters():
    torch = pytest.importorskip("torch")
    f64 = dict(dtype=torch.float64)
    g = {k: torch.tensor(v, **f64) for k, v in {"a": [1.0, 2.0], "b": [3.0, 4.0], "c": [0.5, 0.5]}.items()}
    other = {"a": g["a"] * (1 + 1e-6), "b": -g["b"], "c": g["c"].clone()}  # b: sign flip, same norm
    dump = lambda grads: {"params": {k: float(v.norm()) for k, v in grads.items()}}  # noqa: E731
    rows = compare_grad_dumps(dump(g), dump(other), g, other)
    assert [r["param"] for r in rows] == ["b", "a", "c"]
    assert rows[0]["grad_rel"] == pytest.approx(2.0) and rows[0]["norm_rel"] == 0.0
    assert rows[1]["grad_rel"] == pytest.approx(1e-6, rel=1e-2)
    assert rows[2]["grad_rel"] == 0.0
    # norms only (no full gradients): ranked by the norm difference; a name on one side only is listed first
    rows = compare_grad_dumps(dump(g), {"params": {"a": 2 * float(g["a"].norm()), "b": float(g["b"].norm())}})
    assert [r["param"] for r in rows] == ["c", "a", "b"] and rows[0]["note"] == "only in baseline"
    text = format_grad_rows(rows)
    assert "only in baseline" in text and text.splitlines()[0].split()[0] == "parameter"
