"""The layout planner (tools/planner): its enumeration against the trainer's own validation, its
memory estimates against the real sharded model and measured activations, its ranking, and its
command line (text, --json, --toml, no-fit, bad input)."""

from __future__ import annotations

import io
import json
from concurrent.futures import ThreadPoolExecutor
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import tomllib

from parallel_dims.layout import validate_degrees
from tools.planner.activations import activation_bytes
from tools.planner.choice import LayoutChoice
from tools.planner.cli import main as planner_main
from tools.planner.cli import toml_snippet
from tools.planner.collectives import predict_collectives
from tools.planner.estimate import Job, estimate, memory_for_rank
from tools.planner.hardware import load_hardware
from tools.planner.inventory import model_inventory
from tools.planner.measure import measure_activations
from tools.planner.search import enumerate_layouts, losing_reason

REPO = Path(__file__).resolve().parents[2]
H100 = load_hardware("h100")


def _run(argv) -> tuple[int, str]:
    out = io.StringIO()
    with redirect_stdout(out):
        rc = planner_main(argv)
    return rc, out.getvalue()


def _config_with(snippet: str, base: str, tmp_path: Path):
    """The shipped config ``base`` with the snippet's sections merged over it, loaded by the
    trainer's config loader."""
    from trainer.config import load_config

    data = tomllib.loads((REPO / "train_configs" / base).read_text())
    for section, values in tomllib.loads(snippet).items():
        data.setdefault(section, {}).update(values)
    lines = []
    for section, values in data.items():
        lines.append(f"[{section}]")
        for k, v in values.items():
            lines.append(f"{k} = {json.dumps(v)}")
    path = tmp_path / "merged.toml"
    path.write_text("\n".join(lines) + "\n")
    return load_config(["--config", str(path)])


# --------------------------------------------------------------------------- enumeration
@pytest.mark.parametrize(
    "model, base, world, gpn, seq, batch",
    [("llama3", "llama3.toml", 8, 4, 256, 16), ("deepseek_v3", "deepseek_v3.toml", 4, 2, 256, 8)],
)
def test_every_emitted_layout_passes_plan_job(model, base, world, gpn, seq, batch, tmp_path):
    from trainer.plan import plan_job

    job = Job(model, "debugmodel", world, gpn, seq, batch, H100)
    layouts = list(enumerate_layouts(job))
    assert layouts
    degrees = {tuple(sorted(d.as_dict().items())) for d, _ in layouts}
    # a spread of layouts: every distinct set of degrees once, every schedule and AC mode
    picked, seen = [], set()
    for d, c in layouts:
        key = (tuple(sorted(d.as_dict().items())), c.schedule, c.ac)
        if key not in seen:
            seen.add(key)
            picked.append((d, c))
    picked = picked[:: max(1, len(picked) // 40)]
    for d, c in picked:
        e = estimate(job, d, c)
        cfg = _config_with(toml_snippet(e, job), base, tmp_path)
        plan = plan_job(cfg, world, tokenizer_vocab=2048)
        assert plan.parallel_dims.degrees == d
        assert plan.batch.grad_accum_steps == e.grad_accum
        if d.pp > 1:
            assert plan.stages.schedule == c.schedule and plan.stages.n_microbatches == c.n_microbatches
    assert len(degrees) > 5


def test_known_invalid_layouts_are_absent():
    job = Job("llama3", "debugmodel", 32, 8, 256, 32, H100)
    layouts = list(enumerate_layouts(job, ac_modes=("none",), schedules=("1F1B",)))
    ds = [d for d, _ in layouts]
    assert all(d.tp in (1, 2, 4, 8) for d in ds)  # tp=16 does not divide n_kv_heads=8
    assert all(d.ep == 1 and d.etp == 1 for d in ds)  # no experts
    assert all(32 % (d.dp_replicate * d.dp_shard) == 0 for d in ds)  # batch divisibility
    assert all(d.pp <= 6 for d in ds)  # 6 layers
    assert any(d.tp == 8 for d in ds) and any(d.pp == 2 for d in ds) and any(d.cp == 2 for d in ds)
    for _, c in layouts:  # 1F1B needs at least as many micro-batches as stages
        assert c.n_microbatches is None or c.n_microbatches >= 2


# --------------------------------------------------------------------------- memory
MEMORY_CASES = [
    # (model, degrees, rank, param dtype): FSDP padding (3 does not divide the 2048-row vocab
    # or 256-wide dims), FSDP x TP, pipeline (last stage) with bf16, EP x TP with bf16, HSDP
    # with experts under EP
    ("llama3", dict(dp_shard=3, world_size=3), 2, "float32"),
    ("llama3", dict(dp_shard=2, tp=2, world_size=4), 1, "float32"),
    ("llama3", dict(dp_shard=2, pp=2, world_size=4), 2, "bfloat16"),
    ("deepseek_v3", dict(dp_shard=2, tp=2, ep=2, world_size=4), 0, "bfloat16"),
    ("deepseek_v3", dict(dp_replicate=2, dp_shard=2, ep=2, world_size=4), 3, "float32"),
]


def _predicted(model, degrees, rank, dtype):
    d = validate_degrees(**degrees)
    job = Job(model, "debugmodel", d.world_size, 8, 64, 2 * d.dp_replicate * d.dp_shard, H100, param_dtype=dtype)
    choice = LayoutChoice(
        global_batch=job.global_batch, local_batch=2, seq_len=64, schedule="1F1B" if d.pp > 1 else None,
        n_microbatches=2 if d.pp > 1 else None, param_dtype=dtype,
    )  # fmt: skip
    return job, d, choice, memory_for_rank(job, d, choice, rank)


def test_training_state_memory_equals_the_real_sharded_model():
    """Predicted fp32 params (FSDP2's padded chunks), gradients (its padded reduce-scatter
    buffers) and AdamW states (unpadded local shards) per rank equal the bytes of the real
    sharded model after a step, and FSDP's per-group all-gather sizes equal FSDP2's own.

    Each layout is measured on a process of its own (its fake process group; DTensor caches
    that start empty, see tools/planner/measure.py), forked from tools/forkserver.py's server
    (tests/distributed/run_json.py): no new interpreter's imports per layout."""
    from tests.distributed.run_json import run_on_own_process
    from tools.planner.rank_memory import memory_parts, rank_context

    def measure(case):
        model, degrees, rank, dtype = case
        return run_on_own_process(
            "tools.planner.measure:measure_training_state", model, "debugmodel", degrees, rank, dtype
        )

    with ThreadPoolExecutor(2) as pool:
        measured = list(pool.map(measure, MEMORY_CASES))
    for (model, degrees, rank, dtype), got in zip(MEMORY_CASES, measured):
        job, d, choice, mem = _predicted(model, degrees, rank, dtype)
        case = f"{model} {degrees} rank {rank} {dtype}"
        # the state's bytes by kind (the terms of the peak phase hold the gradients only where
        # that phase has them: tools/planner/phases.py)
        parts = memory_parts(job, d, choice, rank_context(job, d, choice, rank))
        assert parts.params == got["params_bytes"], case
        assert parts.grads == got["grads_bytes"], case
        assert parts.optimizer == got["optimizer_bytes"], case
        assert mem["params"] == parts.params and mem["optimizer"] == parts.optimizer, case
        pb = 2 if dtype == "bfloat16" else 4
        gathered = sorted(
            r["bytes"] // pb
            for r in predict_collectives(model, "debugmodel", d, choice, rank, **job.overrides)
            if r["kind"] == "all_gather" and r["mesh"] in ("fsdp", "efsdp")
        )
        real = [n for n, size in got["fsdp_group_unsharded_numels"] if size > 1]
        # groups with identical sizes collapse into one record (with a count)
        assert sorted(set(gathered)) == sorted(set(real)), case


# --------------------------------------------------------------------------- activations
@pytest.mark.parametrize("model", ["llama3", "deepseek_v3", "qwen3"])
@pytest.mark.parametrize("ac", ["none", "selective", "full", "selective:2"])
def test_activation_estimate_matches_saved_tensors(model, ac):
    """Bytes held for the backward at the end of forward + loss (measured: storages created in
    the forward still alive, see tools/planner/measure.py) vs the analytic formula. "selective:2":
    selective AC's every-2nd-block option (llama3: blocks 0, 2, 4 of 6 fully checkpointed;
    deepseek_v3: the dense block 0 and the MoE block 2 of 3)."""
    _, args = model_inventory(model, "debugmodel")
    mode, _, option = ac.partition(":")
    every = int(option) if option else None
    for dtype, nbytes in (("float32", 4), ("bfloat16", 2)):
        measured = measure_activations(
            model, "debugmodel", 128, batch=2, ac_mode=mode, dtype=dtype, ac_option=option or "op"
        )["bytes"]
        predicted = activation_bytes(
            args, range(args.n_layers), 2, 128, act_bytes=nbytes, ac=mode, selective_every=every
        ).held
        assert abs(predicted - measured) <= 0.15 * measured, (dtype, predicted, measured)
        # in fact the formula is exact up to the RoPE rows the test's bf16 cast copies
        assert abs(predicted - measured) <= 0.01 * measured, (dtype, predicted, measured)


# --------------------------------------------------------------------------- ranking
def test_inter_node_tp_loses_to_intra_node_tp():
    job = Job("llama3", "8B", 16, 4, 4096, 32, H100)
    choice = LayoutChoice(global_batch=32, local_batch=1, seq_len=4096, ac="full")
    intra = estimate(job, validate_degrees(world_size=16, dp_shard=4, tp=4), choice)
    inter = estimate(job, validate_degrees(world_size=16, dp_shard=2, tp=8), choice)
    assert "tp" in inter.crosses_nodes and "tp" not in intra.crosses_nodes
    assert intra.tokens_per_s_per_gpu > inter.tokens_per_s_per_gpu
    assert losing_reason(inter, intra, job) == "tp communication across nodes"


def test_more_microbatches_shrink_the_bubble():
    job = Job("llama3", "8B", 16, 8, 4096, 64, H100)
    d = validate_degrees(world_size=16, dp_shard=4, pp=4)
    few = estimate(job, d, LayoutChoice(64, 4, 4096, "1F1B", 4, ac="full"))
    many = estimate(job, d, LayoutChoice(64, 16, 4096, "1F1B", 16, ac="full"))
    assert few.bubble_fraction == pytest.approx(3 / 7) and many.bubble_fraction == pytest.approx(3 / 19)
    assert many.time["bubble"] < few.time["bubble"]


def test_compute_is_the_busiest_ranks_flops():
    """Pipeline stages are uneven (the last also runs the output projection): the step waits for
    the busiest, and that is what the estimate's compute prices (FLOPs: test_planner_compute)."""
    from tools.planner.compute import rank_matmul_flops

    job = Job("llama3", "8B", 16, 8, 4096, 64, H100, efficiency=0.5)
    d = validate_degrees(world_size=16, dp_shard=4, pp=4)
    choice = LayoutChoice(64, 4, 4096, "1F1B", 4, ac="full")
    e = estimate(job, d, choice)
    first, last = (rank_matmul_flops("llama3", "8B", d, choice, r, **job.overrides) for r in (0, 12))
    assert last["forward"] > first["forward"]  # 8 layers each; the last stage adds the 128k-vocab head
    rate = H100.peak_flops("bfloat16") * 0.5
    assert e.time["compute"] == pytest.approx((last["forward"] + last["backward"]) / rate)
    assert e.time["recompute"] == pytest.approx(max(first["recompute"], last["recompute"]) / rate)


def test_the_search_leaves_layouts_that_do_not_fit_unpriced():
    job = Job("llama3", "70B", 8, 8, 8192, 64, H100)
    d = validate_degrees(world_size=8, dp_shard=8)
    choice = LayoutChoice(64, 8, 8192, ac="none")
    full, quick = estimate(job, d, choice), estimate(job, d, choice, time_if_oom=False)
    assert not full.fits and not quick.fits and quick.memory == full.memory and quick.time is None
    small = LayoutChoice(64, 1, 8192, ac="full")
    job8 = Job("llama3", "8B", 8, 8, 8192, 64, H100)
    fits = estimate(job8, d, small, time_if_oom=False)
    assert fits.fits and fits.time == estimate(job8, d, small).time


# --------------------------------------------------------------------------- command line
_DEBUG = ["--model", "llama3", "--flavor", "debugmodel", "--world-size", "8", "--gpus-per-node", "4",
          "--seq-len", "256", "--global-batch", "16"]  # fmt: skip


def test_hardware_without_overlap_exposes_every_data_parallel_collective():
    """A CPU profile (``comm_overlap`` false): FSDP's collectives are all on the critical path,
    where a GPU hides all but the first all-gather and the last reduce-scatter; and full AC's
    recomputation is priced at the profile's ``recompute_cost``."""
    import dataclasses

    d = validate_degrees(world_size=8, dp_shard=8)
    choice = LayoutChoice(64, 8, 4096, ac="full")
    gpu = estimate(Job("llama3", "8B", 8, 8, 4096, 64, H100), d, choice).time
    cpu_like = dataclasses.replace(H100, comm_overlap=False, recompute_cost=1.5)
    cpu = estimate(Job("llama3", "8B", 8, 8, 4096, 64, cpu_like), d, choice).time
    assert cpu["comm"] == gpu["comm"] and cpu["compute"] == gpu["compute"]
    assert gpu["comm_exposed_fsdp"] < 0.5 * gpu["comm"]["fsdp"]  # mostly hidden on the GPU
    assert cpu["comm_exposed_fsdp"] == pytest.approx(gpu["comm"]["fsdp"])
    assert cpu["recompute"] == pytest.approx(1.5 * gpu["recompute"]) and gpu["recompute"] > 0
    assert cpu["total"] == pytest.approx(
        cpu["compute"] + cpu["recompute"] + cpu["elementwise"] + cpu["comm_exposed_fsdp"] + cpu["comm_exposed_other"]
        + cpu["optimizer"]
    )  # fmt: skip
    assert gpu["tp_overhead"] == cpu["tp_overhead"] == 0.0  # no TP


def test_tp_and_cp_host_overheads_are_per_block_and_micro_batch():
    """``tp_block_overhead_s`` / ``cp_block_overhead_s`` (a CPU profile's): paid once per block
    of the busiest stage per micro-batch, and only under TP / CP."""
    import dataclasses

    hw = dataclasses.replace(H100, tp_block_overhead_s=0.01)
    job = Job("llama3", "8B", 16, 8, 4096, 64, hw)
    # 32 layers over pp 2: 16 blocks per stage; 4 micro-batches x 2 accumulation steps
    d = validate_degrees(world_size=16, dp_shard=4, tp=2, pp=2)
    choice = LayoutChoice(64, 8, 4096, "1F1B", 4, ac="full")
    t = estimate(job, d, choice).time
    assert t["tp_overhead"] == pytest.approx(0.01 * 16 * 4 * 2)
    no_tp = estimate(job, validate_degrees(world_size=16, dp_shard=8, pp=2), choice).time
    assert no_tp["tp_overhead"] == 0.0
    # cp_block_overhead_s: the same rule under CP, and only there
    hw = dataclasses.replace(H100, cp_block_overhead_s=0.02)
    job = Job("llama3", "8B", 16, 8, 4096, 64, hw)
    cp_tp = validate_degrees(world_size=16, dp_shard=2, cp=2, tp=2, pp=2)
    cp = estimate(job, cp_tp, choice).time
    # batch degree 2 (cp shares sequences, not batches): 4 accumulation steps of 4 micro-batches
    assert cp["cp_overhead"] == pytest.approx(0.02 * 16 * 4 * 4) and cp["tp_overhead"] == 0.0
    assert estimate(job, validate_degrees(world_size=16, dp_shard=8, pp=2), choice).time["cp_overhead"] == 0.0
    without = estimate(dataclasses.replace(job, hardware=H100), cp_tp, choice).time
    assert cp["total"] - without["total"] >= cp["cp_overhead"]  # busy time, and the bubble grows with it


def test_optimizer_step_is_priced_on_the_ranks_local_parameter_shards():
    """The per-parameter work streams 52 bytes per local (unpadded) parameter element at the
    memory bandwidth with bf16 compute (tools/planner/hardware.py STEP_BYTES_PER_PARAM): FSDP over 8 ranks pays an eighth of what replicas pay, replicas of tp 2
    half, and the time is in the step's total and its JSON."""
    import dataclasses

    from tools.planner.hardware import step_bytes_per_param

    hw = dataclasses.replace(H100, memory_gbps=100.0)
    job = Job("llama3", "8B", 8, 8, 4096, 64, hw)
    choice = LayoutChoice(64, 8, 4096, ac="full")
    replicas = estimate(job, validate_degrees(world_size=8, dp_replicate=8, dp_shard=1), choice)
    fsdp = estimate(job, validate_degrees(world_size=8, dp_shard=8), choice)
    replicas_tp = estimate(job, validate_degrees(world_size=8, dp_replicate=4, dp_shard=1, tp=2), choice)
    n_params = 8.03e9  # Llama 3 8B
    assert choice.param_dtype == "bfloat16" and step_bytes_per_param("bfloat16") == 52
    assert replicas.time["optimizer"] == pytest.approx(n_params * 52 / 100e9, rel=0.01)
    assert fsdp.time["optimizer"] == pytest.approx(replicas.time["optimizer"] / 8, rel=1e-3)
    # tp shards everything but the norms (a few thousand elements per layer)
    assert replicas_tp.time["optimizer"] == pytest.approx(replicas.time["optimizer"] / 2, rel=1e-3)
    assert fsdp.as_json()["step_time_s"]["optimizer"] == round(fsdp.time["optimizer"], 6)
    slower = estimate(
        dataclasses.replace(job, hardware=dataclasses.replace(hw, memory_gbps=50.0)), fsdp.degrees, choice
    )
    # half the bandwidth: twice the per-parameter and the elementwise time (the latter busy time,
    # behind which FSDP's collectives hide), both in the total
    assert slower.time["optimizer"] == pytest.approx(2 * fsdp.time["optimizer"])
    assert slower.time["elementwise"] == pytest.approx(2 * fsdp.time["elementwise"])
    t = slower.time
    assert t["total"] == pytest.approx(
        t["compute"] + t["recompute"] + t["elementwise"] + t["comm_exposed_fsdp"] + t["comm_exposed_other"]
        + t["optimizer"] + t["bubble"]
    )  # fmt: skip
    assert slower.time["total"] - fsdp.time["total"] >= fsdp.time["optimizer"]


def test_a_profile_scales_one_collective_kind():
    """``collective_bw_scale`` / ``collective_latency_us`` change the kind they name and no
    other; a profile naming an unknown kind is refused (exit 2 from the command line)."""
    import dataclasses

    from tools.planner.hardware import collective_seconds

    hw = dataclasses.replace(
        H100, collective_bw_scale={"reduce_scatter": 2.0}, collective_latency_us={"reduce_scatter": 50.0}
    )
    nbytes = 64 * 2**20
    ring_rs = collective_seconds("reduce_scatter", nbytes, 4, False, H100)
    moved = nbytes * 3 / 4 / (H100.intra_node_gbps * 1e9)
    assert collective_seconds("reduce_scatter", nbytes, 4, False, hw) == pytest.approx(ring_rs + moved + 50e-6)
    for kind in ("all_gather", "all_reduce", "send_recv"):
        assert collective_seconds(kind, nbytes, 4, False, hw) == collective_seconds(kind, nbytes, 4, False, H100)


@pytest.mark.parametrize(
    "profile, expected",
    [
        ({"collective_bw_scale": {"reduce_scater": 2.0}}, "must map collective kinds"),
        ({"collective_latency_us": {"all_gather": -1}}, "to numbers >= 0"),
    ],
)
def test_bad_collective_profile_exits_2(profile, expected, tmp_path, capsys):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile))
    assert planner_main([*_DEBUG, "--profile", str(path)]) == 2
    assert expected in capsys.readouterr().err


def test_benchmark_fits_the_per_kind_scales_it_was_given():
    """``benchmarks.planner._gloo_profile`` recovers the link, per-kind bandwidth factors and
    latencies from collective times generated with known ones."""
    import dataclasses

    from benchmarks.planner import GLOO_SIZES, _gloo_profile
    from tools.planner.hardware import collective_seconds

    truth = dataclasses.replace(
        H100,
        intra_node_gbps=1.5,
        intra_node_hop_us=200.0,
        base_latency_us=0.0,
        collective_bw_scale={"reduce_scatter": 2.5, "all_gather": 1.4, "send_recv": 0.3},
        collective_latency_us={"reduce_scatter": 150.0, "all_gather": 20.0, "send_recv": 0.0},
    )
    times = {
        (k, n): collective_seconds(k, n, 2, False, truth)
        for k in ("all_reduce", "reduce_scatter", "all_gather", "send_recv")
        for n in GLOO_SIZES
    }
    fit = _gloo_profile(times)
    assert fit["intra_node_gbps"] == pytest.approx(1.5)
    assert fit["intra_node_hop_us"] == pytest.approx(200.0)
    for kind, scale in truth.collective_bw_scale.items():
        assert fit["collective_bw_scale"][kind] == pytest.approx(scale)
        assert fit["collective_latency_us"][kind] == pytest.approx(truth.collective_latency_us[kind], abs=2.0)


def test_estimate_of_a_trainer_config_uses_what_the_trainer_resolves():
    """``estimate_from_config``: the config's layout, schedule, AC, dtypes and model overrides
    (here 2 of the flavor's 6 layers) as the trainer's job plan resolves them."""
    from tools.planner.from_config import estimate_from_config
    from trainer.config import load_config

    argv = ["--config", "llama3.toml", "--parallelism.tp", "2", "--parallelism.pp", "2", "--parallelism.dp_shard", "-1",
            "--parallelism.pipeline_parallel_schedule", "GPipe", "--activation_checkpoint.mode", "full",
            "--training.seq_len", "256", "--training.local_batch_size", "4", "--training.global_batch_size", "16"]  # fmt: skip
    two = estimate_from_config(load_config([*argv, "--model.n_layers", "2"]), 8, H100, tokenizer_vocab=2048)
    six = estimate_from_config(load_config(argv), 8, H100, tokenizer_vocab=2048)
    d, c = two.degrees, two.choice
    assert (d.dp_shard, d.tp, d.pp) == (2, 2, 2) and (c.schedule, c.ac, c.global_batch) == ("GPipe", "full", 16)
    job = Job("llama3", "debugmodel", 8, 8, 256, 16, H100, 0.5, c.param_dtype, c.reduce_dtype)
    assert estimate(job, d, c).time == six.time  # the flavor's depth: the plain estimate's
    assert two.memory["params"] < six.memory["params"] and two.time["compute"] < six.time["compute"]
    with pytest.raises(ValueError, match="tensor_parallel|tp"):
        estimate_from_config(load_config([*argv, "--parallelism.tp", "3"]), 8, H100, tokenizer_vocab=2048)


def test_estimate_of_an_fp32_config_prices_its_matmul_precision():
    """float32 runs at the IEEE fp32 peak, or the TF32 peak with training.enable_tf32; bf16 at
    its own (the compute term scales with the peak, nothing else changes)."""
    from tools.planner.from_config import estimate_from_config
    from trainer.config import load_config

    argv = ["--config", "llama3.toml", "--training.seq_len", "256", "--training.local_batch_size", "2"]
    fp32 = [*argv, "--parallelism.mixed_precision_param", "float32"]
    ieee = estimate_from_config(load_config(fp32), 8, H100, tokenizer_vocab=2048)
    tf32 = estimate_from_config(load_config([*fp32, "--training.enable_tf32", "true"]), 8, H100, tokenizer_vocab=2048)
    bf16 = estimate_from_config(
        load_config([*argv, "--parallelism.mixed_precision_param", "bfloat16"]), 8, H100, tokenizer_vocab=2048
    )
    assert ieee.time["compute"] / tf32.time["compute"] == pytest.approx(
        H100.peak_flops("tf32") / H100.peak_flops("float32")
    )
    assert tf32.time["compute"] > bf16.time["compute"]
    assert ieee.memory == tf32.memory


# CUDA device name -> (planner entry, memory GiB, memory GB/s): NVIDIA datasheet figures
HARDWARE_CASES = [
    ("NVIDIA H100 80GB HBM3", "h100", 80.0, 3350.0),
    ("NVIDIA H100 PCIe", "h100-pcie", 80.0, 2000.0),  # HBM2e, 2 TB/s (not the SXM's 3.35)
    ("NVIDIA H100 NVL", "h100-nvl", 94.0, 3900.0),
    ("NVIDIA H200", "h200", 141.0, 4800.0),
    ("NVIDIA H200 NVL", "h200-nvl", 141.0, 4800.0),
    ("NVIDIA A100-SXM4-80GB", "a100", 80.0, 2039.0),
    ("NVIDIA A100-SXM4-40GB", "a100", 40.0, 1555.0),
    ("NVIDIA A100 80GB PCIe", "a100-pcie", 80.0, 1935.0),
    ("NVIDIA A100-PCIE-40GB", "a100-pcie", 40.0, 1555.0),
    ("NVIDIA B200", "b200", 180.0, 8000.0),
]


@pytest.mark.parametrize(
    "device_name, entry, memory_gib, memory_gbps", HARDWARE_CASES, ids=[c[0] for c in HARDWARE_CASES]
)
def test_hardware_of_a_cuda_device_name(device_name, entry, memory_gib, memory_gbps):
    from tools.planner.hardware import gpu_names, hardware_for_device
    from trainer.reporting.metrics import peak_flops

    hw = hardware_for_device(device_name)
    assert entry in gpu_names() and hw.name == device_name
    assert (hw.memory_gib, hw.memory_gbps) == (memory_gib, memory_gbps)
    # the trainer's MFU figures for that exact part, per precision (float32 = IEEE, tf32 apart)
    for dtype in ("bfloat16", "float16", "tf32", "float32"):
        assert hw.peak_flops(dtype) == peak_flops(device_name, dtype), dtype
    assert load_hardware(entry).peak_flops("bfloat16") == hw.peak_flops("bfloat16")


@pytest.mark.parametrize("device_name", ["Tesla V100-SXM2-16GB", "NVIDIA L40S", "NVIDIA GH200 480GB", "NVIDIA H20"])
def test_hardware_of_a_gpu_the_planner_lacks(device_name):
    from tools.planner.hardware import hardware_for_device

    assert hardware_for_device(device_name) is None


def test_hardware_peak_by_precision():
    import dataclasses

    assert H100.peak_flops("bfloat16") == 989e12 and H100.peak_flops("float16") == 989e12
    assert H100.peak_flops("tf32") == 494.5e12 and H100.peak_flops("float32") == 67e12  # IEEE fp32
    # a measured profile that gives one fp32 rate (benchmarks/planner.py) serves tf32 too
    cpu = dataclasses.replace(H100, peak_flops_fp32=1e11, peak_flops_tf32=None)
    assert cpu.peak_flops("tf32") == cpu.peak_flops("float32") == 1e11
    with pytest.raises(ValueError, match="h100-pcie"):  # the error lists every entry
        load_hardware("h100-sxm")


@pytest.mark.parametrize(
    "schedule, pp, v, m",
    [("InterleavedZeroBubble", 2, 2, 2), ("InterleavedZeroBubble", 4, 2, 8), ("InterleavedZeroBubble", 2, 3, 4),
     ("ZBVZeroBubble", 2, 2, 2), ("ZBVZeroBubble", 4, 2, 6), ("ZBVZeroBubble", 8, 2, 16)],
)  # fmt: skip
def test_split_backward_rule_reads_the_same_compute_order_as_torchs_runtime(schedule, pp, v, m):
    """The planner builds torch's zero-bubble orders without the communication torch inserts
    (seconds per schedule in a search); each rank's compute actions are the runtime's."""
    from torch.distributed.pipelining.schedules import _ComputationType

    from tools.planner.schedule_order import schedule_order

    compute = {_ComputationType.FORWARD, _ComputationType.BACKWARD_INPUT, _ComputationType.BACKWARD_WEIGHT}

    def ops(order):
        return {r: [(a.computation_type, a.stage_index, a.microbatch_index) for a in acts
                    if a is not None and a.computation_type in compute] for r, acts in order.items()}  # fmt: skip

    cheap, runtime = schedule_order(schedule, pp, v, m), schedule_order(schedule, pp, v, m, comms=True)
    assert ops(cheap) == ops(runtime) and all(ops(cheap).values())


def test_json_fields():
    rc, out = _run([*_DEBUG, "--json", "--top", "3"])
    assert rc == 0
    info = json.loads(out)
    assert len(info["top"]) == 3 and info["layouts"] >= info["fitting"] > 0
    for e in info["top"]:
        assert set(e["degrees"]) >= {"dp_replicate", "dp_shard", "cp", "tp", "pp", "ep", "etp"}
        assert {"schedule", "ac", "fits", "tokens_per_s_per_gpu"} <= set(e)
        assert set(e["memory_gib"]) >= {"params", "grads", "optimizer", "activations", "total"}
        assert set(e["step_time_s"]) >= {"compute", "comm", "bubble", "total"}
        assert e["fits"]
    ranked = [e["tokens_per_s_per_gpu"] for e in info["top"]]
    assert ranked == sorted(ranked, reverse=True)
    assert info["losing_reasons"]


def test_text_output():
    """``python -m tools.planner`` (the old ``python -m parallel_dims plan`` forwards to it:
    tests/unit/test_moved_commands.py)."""
    rc, text = _run([*_DEBUG, "--top", "2"])
    assert rc == 0
    assert "layout plan: llama3/debugmodel on 8 x h100" in text
    assert "why the other layouts lost:" in text and "memory GiB:" in text and "crosses nodes" in text


def test_toml_round_trip(tmp_path):
    from trainer.plan import plan_job

    path = tmp_path / "winner.toml"
    rc, _ = _run([*_DEBUG, "--toml", str(path), "--top", "1"])
    assert rc == 0
    snippet = path.read_text()
    assert "[parallelism]" in snippet and "[activation_checkpoint]" in snippet
    cfg = _config_with(snippet, "llama3.toml", tmp_path)
    plan = plan_job(cfg, 8, tokenizer_vocab=2048)
    parsed = tomllib.loads(snippet)
    assert plan.parallel_dims.degrees.tp == parsed["parallelism"]["tensor_parallel_degree"]
    assert cfg.activation_checkpoint.mode == parsed["activation_checkpoint"]["mode"]


def test_nothing_fits_names_the_smallest_world_size():
    rc, out = _run([*_DEBUG, "--memory-gib", "6.008", "--reserve-gib", "6"])  # 8 MiB per GPU
    assert rc == 1
    assert "no layout of llama3/debugmodel fits 8 x h100" in out
    assert "the smallest world size that fits is" in out
    smallest = int(out.split("the smallest world size that fits is ")[1].split()[0])
    assert smallest > 8 and smallest % 4 == 0


@pytest.mark.parametrize(
    "flag, value, expected",
    [
        ("--model", "gpt2", "valid models: deepseek_v3, llama3, qwen3"),
        ("--gpu", "v100", "valid gpus: a100, a100-pcie, b200, h100, h100-nvl, h100-pcie, h200, h200-nvl"),
    ],
)
def test_bad_input_exits_2_with_the_choices(flag, value, expected, capsys):
    argv = list(_DEBUG)
    if flag in argv:
        argv[argv.index(flag) + 1] = value
    else:
        argv += [flag, value]
    assert planner_main(argv) == 2
    assert expected in capsys.readouterr().err


def test_benchmark_ranking_only_counts_pairs_separated_by_more_than_the_noise():
    from benchmarks.planner import _pairs

    def row(measured, noise, predicted):
        return {"measured_step_s": measured, "measured_noise_s": noise, "predicted_step_s": predicted}

    rows = {
        "a": row(1.00, 0.02, 0.70),
        "b": row(1.01, 0.03, 0.60),  # within a's and b's noise of a: unresolved, order ignored
        "c": row(1.30, 0.02, 0.65),  # clearly slower than a and b, predicted faster than a
    }
    inverted, unresolved = _pairs(rows)
    assert unresolved == [["a", "b"]]
    assert inverted == [["a", "c"]]  # b-c: predicted 0.60 < 0.65, right order
