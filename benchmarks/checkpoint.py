"""Checkpoints that do not stop training (issue 27): what a save costs the training loop with
``checkpoint.async_mode = "async"`` against ``"disabled"``, and the Hugging Face export written
from the live model against the export through a temporary DCP checkpoint.

Training part: ``train.py`` through torchrun, ``NPROC`` CPU processes over gloo (FSDP over both,
one intra-op thread each), the Llama 3 debug model deepened to ``N_LAYERS`` layers so that its
state (fp32 weights + AdamW's two moments) is several hundred MB, with a short step (local batch
1, ``SEQ`` tokens). The same run config is trained once per mode in the same bench run; saves
every ``INTERVAL`` steps, every step logged (``metrics.log_freq = 1``). From metrics.jsonl:

* per save, the time it held training: ``checkpoint_stall_s`` (the save step: waiting for a
  previous save, the staging copy and the launch; in ``disabled`` the whole save) plus
  ``checkpoint_poll_stall_s`` (the main thread's completion checks and the publish, reported on
  the step the background write was noticed finished). The stall ratio is the mean over the
  interval saves of ``async`` over that of ``disabled`` (goal <= 0.2). The final save is listed
  apart: at the end of training the run waits for its write either way (``close``), so the
  loop's stall there is the whole write in both modes.
* ``async`` step time: the steps a background write overlaps (after the save step up to the
  step its end was noticed) against the steps of the same run with no write in flight (the
  first ``WARMUP`` steps left out), and against the ``disabled`` run's steps; ``interval_s`` of
  a step excludes the checkpoint phases but includes the per-step completion checks.
* the background write time (``checkpoint_write_s`` of ``async``: from the start of the save to
  the end of the write on rank 0) against the synchronous save (``disabled``'s stall).

Hugging Face part, in this process (no process group, the same model and dtype for both): the
export through a temporary DCP (``dcp.save`` of the model state, then
``trainer.checkpoint.hf_write.export_dcp_to_hf``, then the temporary folder removed) against the
direct export from the live model (``trainer.checkpoint.hf_live.export_model_to_hf``) when that
module exists in the tree; each timed ``HF_REPS`` times interleaved, the best kept.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NPROC = 2
N_LAYERS = 4
# the state's size comes mostly from a larger vocabulary (embedding + output projection, 2 x
# VOCAB x 256): several hundred MB of state with a step of well under a second on 2 cores
VOCAB = 65536
SEQ = 64
LOCAL_BATCH = 1
STEPS = 26
INTERVAL = 4  # saves at 4, 8, ..., 24 (interval saves) and 26 (the final save)
WARMUP = 2  # first steps left out of step-time figures
MODES = ("disabled", "async")
GOAL = 0.2
HF_DTYPE = "float32"  # the trainer's default checkpoint.export_dtype
HF_REPS = 2
NOT_AVAILABLE = "not available in this tree (trainer.checkpoint.hf_live does not import)"


# ------------------------------------------------------------------ pure functions on records
def step_records(records: list[dict]) -> list[dict]:
    """The per-step records of a metrics.jsonl (those with a loss), in step order."""
    return sorted((r for r in records if "loss" in r), key=lambda r: r["step"])


def saves(records: list[dict]) -> list[dict]:
    """One entry per save, from a run's metrics.jsonl records (every step logged): ``step`` (the
    save step), ``stall_s`` (its ``checkpoint_stall_s``), ``poll_stall_s`` (the
    ``checkpoint_poll_stall_s`` of the record that reported its end; 0 for a synchronous save),
    ``held_s`` (their sum: what the save cost the training loop), ``write_s``, ``done_step``
    (the step whose record reported the end; None when the run's end did, in the record
    without a loss), ``final`` (the save of the run's last step)."""
    steps = step_records(records)
    last = steps[-1]["step"] if steps else None
    ordered = steps + [r for r in records if "loss" not in r]  # the end-of-run record last
    out: list[dict] = []
    pending: dict | None = None
    for r in ordered:
        if pending is not None and "checkpoint_write_s" in r:  # the background write's end
            pending.update(
                write_s=r["checkpoint_write_s"],
                poll_stall_s=r.get("checkpoint_poll_stall_s", 0.0),
                done_step=r["step"] if "loss" in r else None,
            )
            pending["held_s"] = pending["stall_s"] + pending["poll_stall_s"]
            pending = None
        if "checkpoint_stall_s" in r and "loss" in r:
            entry = {"step": r["step"], "stall_s": r["checkpoint_stall_s"], "final": r["step"] == last}
            # a synchronous save reports its write (= its stall) on its own record; on a background
            # save's record a write time comes only from the previous save's end, with its poll stall
            if "checkpoint_write_s" not in r or "checkpoint_poll_stall_s" in r:
                entry.update(poll_stall_s=None, held_s=None, write_s=None, done_step=None)
                pending = entry
            else:  # synchronous: the stall is the write
                entry.update(poll_stall_s=0.0, held_s=r["checkpoint_stall_s"], write_s=r["checkpoint_stall_s"])
                entry["done_step"] = r["step"]
            out.append(entry)
    return out


def overlapping_steps(records: list[dict]) -> set[int]:
    """The steps a background write overlaps: for a save started after step s whose end was
    reported at step f, steps s+1 ... f (the write ended after the check at the end of step f-1,
    so it ran during part of step f at least); a write still running at the run's end overlaps
    every later step. A synchronous save (done_step == step) overlaps none."""
    steps = [r["step"] for r in step_records(records)]
    out: set[int] = set()
    for s in saves(records):
        end = s["done_step"] if s["done_step"] is not None else (max(steps) if steps else s["step"])
        out.update(k for k in steps if s["step"] < k <= end)
    return out


def step_times(records: list[dict], warmup: int = WARMUP) -> dict[str, list[float]]:
    """``interval_s`` of the steps after ``warmup``, split into ``overlap`` (a background write
    in flight) and ``clear`` (none)."""
    over = overlapping_steps(records)
    out: dict[str, list[float]] = {"overlap": [], "clear": []}
    for r in step_records(records):
        if r["step"] > warmup:
            out["overlap" if r["step"] in over else "clear"].append(r["interval_s"])
    return out


def _mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarize(runs: dict[str, list[dict]], goal: float = GOAL) -> dict:
    """The figures of one bench run from each mode's metrics.jsonl records."""
    per_mode = {}
    for mode, records in runs.items():
        sv = saves(records)
        interval = [s for s in sv if not s["final"]]
        times = step_times(records)
        per_mode[mode] = {
            "saves": sv,
            "mean_held_s": _mean([s["held_s"] for s in interval if s["held_s"] is not None]),
            "mean_stall_s": _mean([s["stall_s"] for s in interval]),
            "mean_poll_stall_s": _mean([s["poll_stall_s"] for s in interval if s["poll_stall_s"] is not None]),
            "mean_write_s": _mean([s["write_s"] for s in interval if s["write_s"] is not None]),
            "step_s_overlap": _mean(times["overlap"]),
            "step_s_clear": _mean(times["clear"]),
            "steps_overlap": len(times["overlap"]),
            "steps_clear": len(times["clear"]),
        }
    a, d = per_mode.get("async", {}), per_mode.get("disabled", {})
    ratio = _ratio(a.get("mean_held_s"), d.get("mean_held_s"))
    return {
        "modes": per_mode,
        "stall_ratio_async_over_disabled": ratio,
        "goal": f"stall ratio <= {goal}",
        "goal_met": None if ratio is None else ratio <= goal,
        "async_overlap_step_over_clear_step": _ratio(a.get("step_s_overlap"), a.get("step_s_clear")),
        "async_overlap_step_over_disabled_step": _ratio(a.get("step_s_overlap"), d.get("step_s_clear")),
        "async_write_over_sync_save": _ratio(a.get("mean_write_s"), d.get("mean_held_s")),
    }


# ------------------------------------------------------------------ measurement
def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1")


def train_args(mode: str, folder: str, steps: int = STEPS, interval: int = INTERVAL, n_layers: int = N_LAYERS):
    return [
        "--config", "llama3.toml", "--model.n_layers", str(n_layers), "--model.vocab_size", str(VOCAB), "--training.seq_len", str(SEQ),
        "--training.local_batch_size", str(LOCAL_BATCH), "--training.global_batch_size", str(LOCAL_BATCH * NPROC),
        "--training.steps", str(steps), "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false",
        "--checkpoint.enable", "true", "--checkpoint.interval", str(interval), "--checkpoint.keep_latest_k", "2",
        "--checkpoint.async_mode", mode, "--job.dump_folder", folder,
    ]  # fmt: skip


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def train(mode: str, steps: int = STEPS, interval: int = INTERVAL, n_layers: int = N_LAYERS) -> dict:
    """One torchrun run; its metrics.jsonl records, wall time and the last checkpoint's bytes."""
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    with tempfile.TemporaryDirectory(prefix="bench_ckpt_", dir=os.environ.get("BENCH_CKPT_DIR")) as d:
        cmd = [
            torchrun,
            "--standalone",
            f"--nproc_per_node={NPROC}",
            "train.py",
            *train_args(mode, d, steps, interval, n_layers),
        ]
        t0 = time.perf_counter()
        res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=_env())
        wall = time.perf_counter() - t0
        if res.returncode != 0:
            raise RuntimeError(f"{mode} run failed ({res.returncode}): {res.stderr[-3000:]}")
        (path,) = Path(d).rglob("metrics.jsonl")
        records = [json.loads(line) for line in path.open() if line.strip()]
        last = sorted(Path(d).rglob(f"step-{steps}"))
        disk = _du(last[0]) if last else None
    return {"records": records, "wall_s": wall, "checkpoint_bytes_on_disk": disk}


def state_bytes(n_layers: int = N_LAYERS) -> dict:
    """fp32 weights + AdamW's exp_avg and exp_avg_sq of the trained model (all ranks together)."""
    from models.registry import build_model

    params = sum(
        p.numel() for p in build_model("llama3", "debugmodel", n_layers=n_layers, vocab_size=VOCAB).parameters()
    )
    return {"params": params, "model_bytes": params * 4, "model_and_adamw_bytes": params * 12}


def hf_export(n_layers: int = N_LAYERS, reps: int = HF_REPS, dtype: str = HF_DTYPE) -> dict:
    """Seconds of the Hugging Face export of one live model, through a temporary DCP and direct."""
    import torch
    import torch.distributed.checkpoint as dcp

    from models.registry import build_model
    from trainer.checkpoint.hf_write import export_dcp_to_hf
    from trainer.checkpoint.state import model_state_dict

    model = build_model("llama3", "debugmodel", device="cpu", n_layers=n_layers, vocab_size=VOCAB)
    with torch.no_grad():
        model.init_weights(0)
    args = model.args
    split: dict[str, list[float]] = {"dcp_save_s": [], "convert_s": []}

    def via_dcp(out: str) -> None:
        tmp = out + ".dcp.tmp"
        t0 = time.perf_counter()
        dcp.save({"model": model_state_dict([model])}, checkpoint_id=tmp)
        t1 = time.perf_counter()
        export_dcp_to_hf(tmp, out, "llama3", args, dtype=dtype)
        split["dcp_save_s"].append(t1 - t0)
        split["convert_s"].append(time.perf_counter() - t1)
        shutil.rmtree(tmp)

    try:
        from trainer.checkpoint.hf_live import export_model_to_hf
    except ImportError:
        export_model_to_hf = None
    times: dict[str, list[float]] = {"via_temp_dcp": [], "direct": []}
    sizes = {}
    with tempfile.TemporaryDirectory(prefix="bench_hf_", dir=os.environ.get("BENCH_CKPT_DIR")) as d:
        for rep in range(reps):
            for path in ("via_temp_dcp", "direct"):
                if path == "direct" and export_model_to_hf is None:
                    continue
                out = os.path.join(d, f"{path}-{rep}")
                t0 = time.perf_counter()
                if path == "direct":
                    export_model_to_hf([model], out, "llama3", args, dtype=dtype)
                else:
                    via_dcp(out)
                times[path].append(time.perf_counter() - t0)
                sizes[path] = _du(Path(out))
                shutil.rmtree(out)
    best = {p: round(min(t), 3) for p, t in times.items() if t}
    return {
        "dtype": dtype,
        "processes": 1,
        "seconds": best if export_model_to_hf else {**best, "direct": NOT_AVAILABLE},
        "all_seconds": {p: [round(x, 3) for x in t] for p, t in times.items() if t},
        "via_temp_dcp_split": {k: round(min(v), 3) for k, v in split.items()},
        "folder_bytes": sizes,
        "direct_over_via_temp_dcp": round(best["direct"] / best["via_temp_dcp"], 3) if "direct" in best else None,
    }


def stall_breakdown(n_layers: int = N_LAYERS, reps: int = 2) -> dict:
    """Where an ``async`` save's stall goes, in this process (a world of one gloo rank holding
    the whole state, i.e. twice a rank's share in the 2-rank runs; no training step running
    beside the write): building the state dict (``CheckpointFolder.state``: the model's and the
    optimizer's flat FQN state), ``begin`` (the step-N.tmp folder + a barrier), the staging copy
    alone (torch's ``DefaultStager``, what ``BackgroundSaver.start`` uses: fresh CPU memory per save)
    and the same copy into the buffers it just allocated (what reused staging buffers would
    cost: the difference is allocating and first-touching the memory), ``start`` (copy +
    launch; launch = start - copy), the background write to its end, and a synchronous save of
    the same state for scale. Best of ``reps``."""
    import torch
    import torch.distributed as dist
    from torch.distributed._state_dict_utils import _copy_state_dict
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    from models.registry import build_model
    from trainer.checkpoint.async_save import BackgroundSaver
    from trainer.checkpoint.dcp import CheckpointFolder
    from trainer.config import load_config
    from trainer.optim.optimizers import build_optimizer

    cols: dict[str, list[float]] = {
        k: []
        for k in (
            "state_dict_s",
            "begin_s",
            "stage_copy_s",
            "copy_into_reused_buffers_s",
            "start_s",
            "launch_s",
            "write_s",
            "sync_save_s",
        )
    }
    with tempfile.TemporaryDirectory(prefix="bench_ckpt_", dir=os.environ.get("BENCH_CKPT_DIR")) as d:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(d, "store"), 1), rank=0, world_size=1)
        try:
            model = build_model("llama3", "debugmodel", device="cpu", n_layers=n_layers, vocab_size=VOCAB)
            with torch.no_grad():
                model.init_weights(0)
            opt = build_optimizer([model], load_config(["--config", "llama3.toml"]))
            model(torch.randint(0, VOCAB, (1, SEQ))).float().square().mean().backward()
            opt.step()  # AdamW's moments exist
            folder, saver = CheckpointFolder(os.path.join(d, "ckpt"), 1), BackgroundSaver("async", timeout_s=600)
            for rep in range(reps):
                step = 2 * rep + 1
                t0 = time.perf_counter()
                state = folder.state(step, [model], opt)
                t1 = time.perf_counter()
                tmp = folder.begin(step)
                t2 = time.perf_counter()
                stager = DefaultStager(StagingOptions(False, False, False, False))
                staged = stager.stage(state)
                t3 = time.perf_counter()
                _copy_state_dict(state, staged)  # the same copy into buffers that exist already
                t3b = time.perf_counter()
                stager.close()
                del staged
                t4 = time.perf_counter()
                saver.start(step, state, tmp)
                t5 = time.perf_counter()
                done = saver.poll(block=True)
                folder.publish(step)
                t6 = time.perf_counter()
                folder.save_state(step + 1, folder.state(step + 1, [model], opt))
                t7 = time.perf_counter()
                row = {"state_dict_s": t1 - t0, "begin_s": t2 - t1, "stage_copy_s": t3 - t2, "start_s": t5 - t4}
                row["copy_into_reused_buffers_s"] = t3b - t3
                row.update(launch_s=row["start_s"] - row["stage_copy_s"], write_s=done.write_s, sync_save_s=t7 - t6)
                for k, v in row.items():
                    cols[k].append(v)
            saver.close()
        finally:
            dist.destroy_process_group()
    return {"processes": 1, **{k: min(v) for k, v in cols.items()}}


def summary_line(result: dict) -> str:
    """The section's figures in one paragraph (the page's summary)."""
    m, hf = result["modes"], result["hf_export"]
    a, d = m["async"], m["disabled"]
    direct = hf["seconds"].get("direct")
    direct_text = f"{direct:.2f} s" if isinstance(direct, (int, float)) else str(direct)
    bd = result.get("async_stall_breakdown_one_process") or {}

    def nan(d: dict, k: str) -> float:
        return d.get(k, float("nan"))

    return (
        f"{result['config']['model_and_adamw_bytes'] / 1e6:.0f} MB of fp32 weights + AdamW state on "
        f"{result['config']['processes']} ranks: a save held training {d['mean_held_s']:.2f} s with async_mode "
        f"disabled and {a['mean_held_s']:.2f} s with async (stall {a['mean_stall_s']:.2f} s + completion checks "
        f"and publish {a['mean_poll_stall_s']:.2f} s), ratio {result['stall_ratio_async_over_disabled']:.3f} "
        f"(goal <= {GOAL}: {'met' if result['goal_met'] else 'missed'}). Steps overlapping a background write took "
        f"{result['async_overlap_step_over_clear_step']:.2f}x the steps without one (2 ranks on 2 cores: the "
        f"writer thread competes with training for the CPUs and the GIL); the background write took "
        f"{result['async_write_over_sync_save']:.2f}x the synchronous save. Where the async stall goes (one "
        f"process holding the whole state, best of 2): state dict {nan(bd, 'state_dict_s'):.3f} s, start (staging "
        f"copy + launch) {nan(bd, 'start_s'):.2f} s; timed on their own (single calls move by tenths of a second on "
        f"a shared host), the staging copy into fresh memory "
        f"{nan(bd, 'stage_copy_s'):.2f} s and the same copy into buffers that already exist "
        f"{nan(bd, 'copy_into_reused_buffers_s'):.2f} s (the rest is allocating and first-touching new memory "
        f"every save); synchronous save of the same state {nan(bd, 'sync_save_s'):.2f} s. "
        f"Hugging Face export ({hf['dtype']}): via a temporary DCP {hf['seconds']['via_temp_dcp']:.2f} s, "
        f"direct {direct_text}."
    )


def _round(v, nd: int = 4):
    if isinstance(v, float):
        return round(v, nd)
    if isinstance(v, dict):
        return {k: _round(x, nd) for k, x in v.items()}
    if isinstance(v, list):
        return [_round(x, nd) for x in v]
    return v


def run(steps: int = STEPS, interval: int = INTERVAL, n_layers: int = N_LAYERS, hf_reps: int = HF_REPS) -> dict:
    import platform

    import torch

    started = time.perf_counter()
    runs, walls, disk = {}, {}, {}
    for mode in MODES:
        print(f"checkpoint: training {mode} ({NPROC} ranks, {steps} steps, save every {interval})", file=sys.stderr)
        r = train(mode, steps, interval, n_layers)
        runs[mode], walls[mode], disk[mode] = r["records"], round(r["wall_s"], 2), r["checkpoint_bytes_on_disk"]
    summary = summarize(runs)
    print("checkpoint: Hugging Face export", file=sys.stderr)
    hf = hf_export(n_layers, hf_reps)
    print("checkpoint: stall breakdown (one process)", file=sys.stderr)
    breakdown = stall_breakdown(n_layers)
    a, d = summary["modes"]["async"], summary["modes"]["disabled"]
    line = (
        f"checkpoint: held per save async {a['mean_held_s']:.3f}s / disabled {d['mean_held_s']:.3f}s = "
        f"{summary['stall_ratio_async_over_disabled']:.3f} (goal <= {GOAL}: "
        f"{'met' if summary['goal_met'] else 'MISSED'}); async overlap step / clear step "
        f"{summary['async_overlap_step_over_clear_step']}; hf {hf['seconds']}"
    )
    print(line, file=sys.stderr)
    result = _round(
        {
            "config": {
                "model": "llama3 debugmodel",
                "n_layers": n_layers,
                "vocab_size": VOCAB,
                "processes": NPROC,
                "backend": "gloo",
                "layout": f"fsdp {NPROC}",
                "threads_per_process": 1,
                "seq": SEQ,
                "local_batch": LOCAL_BATCH,
                "steps": steps,
                "interval": interval,
                "warmup_steps_left_out": WARMUP,
                "dtype": "float32",
                **state_bytes(n_layers),
            },
            "machine": {
                "cpus": os.cpu_count(),
                "platform": platform.platform(),
                "torch": torch.__version__,
                "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
            },
            **summary,
            "checkpoint_bytes_on_disk": disk,
            "run_wall_s": walls,
            "hf_export": hf,
            "async_stall_breakdown_one_process": breakdown,
            "section_wall_s": time.perf_counter() - started,
        }
    )
    return {"summary": summary_line(result), **result}


if __name__ == "__main__":
    print(json.dumps(run(), indent=1))
