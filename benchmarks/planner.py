"""The layout planner's estimates against measured step times on CPU (issue 15, item 3).

Six layouts of the llama3 debug model on 2 gloo processes (train.py through torchrun, one
thread per process) are timed, and the planner estimates each one with a CPU profile measured
in the same run:

* compute rate: the matmul FLOP/s a 1-process, 1-thread train.py step achieves (the planner's
  own FLOP count of that step over its median time less the optimizer's; efficiency 1);
* ``memory_gbps``: the optimizer step (gradient norm, clipping, AdamW foreach) timed over the
  debug model's parameters on one thread, as the bandwidth that moves the planner's 40 bytes per
  float32 parameter in that time (``step_bytes_per_param("float32")``: no casts); the compute rate
  is fitted after the planner's elementwise time at that bandwidth is taken off the step;
* ``recompute_cost``: what a matmul FLOP of full AC's recomputed forward costs relative to that
  rate, from the same 1-process run with full AC (the extra time over the planner's recomputed
  FLOPs); on CPU the forward carries more non-matmul work per FLOP than the whole step;
* network: gloo on this host: bandwidth and per-hop latency from timed back-to-back all-reduces
  of three sizes between 2 processes; per kind (reduce-scatter, all-gather, send/recv) the factor
  its measured per-byte cost needs on the ring model's and the latency the ring model lacks
  (gloo's reduce-scatter costs about an all-reduce, not half of one); a base latency per
  collective for what a collective
  costs inside a training step beyond that (the other rank still computing, a waiting process
  woken up on a busy core): from real and fake-backend tp=2 runs of 1- and 3-layer models, the
  time one more block's collectives take over their predicted count and bytes;
* ``tp_block_overhead_s``: TP's host time per block and micro-batch beyond its FLOPs (DTensor
  dispatch, redistribution bookkeeping, narrower GEMMs), from fake-backend runs of tp=2 rank 0
  with 1 and 3 layers against 1-process runs of the same depths (not the timed 6-layer layout);
  ``cp_block_overhead_s`` the same for cp=2 (two masked attention calls per block instead of one
  causal one, the gathered K/V reordered; FSDP's per-group work over the cp ranks included, as
  in every cp layout);
* ``comm_overlap`` false: each of the 2 ranks computes on one of the 2 cores, so no collective
  hides behind compute (stated, not fitted).

Each layout's busiest rank also runs alone on the fake backend (no-op collectives): its
measured compute time (and CPU time) per step against the planner's compute estimate for that
rank. Every layout's real run is timed ``ROUNDS`` times, the rounds interleaved (layout order
within a round alternates) so slow drifts of a shared host hit every layout alike; its step time
is the mean of the rounds' medians and its noise the spread of those medians (max - min).
Reported:
measured and predicted step times, their ratio, predicted / fake-backend compute, both
rankings, Spearman's rank correlation, ``rank_match`` (the orders agree exactly) and
``resolved_rank_match``: no pair of layouts whose measured times differ by more than their
noise is ordered the other way by the planner (``inverted_pairs`` lists the
resolved pairs it gets wrong; ``unresolved_pairs`` those closer than the noise). Run it on a
quiet host: while other work shares the 2 cores, times swing 2-4x.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SEQ, GLOBAL_BATCH, LOCAL_BATCH, STEPS, WARMUP = 256, 8, 4, 8, 3
ROUNDS = 3
# name: (degrees and AC mode, the rank whose compute the fake backend measures: the busiest one)
LAYOUTS = {
    "fsdp2": ({"dp_shard": 2}, 0),
    "hsdp_replicate2": ({"dp_replicate": 2, "dp_shard": 1}, 0),
    "tp2": ({"dp_shard": 1, "tp": 2}, 0),
    "cp2": ({"dp_shard": 1, "cp": 2}, 0),
    "pp2_1f1b": ({"dp_shard": 1, "pp": 2}, 1),  # the last stage also runs the output projection
    "fsdp2_full_ac": ({"dp_shard": 2, "ac": "full"}, 0),
}


def _env() -> dict:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    return env


def _train(nproc: int, settings: dict, fake_rank: int | None = None) -> dict:
    """Step times of ``train.py`` after the warm-up steps: ``{"median", "min"}`` seconds (a
    fake-backend run of ``fake_rank``: its compute time per step, and ``"cpu"``, the median CPU
    time of the process per step)."""
    args = [
        "--config", "llama3.toml", "--training.seq_len", str(SEQ), "--training.global_batch_size",
        str(GLOBAL_BATCH), "--training.local_batch_size", str(LOCAL_BATCH), "--training.steps", str(STEPS),
        "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false", "--checkpoint.enable", "false",
    ]  # fmt: skip
    for key, value in settings.items():
        if key == "ac":
            args += ["--activation_checkpoint.mode", value]
        elif key == "n_layers":
            args += ["--model.n_layers", str(value)]
        else:
            args += [f"--parallelism.{key}", str(value)]
    if fake_rank is not None:
        args += [
            "--comm.mode",
            "fake_backend",
            "--comm.fake_world_size",
            str(nproc),
            "--comm.fake_rank",
            str(fake_rank),
        ]
        nproc = 1
    if nproc == 1:
        cmd = [sys.executable, "train.py"]
    else:
        cmd = [str(Path(sys.executable).with_name("torchrun")), "--standalone", f"--nproc_per_node={nproc}", "train.py"]
    with tempfile.TemporaryDirectory() as d:
        subprocess.run([*cmd, *args, "--job.dump_folder", d], cwd=ROOT, check=True, capture_output=True, env=_env())
        (path,) = Path(d).rglob("metrics.jsonl")
        records = [json.loads(line) for line in path.open() if line.strip()]
    steps = [r for r in records if r["step"] > WARMUP]
    key = "fake_step_time_s" if fake_rank is not None else "interval_s"
    times = [r[key] for r in steps]
    out = {"median": statistics.median(times), "min": min(times)}
    if fake_rank is not None:
        out["cpu"] = statistics.median(r["fake_cpu_time_s"] for r in steps)
    return out


GLOO_SIZES = (1024, 512 * 2**10, 8 * 2**20)  # bytes: latency, and two sizes for the bandwidth slope


def _gloo_times(rank: int, world_size: int) -> dict:
    """Seconds of back-to-back gloo collectives per (kind, full-buffer bytes) on 2 processes,
    41 calls each (the fastest at the smallest size, the median at the others): all-reduce,
    reduce-scatter, all-gather, and a one-way send/recv (half a ping-pong)."""
    import torch
    import torch.distributed as dist

    peer = 1 - rank

    def ping_pong(t):
        if rank == 0:
            dist.send(t, peer)
            dist.recv(t, peer)
        else:
            dist.recv(t, peer)
            dist.send(t, peer)

    out = {}
    for nbytes in GLOO_SIZES:
        full = torch.zeros(nbytes // 4)
        shard = torch.zeros(nbytes // 4 // world_size)
        ops = {  # kind: (function, its arguments, calls per run)
            "all_reduce": (dist.all_reduce, (full,), 1),
            "reduce_scatter": (dist.reduce_scatter_tensor, (shard, full), 1),
            "all_gather": (dist.all_gather_into_tensor, (full, shard), 1),
            "send_recv": (ping_pong, (full,), 2),
        }
        for kind, (op, args, calls) in ops.items():
            for _ in range(3):
                op(*args)
            times = []
            for _ in range(41):
                dist.barrier()
                start = time.perf_counter()
                op(*args)
                times.append((time.perf_counter() - start) / calls)
            # the smallest size measures latency: its fastest call (a slower mode -- a process
            # woken up late on a busy core -- is what the in-step base latency accounts for);
            # the larger ones the bandwidth: their median
            out[(kind, nbytes)] = min(times) if nbytes == GLOO_SIZES[0] else statistics.median(times)
    return out


def _optimizer_seconds() -> tuple[float, int]:
    """(median seconds, parameter elements) of the trainer's optimizer step -- gradient norm,
    clipping, AdamW with its CPU implementation -- over the llama3 debug model's parameters, one
    thread, in this process."""
    import torch

    from models.registry import get_model_spec
    from trainer.config import JobConfig
    from trainer.optim.grad_clip import clip_grad_norm_
    from trainer.optim.optimizers import build_optimizer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        spec = get_model_spec("llama3", "debugmodel")
        model = spec.model_cls(spec.args)
        params = list(model.parameters())
        for p in params:
            p.grad = torch.randn_like(p)
        opt = build_optimizer([model], JobConfig())
        times = []
        for _ in range(15):
            start = time.perf_counter()
            clip_grad_norm_(params, 1.0)
            opt.step()
            times.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return statistics.median(times[3:]), sum(p.numel() for p in params)


def _choice(settings: dict, world_size: int = 2):
    from parallel_dims.layout import validate_degrees
    from tools.planner.choice import LayoutChoice

    degrees = {k: v for k, v in settings.items() if k not in ("ac", "n_layers")}
    d = validate_degrees(world_size=world_size, **degrees)
    choice = LayoutChoice(
        global_batch=GLOBAL_BATCH, local_batch=LOCAL_BATCH, seq_len=SEQ,
        schedule="1F1B" if d.pp > 1 else None, n_microbatches=d.pp if d.pp > 1 else None,
        ac=settings.get("ac", "none"), param_dtype="float32", reduce_dtype="float32",
    )  # fmt: skip
    return d, choice


def _elementwise_s(d, choice, memory_gbps: float) -> float:
    """The planner's memory-bound activation time of the 1-process debug-model step at
    ``memory_gbps`` (subtracted before the matmul rate is fitted: the estimate adds it apart)."""
    import dataclasses

    from tools.planner.estimate import Job, estimate
    from tools.planner.hardware import load_hardware

    hw = dataclasses.replace(load_hardware("h100"), memory_gbps=memory_gbps)
    job = Job("llama3", "debugmodel", 1, 1, SEQ, GLOBAL_BATCH, hw, 1.0, "float32", "float32")
    return estimate(job, d, choice).time["elementwise"]


def cpu_profile() -> dict:
    """The planner hardware keys of this host: the optimizer's memory bandwidth, the matmul
    FLOP/s of a 1-process, 1-thread train.py step (the planner's own FLOP count of that step over
    its median time less the optimizer step), full AC's recompute cost, gloo links per collective
    kind from back-to-back 2-process collectives (:func:`_gloo_profile`), and, from the per-block
    times of tp=2 and cp=2 (:func:`_blocks`), TP's and CP's host overheads and the base latency a
    collective costs inside a training step beyond that microbenchmark."""
    import dataclasses

    from tools.forkserver import run_distributed
    from tools.planner.compute import rank_matmul_flops
    from tools.planner.hardware import OPTIMIZER_BYTES_PER_PARAM, collective_seconds, load_hardware

    optimizer_s, n_params = _optimizer_seconds()
    memory_gbps = n_params * OPTIMIZER_BYTES_PER_PARAM / optimizer_s / 1e9
    # the 1-process step runs the optimizer over every parameter once: the rest is the FLOPs'
    # and the memory-bound activation work's (tools/planner/elementwise.py at this bandwidth)
    step = _train(1, {"dp_shard": 1})["median"]
    d, choice = _choice({"dp_shard": 1}, world_size=1)
    elementwise = _elementwise_s(d, choice, memory_gbps)
    flops = rank_matmul_flops("llama3", "debugmodel", d, choice, 0, max_seq_len=2048)["total"]
    rate = flops / max(step - optimizer_s - elementwise, 1e-9)
    step_full_ac = _train(1, {"dp_shard": 1, "ac": "full"})["median"]
    d, choice = _choice({"dp_shard": 1, "ac": "full"}, world_size=1)
    recomputed = rank_matmul_flops("llama3", "debugmodel", d, choice, 0, max_seq_len=2048)["recompute"]
    more_elementwise = _elementwise_s(d, choice, memory_gbps) - elementwise  # AC recomputes them
    recompute_cost = max(step_full_ac - step - more_elementwise, 0.0) / (recomputed / rate)
    link = _gloo_profile(run_distributed(_gloo_times, 2, env=_env())[0])
    blocks = _blocks()

    def host_overhead(axis: str) -> float:
        # a tp=2 / cp=2 block on the fake backend against the 1-process block scaled by the two
        # blocks' matmul FLOPs, per micro-batch
        scaled = blocks["plain_s"] * blocks[f"{axis}_flops"] / blocks["plain_flops"]
        return max(blocks[f"{axis}_fake_s"] - scaled, 0.0) / blocks["forwards"]

    # a block's collectives cost (real - fake) on the tp=2 ranks; what the link figures above do
    # not explain, per collective, is the base latency (the other rank still computing, a
    # waiting process woken up on a busy core)
    hw = dataclasses.replace(load_hardware("h100"), **link)
    linked = sum(c * collective_seconds(k, b, 2, False, hw) for k, b, c in blocks["collectives"])
    count = sum(c for _, _, c in blocks["collectives"])
    base = max(blocks["tp_real_s"] - blocks["tp_fake_s"] - linked, 0.0) / count
    return {
        "peak_flops_fp32": rate,
        "peak_flops_bf16": rate,
        "memory_gib": 64.0,
        "reserve_gib": 0.0,
        **link,
        "base_latency_us": base * 1e6,
        "comm_overlap": False,
        "recompute_cost": recompute_cost,
        "tp_block_overhead_s": host_overhead("tp"),
        "cp_block_overhead_s": host_overhead("cp"),
        "memory_gbps": memory_gbps,
    }


def _gloo_profile(times: dict) -> dict:
    """Link figures from :func:`_gloo_times` (2 ranks): all-reduce is the reference -- its
    bandwidth from the slope between the two large sizes (a ring all-reduce over 2 ranks moves
    the buffer's size once), its per-hop latency from the smallest less its bytes (2 hops); every other kind
    gets the factor its own slope needs on the ring model's bandwidth term and the latency the
    ring model lacks at the smallest size (``collective_bw_scale`` / ``collective_latency_us``)."""
    import dataclasses

    from tools.planner.hardware import collective_seconds, load_hardware

    small, mid, big = GLOO_SIZES
    slope = {}
    for kind in ("all_reduce", "reduce_scatter", "all_gather", "send_recv"):
        slope[kind] = max(times[(kind, big)] - times[(kind, mid)], 1e-9) / (big - mid)
    link = {
        "intra_node_gbps": 1 / slope["all_reduce"] / 1e9,
        "intra_node_hop_us": max(times[("all_reduce", small)] - small * slope["all_reduce"], 0.0) * 1e6 / 2,
        "base_latency_us": 0.0,
    }
    ring = dataclasses.replace(load_hardware("h100"), **link)
    scale, latency = {}, {}
    for kind in ("reduce_scatter", "all_gather", "send_recv"):
        model_slope = (
            collective_seconds(kind, big, 2, False, ring) - collective_seconds(kind, mid, 2, False, ring)
        ) / (big - mid)
        scale[kind] = slope[kind] / model_slope
        at_small = collective_seconds(kind, small, 2, False, dataclasses.replace(ring, collective_bw_scale=scale))
        latency[kind] = max(times[(kind, small)] - at_small, 0.0) * 1e6
    return {**link, "collective_bw_scale": scale, "collective_latency_us": latency}


def _blocks() -> dict:
    """What one more transformer block adds to a step (1- and 3-layer models, so embeddings and
    head cancel; not the timed 6-layer layouts): its time in a 1-process run (``plain_s``), on
    rank 0 of tp=2 and of cp=2 on the fake backend (``tp_fake_s``, ``cp_fake_s``: compute and
    host overhead) and in a real 2-process tp=2 run (``tp_real_s``); its matmul FLOPs in each
    (``plain_flops``, ``tp_flops``, ``cp_flops``), the 2-rank steps' micro-batches
    (``forwards``) and the block's predicted tp=2 collectives as (kind, bytes, calls)."""
    from collections import Counter

    from tools.planner.collectives import predict_collectives
    from tools.planner.compute import rank_matmul_flops

    def per_block(nproc: int, settings: dict, fake_rank: int | None = None) -> float:
        t = {n: _train(nproc, {**settings, "n_layers": n}, fake_rank)["median"] for n in (1, 3)}
        return (t[3] - t[1]) / 2

    def model(settings: dict, nproc: int):
        out = {}
        for n in (1, 3):
            d, choice = _choice({**settings, "n_layers": n}, world_size=nproc)
            flops = rank_matmul_flops("llama3", "debugmodel", d, choice, 0, max_seq_len=2048, n_layers=n)
            calls = Counter()
            for r in predict_collectives("llama3", "debugmodel", d, choice, 0, max_seq_len=2048, n_layers=n):
                calls[(r["kind"], r["bytes"])] += r["count"]
            out[n] = (flops["total"], calls)
        forwards = GLOBAL_BATCH // (d.dp_replicate * d.dp_shard * LOCAL_BATCH)
        calls = out[3][1]
        calls.subtract(out[1][1])
        return (out[3][0] - out[1][0]) / 2, [(k, b, c / 2) for (k, b), c in calls.items() if c], forwards

    plain, tp, cp = {"dp_shard": 1}, {"dp_shard": 1, "tp": 2}, {"dp_shard": 1, "cp": 2}
    plain_flops, _, _ = model(plain, 1)
    tp_flops, collectives, forwards = model(tp, 2)
    cp_flops, _, cp_forwards = model(cp, 2)
    assert cp_forwards == forwards
    return {
        "plain_s": per_block(1, plain),
        "tp_fake_s": per_block(2, tp, fake_rank=0),
        "tp_real_s": per_block(2, tp),
        "cp_fake_s": per_block(2, cp, fake_rank=0),
        "plain_flops": plain_flops,
        "tp_flops": tp_flops,
        "cp_flops": cp_flops,
        "forwards": forwards,
        "collectives": collectives,
    }


def _rounded(value):
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    return round(value, 3) if isinstance(value, float) else value


def _spearman(a: list[str], b: list[str]) -> float:
    n = len(a)
    pos = {name: i for i, name in enumerate(b)}
    d2 = sum((i - pos[name]) ** 2 for i, name in enumerate(a))
    return 1 - 6 * d2 / (n * (n * n - 1))


def _pairs(rows: dict) -> tuple[list[list[str]], list[list[str]]]:
    """(pairs the planner orders against the measurement although their measured times differ
    by more than both layouts' run-to-run noise, pairs closer than that noise); each pair
    [faster, slower] as measured."""
    inverted, unresolved = [], []
    names = sorted(rows, key=lambda n: rows[n]["measured_step_s"])
    for i, fast in enumerate(names):
        for slow in names[i + 1 :]:
            gap = rows[slow]["measured_step_s"] - rows[fast]["measured_step_s"]
            noise = max(rows[fast]["measured_noise_s"], rows[slow]["measured_noise_s"])
            if gap <= noise:
                unresolved.append([fast, slow])
            elif rows[fast]["predicted_step_s"] > rows[slow]["predicted_step_s"]:
                inverted.append([fast, slow])
    return inverted, unresolved


def run() -> dict:
    import dataclasses

    from tools.planner.estimate import Job, estimate
    from tools.planner.hardware import load_hardware

    profile = cpu_profile()
    hw = dataclasses.replace(load_hardware("h100"), name="cpu", **profile)
    job = Job("llama3", "debugmodel", 2, 2, SEQ, GLOBAL_BATCH, hw, 1.0, "float32", "float32")
    rounds: dict[str, list[dict]] = {name: [] for name in LAYOUTS}
    for i in range(ROUNDS):
        for name in list(LAYOUTS)[:: 1 if i % 2 == 0 else -1]:
            rounds[name].append(_train(2, LAYOUTS[name][0]))
    rows = {}
    for name, (settings, busiest) in LAYOUTS.items():
        d, choice = _choice(settings)
        est = estimate(job, d, choice).time
        predicted_compute = sum(est[k] for k in ("compute", "recompute", "tp_overhead", "cp_overhead", "optimizer"))
        fake = _train(2, settings, fake_rank=busiest)
        medians = [r["median"] for r in rounds[name]]
        measured = statistics.mean(medians)
        rows[name] = {
            "measured_step_s": round(measured, 4),
            "measured_round_medians_s": [round(m, 4) for m in medians],
            # run-to-run spread: the rounds' medians, max - min
            "measured_noise_s": round(max(medians) - min(medians), 4),
            "measured_step_min_s": round(min(r["min"] for r in rounds[name]), 4),
            "predicted_step_s": round(est["total"], 4),
            "predicted_over_measured": round(est["total"] / measured, 3),
            "fake_backend_compute_s": round(fake["median"], 4),
            "fake_backend_cpu_s": round(fake["cpu"], 4),
            "predicted_compute_s": round(predicted_compute, 4),
            "predicted_over_fake_compute": round(predicted_compute / fake["median"], 3),
        }
    by_measured = sorted(rows, key=lambda n: rows[n]["measured_step_s"])
    by_predicted = sorted(rows, key=lambda n: rows[n]["predicted_step_s"])
    inverted, unresolved = _pairs(rows)
    result = {
        "profile": _rounded(profile),
        "layouts": rows,
        "ranking_measured": by_measured,
        "ranking_predicted": by_predicted,
        "spearman": round(_spearman(by_measured, by_predicted), 3),
        "rank_match": by_measured == by_predicted,
        "resolved_rank_match": not inverted,
        "inverted_pairs": inverted,
        "unresolved_pairs": unresolved,
    }
    print(
        f"planner: measured order {by_measured}; predicted {by_predicted}; spearman {result['spearman']}; "
        f"inverted resolved pairs {inverted}",
        file=sys.stderr,
    )
    return result


def gpu_rows(path: str | Path = ROOT / "bench_results" / "gpu.json") -> list[dict]:
    """The planner's step time for every row of a recorded ``make bench-gpu`` run, priced now
    (the current planner, the row's GPU, the same config the row's trainer ran:
    ``benchmarks.gpu_measure.planner_check``'s path), against the step time measured then; the
    prediction recorded with the row (``recorded_over_measured``) shows what the planner said
    when the row ran. Arithmetic only: no GPU, no model."""
    from benchmarks.gpu_measure import Case, planner_check

    data = json.loads(Path(path).read_text())
    device = data["host"]["device"]
    out = []
    for row in data["rows"]:
        if "tokens_per_s" not in row.get("trainer", {}):
            continue
        case = Case(**row["case"])
        now = planner_check(case, row["trainer"], device)
        out.append({
            "name": row["name"],
            "measured_step_s": round(now["measured_step_s"], 4),
            "predicted_step_s": round(now["predicted_step_s"], 4),
            "predicted_over_measured": round(now["predicted_over_measured"], 3),
            "recorded_over_measured": round(row.get("planner", {}).get("predicted_over_measured", float("nan")), 3),
            "predicted_time_s": {k: round(v, 4) for k, v in now["predicted_time_s"].items()},
            # what planner_check does not list (no collectives on one GPU): the elementwise work
            "elementwise_s": round(now["predicted_step_s"] - sum(now["predicted_time_s"].values()), 4),
        })  # fmt: skip
    return out


if __name__ == "__main__":
    if sys.argv[1:] == ["--gpu-rows"]:
        print(json.dumps(gpu_rows(), indent=1))
    else:
        print(json.dumps(run(), indent=1))
