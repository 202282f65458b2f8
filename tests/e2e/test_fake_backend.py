"""comm.mode = fake_backend (one rank of a large layout in one process) and the collective
recorder's trainer dump (comm.record_step), end to end through train.py on CPU.

Each train.py run, and the job plan's dry run it is checked against, runs in one process forked
from tools/forkserver.py's server (``run_forked``: the same ``train.py``, ``__main__`` and exit, with
torch and the trainer already imported; tests/e2e/test_launcher.py). The claims are the sharding,
the recorded collectives and the metrics a fake-backend run writes, not how its process started.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .helpers import FAST, ROOT, _env, read_metrics, run_forked

LLAMA = ["--config", "llama3.toml", *FAST]


def _fake_folder(out: Path, world: int, rank: int) -> Path:
    return out / "fake_backend" / f"world{world}_rank{rank}"


# ``python -m trainer.plan_report ARGS``, run as a script in a forked process
_PLAN_REPORT = "import sys\nfrom trainer.plan_report import main\nsys.exit(main(sys.argv[1:]))\n"


def _plan_report(tmp_path: Path, *args: str):
    from tools.forkserver import run_train as run_script

    script = tmp_path / "plan_report_main.py"
    script.write_text(_PLAN_REPORT)
    return run_script(1, list(args), env=_env(), cwd=ROOT, timeout=300, script=script)


@pytest.mark.fake_backend
def test_one_rank_of_a_64_rank_fsdp_tp_layout(tmp_path):
    """Rank 17 of FSDP 16 x TP 4 on 64 ranks: a few steps on this CPU, with this rank's step time
    and peak memory in metrics.jsonl and the report, and the real sharding: its parameters are
    the ones the job plan's dry run (python -m trainer.plan_report --config) computes for that rank."""
    # the same layout's sharding computed another way: the job plan's dry run of rank 17 (in
    # its own process: it initializes a fake default process group)
    cfg = tmp_path / "layout.toml"
    cfg.write_text(
        '[model]\nname = "llama3"\nflavor = "debugmodel"\n'
        "[training]\nseq_len = 64\nlocal_batch_size = 1\nglobal_batch_size = 16\n"
        "[parallelism]\ntensor_parallel_degree = 4\n"
    )
    plan = _plan_report(tmp_path, "--config", str(cfg), "--world-size", "64", "--rank", "17", "--json")
    out = tmp_path / "run"
    layout = ["--parallelism.tp", "4", "--training.local_batch_size", "1", "--training.global_batch_size", "16"]
    res = run_forked(
        1,
        *LLAMA,
        *layout,
        "--training.steps",
        "3",
        "--job.dump_folder",
        str(out),
        "--checkpoint.enable",
        "true",  # ignored in a fake-backend run
        "--comm.mode",
        "fake_backend",
        "--comm.fake_world_size",
        "64",
        "--comm.fake_rank",
        "17",
        "--comm.record_step",
        "2",
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "loss and grad_norm are meaningless" in res.stdout
    assert "mesh: world=64 pp=1 dp_replicate=1 dp_shard=16 cp=1 tp=4" in res.stdout
    folder = _fake_folder(out, 64, 17)
    assert not (out / "metrics.jsonl").exists() and not (folder / "checkpoint").exists()
    m = read_metrics(folder)
    assert sorted(m) == [1, 2, 3]
    for rec in m.values():
        assert rec["comm_mode"] == "fake_backend" and rec["fake_rank"] == 17 and rec["fake_world_size"] == 64
        assert rec["fake_step_time_s"] > 0 and rec["fake_cpu_time_s"] > 0 and rec["fake_peak_memory_gib"] > 0.01
        assert rec["fake_memory_kind"] == "cpu_peak_rss"
    report = json.loads((folder / "fake_backend_report.json").read_text())
    assert report["rank"] == 17 and report["world_size"] == 64
    assert [s["step"] for s in report["steps"]] == [1, 2, 3]
    assert [bool(s.get("comm_recorded")) for s in report["steps"]] == [False, True, False]

    assert plan.returncode == 0, plan.stderr[-2000:]
    dry = json.loads(plan.stdout)
    assert dry["degrees"]["dp_shard"] == 16 and dry["degrees"]["tp"] == 4
    assert report["local_params"] == dry["local_params"]
    assert report["param_bytes"] == 4 * dry["local_params"] == round(dry["memory_gib"]["params"] * 2**30)
    assert report["grad_bytes"] == report["param_bytes"]
    assert report["optimizer_bytes"] == 2 * report["param_bytes"]
    # a 64th of the model would be 5.8M / 64 = 91K parameters: the shard is that small
    assert report["local_params"] < dry["model"]["params"] / 60

    # the collectives of step 2, recorded on the fake backend: FSDP on fsdp, TP/SP on tp, the
    # loss on loss (here the fsdp group: the role names it)
    comm = json.loads((folder / "comm_rank17.json").read_text())
    assert comm["step"] == 2 and comm["comm_mode"] == "fake_backend"
    summary = {(e["kind"], e["mesh"]): e for e in comm["summary"]}
    for key in [("all_gather", "fsdp"), ("reduce_scatter", "fsdp"), ("all_gather", "tp"), ("all_reduce", "loss")]:
        assert summary[key]["count"] > 0 and summary[key]["bytes"] > 0, (key, sorted(summary))
    # every fsdp reduce-scatter carries 16 shards of fp32 gradients: at least 16x this rank's
    # parameter bytes in all (more by FSDP's padding of uneven dim-0 shards)
    rs = summary[("reduce_scatter", "fsdp")]["bytes"]
    assert 16 * report["param_bytes"] <= rs < 16 * report["param_bytes"] * 1.1, rs


@pytest.mark.fake_backend
def test_fake_backend_expert_parallel_runs_with_balanced_routing(tmp_path):
    """EP's token-count all-to-all returns this rank's own counts on the fake backend: the token
    all-to-all then receives as many rows as it sends (balanced routing), and the run completes."""
    out = tmp_path / "run"
    res = run_forked(
        1,
        "--config",
        "deepseek_v3.toml",
        *FAST,
        "--training.local_batch_size",
        "1",
        "--training.global_batch_size",
        "4",
        "--training.steps",
        "1",
        "--parallelism.tp",
        "2",
        "--parallelism.ep",
        "4",
        "--job.dump_folder",
        str(out),
        "--comm.mode",
        "fake_backend",
        "--comm.fake_world_size",
        "8",
        "--comm.fake_rank",
        "5",
        "--comm.record_step",
        "1",
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    folder = _fake_folder(out, 8, 5)
    assert read_metrics(folder)[1]["fake_step_time_s"] > 0
    comm = json.loads((folder / "comm_rank5.json").read_text())
    a2a = [r for r in comm["records"] if r["kind"] == "all_to_all" and r["mesh"] == "ep"]
    assert a2a, sorted({(r["kind"], r["mesh"]) for r in comm["records"]})
    # balanced: every token all-to-all receives exactly what it sends
    assert all(r["out_bytes"] == r["bytes"] for r in a2a)


@pytest.mark.fake_backend
def test_fake_backend_pipeline_stage_runs_with_zeroed_receives(tmp_path):
    """Rank 13 of pp 2 x fsdp 4 x tp 2 (the last stage): torch's warm-up vote and the stage
    metadata need point-to-point messages the fake backend does not deliver; our stages answer
    the vote (their metadata is static) and zero their receive buffers, so the run completes with
    finite values and records the stage's sends and receives on pp."""
    out = tmp_path / "run"
    res = run_forked(
        1,
        *LLAMA,
        "--training.steps",
        "2",
        "--parallelism.pp",
        "2",
        "--parallelism.tp",
        "2",
        "--training.global_batch_size",
        "8",
        "--job.dump_folder",
        str(out),
        "--comm.mode",
        "fake_backend",
        "--comm.fake_world_size",
        "16",
        "--comm.fake_rank",
        "13",
        "--comm.record_step",
        "2",
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    folder = _fake_folder(out, 16, 13)
    m = read_metrics(folder)
    assert sorted(m) == [1, 2] and all(r["loss"] is not None and r["grad_norm"] is not None for r in m.values())
    comm = json.loads((folder / "comm_rank13.json").read_text())
    p2p = [r for r in comm["records"] if r["kind"] == "send_recv"]
    # 2 pipeline micro-batches of 1 x 64 tokens x dim 256, fp32, of which this tp rank sends
    # and receives its sequence-parallel shard (64 / tp = 32 tokens): receive each activation,
    # send back each input gradient
    assert sorted(r["direction"] for r in p2p) == ["recv", "recv", "send", "send"], p2p
    assert all(r["mesh"] == "pp" and r["bytes"] == 64 // 2 * 256 * 4 for r in p2p), p2p
