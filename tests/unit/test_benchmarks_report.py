"""docs/benchmarks.md is generated: it must be exactly what ``python -m benchmarks.report`` writes
from the committed ``bench_results/*.json`` (so a figure cannot be edited by hand or drift from
its data), and the generator is deterministic."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from benchmarks import report

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def committed_results() -> list[Path]:
    """The result files git tracks (a local run's untracked gpu.json does not count); every JSON
    file of bench_results/ outside a git checkout."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "--", "bench_results/*.json"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return report.result_files(ROOT / "bench_results")
    return sorted(ROOT / line for line in out.splitlines() if line.strip())


def test_benchmarks_page_is_what_the_committed_results_generate():
    files = committed_results()
    assert files, "no bench_results/*.json is committed"
    expected = report.render(report.load(files))
    actual = (ROOT / "docs" / "benchmarks.md").read_text()
    assert actual == expected, (
        "docs/benchmarks.md differs from what bench_results/ generates: run `python -m benchmarks.report` "
        "(make bench does) and commit the page with its results; never edit it by hand"
    )


def test_report_is_deterministic_and_renders_every_kind(tmp_path):
    bench = {
        "host": {"python": "3.11", "torch": "2.13.0", "cpus": 2},
        "started": "2026-01-01T00:00:00",
        "memory": [
            {"model": "llama3", "fsdp": 2, "ranks": {"total_bytes": 1.5e6, "ratio": 1.0}, "per_rank": [{"rank": 0}]}
        ],
        "throughput": {"bare_loop_tps": [1.0, 2.0], "ratio_train_py_over_bare": 0.97, "goal": ">= 0.95"},
        "moe": {"config": {"rows": 4096}, "rows": [{"experts": 8, "seconds": {"grouped": 0.01, "loop": 0.02}}]},
    }
    gpu = {
        "host": {"torch": "2.13.0+cu128", "device": "H100"},
        "rows": [{"name": "llama3", "trainer": {"mfu_pct": 40.0}}],
    }
    smoke = {"host": {"torch": "2.13.0+cpu", "smoke": True}, "rows": [{"name": "tiny"}]}
    for name, data in {"bench.json": bench, "gpu.json": gpu, "smoke.json": smoke}.items():
        (tmp_path / name).write_text(json.dumps(data))
    files = report.result_files(tmp_path)
    first = report.render(report.load(files))
    assert first == report.render(report.load(list(reversed(files))))  # file order does not matter
    assert "`bench_results/bench.json`" in first and "`bench_results/gpu.json`" in first
    assert "smoke.json" not in first and "tiny" not in first  # smoke runs' figures mean nothing
    assert "| model | fsdp | ranks.total_bytes | ranks.ratio | per_rank |" in first
    assert "| llama3 | 2 | 1500000 | 1 | (1 record: see the JSON) |" in first
    assert "- ratio_train_py_over_bare: 0.97" in first and "| experts | seconds.grouped | seconds.loop |" in first
    assert "trainer:\n\n| name | mfu_pct |\n|---|---|\n| llama3 | 40 |" in first


def test_every_section_heading_has_its_anchor():
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    for _sid, title, _what in report.SECTIONS:
        assert f"## {title}\n" in page and f"(#{report.anchor(title)})" in page


def test_report_check_mode(tmp_path):
    out = tmp_path / "page.md"
    args = ["--results", str(ROOT / "bench_results"), "--out", str(out)]
    assert report.main([*args, "--check"]) == 1  # absent
    assert report.main(args) == 0
    assert report.main([*args, "--check"]) == 0


def test_make_bench_regenerates_the_page(tmp_path):
    """`make bench` ends by writing docs/benchmarks.md again (a dry run as a top-level make)."""
    import os
    import shutil

    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    (tmp_path / "pyproject.toml").write_text("")
    (tmp_path / ".venv").mkdir()
    (tmp_path / ".venv" / ".installed").write_text("")  # set up already: only the bench recipe
    skip = ("SYSTEM_TORCH", "MAKEFLAGS", "MFLAGS", "MAKELEVEL")
    env = {k: v for k, v in os.environ.items() if k not in skip}
    res = subprocess.run(
        ["make", "--no-print-directory", "-n", "bench"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().splitlines() == [
        ".venv/bin/python -m benchmarks.run --out bench_results/bench.json",
        ".venv/bin/python -m benchmarks.report",
    ]


def test_a_section_in_several_files_shows_only_its_newest_measurement():
    """A full `make bench` writes every section to bench.json, an `--only` run one section to its
    own file: the page shows the section once, from the more recent run."""
    host = {"cpus": 2}
    older = {"host": host, "started": "2026-01-01T00:00:00", "moe": {"note": "old figure"}, "memory": {"x": 1}}
    newer = {"host": host, "started": "2026-02-01T00:00:00", "moe": {"note": "new figure"}}
    page = report.render([("bench.json", older), ("moe.json", newer)])
    assert "new figure" in page and "old figure" not in page
    assert page.count("From `bench_results/moe.json`") == 1
    assert "From `bench_results/bench.json`" in page  # its other section stays
    flipped = report.render([("bench.json", {**older, "started": "2026-03-01T00:00:00"}), ("moe.json", newer)])
    assert "old figure" in flipped and "new figure" not in flipped


def test_gpu_section_summarizes_each_run_and_lists_issue_39s_goals():
    """The GPU section from a recorded bench-gpu run with issue 39's references
    (tests/unit/test_bench_gpu.py's ``recorded_run``) and a run from before them (its one bare loop
    was pure bf16, under "bare"): each run's summary table carries the ratios of tokens/s per row
    (ours / torchtitan's trainer, trainer / mixed bare, trainer / bf16 bare, bf16 bare / torchtitan's
    model) and the planner columns, the old run's bare ratio in the bf16 column; the goals table
    reads the new run only. Without such a run every goal is UNMEASURED with the command that
    measures it."""
    from benchmarks.gpu_rows import GOALS_COMMAND
    from tests.unit.test_bench_gpu import recorded_run

    new = recorded_run()
    old = {
        "host": {"torch": "2.11.0+cu130", "device": "NVIDIA H200", "smoke": False},
        "started": "2026-11-26T04:33:18",
        "rows": [
            {
                "name": "llama3 8B x8 layers, eager",
                "case": new["rows"][0]["case"],
                "trainer": {"tokens_per_s": 26122.0, "mfu_pct": 44.49},
                "bare": {"tokens_per_s": 29616.0},
                "trainer_over_bare": 0.882,
                "bare_over_torchtitan_model": 0.908,
            }
        ],
    }
    page = report.render([("gpu.json", old), ("gpu_issue39_llama3.json", new)])
    header = (
        "| row | trainer tok/s | trainer MFU % | ours / torchtitan trainer | trainer / mixed bare | "
        "trainer / bf16 bare | bf16 bare / torchtitan model | planner / measured step | planner / measured memory |"
    )
    assert page.count(header) == 2
    assert "| llama3 8B x8 layers, eager | 26122 | 44.49 | - | - | 0.882 | 0.908 | - | - |" in page
    r0 = new["rows"][0]
    expected = [r0["name"], 27000.0, r0["trainer"]["mfu_pct"], 27000 / 25500, 27000 / 27500, 27000 / 29600]
    expected += [29600 / 32600, 0.9, 1.05]
    assert "| " + " | ".join(report.fmt(v) for v in expected) + " |" in page
    f8 = new["rows"][-1]["name"]  # skipped: the reason stands in the torchtitan column
    assert f"| {f8} | 40000 | - | the torchtitan comparison runs bf16 only | - | - |" in page
    assert "Goals of issue 39 (from `bench_results/gpu_issue39_llama3.json`):" in page
    assert "| trainer / mixed-precision bare loop (tokens/s), each row | >= 0.97 | met |" in page
    assert "UNMEASURED" not in page

    only_old = report.render([("gpu.json", old)])
    assert "Goals of issue 39 (from no run with these references yet):" in only_old
    assert only_old.count("| UNMEASURED |") == 3
    assert f"To measure the UNMEASURED goals: {GOALS_COMMAND}." in only_old
