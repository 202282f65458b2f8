"""bf16 takes effect on every layout: a census of the dtypes of the matmul-class ops of one real
training step (``Trainer.train_step``: forward, backward, clipping, AdamW) on CPU, where bf16
kernels exist.

A :class:`~trainer.instruments.matmul_census.MatmulCensus` dispatch mode sees every mm/addmm/bmm/_grouped_mm and
attention op after FSDP's parameter casts and adds up their FLOPs per dtype. With
``mixed_precision_param = "bfloat16"`` at least 99% of the matmul FLOPs must run in bf16 (the
measured share is 100%: every linear, attention core, router gate and expert GEMM, forward and
backward), and with float32 none may. The layouts are the ones where FSDP used to leave the
model in fp32 (one process, pure TP, PP-only, EP with TP), next to data-parallel ones (DDP-only,
FSDP, FSDP x EP), for both models.

Two layers of each model (DeepSeek: its dense layer and one MoE layer, so every op kind above
is in the census; FSDP wraps each block, a resharded one and the last), AdamW's fused kernel
(one op per parameter group: the step's optimizer costs DTensor's first-use sharding
propagation far less than the default foreach's ten per group, and has no matmul to count).
"""

from __future__ import annotations

import pytest
import torch

from tools.forkserver import run_distributed

MIN_BF16_SHARE = 0.99

LAYOUTS_2 = {
    "llama3": {
        "tp=2": {"tp": 2, "dp_shard": 1},
        "dp_replicate=2 (DDP)": {"dp_replicate": 2, "dp_shard": 1},
        "fsdp=2": {"dp_shard": 2},
        "pp=2": {"pp": 2, "dp_shard": 1},
    },
    "deepseek_v3": {
        "tp=2": {"tp": 2, "dp_shard": 1},
        "dp_replicate=2 (DDP)": {"dp_replicate": 2, "dp_shard": 1},
        "fsdp=2": {"dp_shard": 2},
        "fsdp=2,ep=2": {"dp_shard": 2, "ep": 2},
        "tp=2,ep=2": {"tp": 2, "dp_shard": 1, "ep": 2},
        "pp=2": {"pp": 2, "dp_shard": 1},
    },
}
DTYPES = ("bfloat16", "float32")


def _census(rank, world_size, cases, folder):
    """One Trainer per case; the census of its first training step."""
    from trainer.config import load_config
    from trainer.instruments.matmul_census import MatmulCensus
    from trainer.trainer import Trainer

    out = []
    for model, degrees, dtype in cases:
        args = [
            "--config", f"{model}.toml", "--job.dump_folder", folder,
            "--model.n_layers", "2",
            "--training.seq_len", "32", "--training.local_batch_size", "2",
            "--training.global_batch_size", "-1", "--training.steps", "2",
            "--checkpoint.enable", "false", "--metrics.enable_tensorboard", "false",
            "--parallelism.mixed_precision_param", dtype,
            "--optimizer.implementation", "fused",
        ]  # fmt: skip
        for name, value in degrees.items():
            args += [f"--parallelism.{name}", str(value)]
        trainer = Trainer(load_config(args))
        microbatches = trainer.data.next_step()
        with MatmulCensus() as census:
            trainer.train_step(microbatches)
        out.append(
            {
                "bf16": census.share(torch.bfloat16),
                "fp32": census.share(torch.float32),
                "gflops": census.total_flops / 1e9,
                "ops": sorted({name for name, _ in census.calls}),
                "calls": {f"{n}/{d}": c for (n, d), c in census.calls.items()},
            }
        )
    return out


@pytest.fixture(scope="module")
def census(tmp_path_factory):
    """(model, layout, dtype) -> the census of every rank's step."""
    folder = str(tmp_path_factory.mktemp("census"))
    results = {}
    single = [(m, {"dp_shard": 1}, d) for m in LAYOUTS_2 for d in DTYPES]
    for case, r in zip(single, run_distributed(_census, 1, single, folder)[0]):
        results[(case[0], "single", case[2])] = [r]
    keys = [(m, name, d) for m, layouts in LAYOUTS_2.items() for name in layouts for d in DTYPES]
    cases = [(m, LAYOUTS_2[m][name], d) for m, name, d in keys]
    per_rank = run_distributed(_census, 2, cases, folder, timeout=900)
    for i, key in enumerate(keys):
        results[key] = [r[i] for r in per_rank]
    return results


ALL = [(m, name) for m, layouts in LAYOUTS_2.items() for name in ["single", *layouts]]


@pytest.mark.parametrize("model,layout", ALL)
def test_bf16_is_applied_on_every_layout(census, model, layout):
    for rank, r in enumerate(census[(model, layout, "bfloat16")]):
        ops = set(r["ops"])
        assert {"mm", "addmm"} & ops, f"rank {rank}: the census saw no linear layers: {r}"
        # attention: a fused SDPA kernel, or (MLA's unequal q/v head dims on CPU) its math
        # fallback's batched matmuls
        assert {"bmm", "baddbmm"} & ops or any("attention" in op for op in ops), (
            f"rank {rank}: no attention matmuls: {ops}"
        )
        if model == "deepseek_v3" and layout != "pp=2":
            assert "_grouped_mm" in ops, f"rank {rank}: routed experts not on grouped GEMMs: {ops}"
        assert r["bf16"] >= MIN_BF16_SHARE, f"rank {rank}: bf16 share of matmul FLOPs {r['bf16']:.4f}: {r['calls']}"


@pytest.mark.parametrize("model,layout", ALL)
def test_fp32_stays_fp32(census, model, layout):
    for rank, r in enumerate(census[(model, layout, "float32")]):
        assert r["gflops"] > 0, f"rank {rank}: nothing counted"
        assert r["bf16"] == 0.0 and r["fp32"] == 1.0, f"rank {rank}: {r['calls']}"
