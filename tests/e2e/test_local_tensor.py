"""comm.mode = local_tensor (every rank of a layout in one process, real values) against the same
layout on real gloo processes, end to end through train.py on CPU.

Bitwise equality is asserted only on 2 ranks: every collective then adds two terms, and fp32
addition of two terms does not depend on their order. With more ranks, LocalTensor sums the
ranks in rank order and gloo in its ring order, so the fp32 sums may round differently: measured
on this machine (10 steps, FAST shapes, numbers in docs/fake_backend.md) up to 1.2e-7 relative
on the llama3 README matrix (fsdp=4, dp_replicate=2 x fsdp=2, tp=2 x fsdp=2, cp=2 x fsdp=2,
cp=2 x tp=2, dp_replicate=4) and 1.3e-7 for deepseek_v3 tp=2 x ep=4 x etp=2 on 8 ranks (some
4-rank layouts came out bitwise over 4-10 steps, which the order of a sum does not promise). The
tolerance below, 1e-6, is 8x the largest measured gap and far below what a wrong shard gives (a
rank reading another rank's batch slice or cp chunk changes the first loss by ~5e-3).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from .helpers import FAST, ROOT, _env, read_metrics, run_train

pytestmark = pytest.mark.fake_backend  # the same torch floor (>= 2.13) as the fake backend

FP32_REDUCTION_ORDER = 1e-6


def _both(tmp_path, config: str, world: int, steps: int, *layout: str) -> tuple[dict, dict]:
    args = ["--config", config, *FAST, "--training.steps", str(steps), "--checkpoint.enable", "false", *layout]
    real = run_train(world, *args, "--job.dump_folder", str(tmp_path / "real"))
    assert real.returncode == 0, real.stderr[-3000:]
    local = run_train(
        1,
        *args,
        "--comm.mode",
        "local_tensor",
        "--comm.fake_world_size",
        str(world),
        "--job.dump_folder",
        str(tmp_path / "local"),
    )
    assert local.returncode == 0, local.stderr[-3000:]
    assert f"all {world} ranks of the layout run in this one process" in local.stdout
    return read_metrics(tmp_path / "real"), read_metrics(tmp_path / "local")


def test_tp_layout_is_bitwise_the_real_processes(tmp_path):
    """llama3 tp=2 on 2 simulated ranks: TP's sharded linears, sequence parallel and loss
    parallel. Every collective adds two terms, so the losses and grad norms are bitwise the
    2-process run's."""
    real, local = _both(tmp_path, "llama3.toml", 2, 4, "--parallelism.tp", "2")
    assert sorted(real) == sorted(local) == [1, 2, 3, 4]
    for step in real:
        assert (local[step]["loss"], local[step]["grad_norm"]) == (real[step]["loss"], real[step]["grad_norm"]), step
    assert real[4]["loss"] < real[1]["loss"]  # it trained


def test_eight_rank_moe_layout_matches_the_real_processes(tmp_path):
    """deepseek_v3 tp=2 x ep=4 x etp=2 (dp_shard 4) on 8 simulated ranks: the uneven token
    all-to-all with real per-rank counts, the etp all-gather, expert FSDP. Within the fp32
    reduction-order tolerance of the module docstring."""
    real, local = _both(
        tmp_path,
        "deepseek_v3.toml",
        8,
        3,
        "--parallelism.tp",
        "2",
        "--parallelism.ep",
        "4",
        "--parallelism.etp",
        "2",
    )
    assert sorted(real) == sorted(local) == [1, 2, 3]
    for step in real:
        for key in ("loss", "grad_norm"):
            gap = abs(local[step][key] - real[step][key]) / abs(real[step][key])
            assert gap <= FP32_REDUCTION_ORDER, (step, key, local[step][key], real[step][key])


@pytest.mark.parametrize("world, mask", [(2, "causal"), (4, "block_causal")])
def test_context_parallel_layout_matches_the_real_processes(tmp_path, world, mask):
    """llama3 cp=2 (x dp_shard=2 on 4 ranks) simulated in one process: each cp rank's own
    load-balanced sequence chunks, RoPE positions and key prefixes (causal: rank 0's head chunk
    takes the is_causal kernel, every other chunk an explicit mask), the K/V all-gather, and for
    block_causal the token-id gather and per-rank document masks.

    cp=2 alone: every reduction has two terms, so losses and grad norms are bitwise the 2-process
    run's (measured bitwise, 3 steps). cp=2 x dp_shard=2: grad norms measured bitwise, losses
    within 1.3e-7 relative (the step loss is summed over the 4 ranks of the loss mesh, in rank
    order here and in gloo's order there); checked with the fp32 reduction-order tolerance of the
    module docstring. Negative control, measured: every simulated rank slicing cp chunk 0 of the
    batch moves the first loss from 8.1005 to 8.0594 (5e-3 relative, 5000x the tolerance)."""
    real, local = _both(tmp_path, "llama3.toml", world, 3, "--parallelism.cp", "2", "--model.attn_mask_type", mask)
    assert sorted(real) == sorted(local) == [1, 2, 3]
    for step in real:
        for key in ("loss", "grad_norm"):
            if world == 2:
                assert local[step][key] == real[step][key], (step, key, local[step][key], real[step][key])
            gap = abs(local[step][key] - real[step][key]) / abs(real[step][key])
            assert gap <= FP32_REDUCTION_ORDER, (step, key, local[step][key], real[step][key])
    assert real[3]["loss"] < real[1]["loss"]  # it trained


@pytest.mark.parametrize(
    "layout, words",
    [
        (["--parallelism.pp", "2"], "cannot simulate pipeline parallelism"),
        (["--compile.enable", "true"], "runs eagerly"),
        (["--parallelism.cp", "2", "--model.attn_type", "flex"], "with model.attn_type = 'flex'"),
    ],
)
def test_layouts_it_cannot_simulate_are_refused_in_one_line(tmp_path, layout, words):
    r = run_train(
        1,
        "--config",
        "llama3.toml",
        *FAST,
        "--comm.mode",
        "local_tensor",
        "--comm.fake_world_size",
        "4",
        *layout,
        "--job.dump_folder",
        str(tmp_path),
    )
    assert r.returncode == 2, r.stderr[-2000:]
    errors = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and words in errors[0] and "Traceback" not in r.stderr, r.stderr


GUARD = textwrap.dedent(
    """
    import torch
    from torch import nn
    from trainer.local_tensor import PlainTensorInLocalMode, check_all_local, enter_local_tensor_mode

    enter_local_tensor_mode(2)
    inside = nn.Linear(4, 4)  # created in the mode: every rank's own tensor
    inside(torch.ones(2, 4)).sum().backward()
    opt = torch.optim.AdamW(inside.parameters())
    opt.step()
    print("checked", check_all_local([inside], opt))
    from parallel_dims.torch_compat import host_side
    with host_side():
        outside = torch.zeros(4)
    inside.bias = nn.Parameter(outside)  # a plain tensor reaches a parameter
    try:
        check_all_local([inside], opt)
    except PlainTensorInLocalMode as exc:
        print("refused:", exc)
    """
)


def test_a_plain_tensor_reaching_a_parameter_fails_loudly():
    """The guard the trainer runs after every optimizer step in local_tensor mode: parameters,
    gradients and AdamW state created in the mode pass (2 params + 2 grads + 4 moments), and a
    plain tensor made outside it (one value for every rank) is named."""
    r = subprocess.run([sys.executable, "-c", GUARD], cwd=ROOT, capture_output=True, text=True, env=_env(), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "checked 8" in r.stdout, r.stdout
    assert (
        "refused: comm.mode = local_tensor: parameter bias (part 0) is a plain Parameter, not a LocalTensor" in r.stdout
    ), r.stdout


def test_checkpoints_resume_across_modes(tmp_path):
    """A checkpoint saved in local_tensor mode (full tensors, one writer) resumes on 4 real
    processes, and a checkpoint the real processes saved (sharded, 4 writers) resumes in
    local_tensor mode: llama3 tp=2 x dp_shard=2, a save every 2 of 6 steps. Across modes the
    resumed steps match the uninterrupted local run within the reduction-order tolerance; a
    local run resumed from its own checkpoint repeats it bitwise (same kernels, same order: the
    save and load round trip loses nothing)."""
    import shutil

    args = ["--config", "llama3.toml", *FAST, "--training.steps", "6", "--checkpoint.interval", "2"]
    args += ["--checkpoint.keep_latest_k", "0"]
    args += ["--parallelism.tp", "2"]
    local = ["--comm.mode", "local_tensor", "--comm.fake_world_size", "4"]
    r = run_train(1, *args, *local, "--job.dump_folder", str(tmp_path / "local"))
    assert r.returncode == 0, r.stderr[-3000:]
    ref = read_metrics(tmp_path / "local")
    assert sorted(p.name for p in (tmp_path / "local" / "checkpoint").iterdir()) == ["step-2", "step-4", "step-6"]

    # local_tensor's step 2 -> real processes, steps 3..6
    (tmp_path / "real" / "checkpoint").mkdir(parents=True)
    shutil.copytree(tmp_path / "local" / "checkpoint" / "step-2", tmp_path / "real" / "checkpoint" / "step-2")
    r = run_train(4, *args, "--job.dump_folder", str(tmp_path / "real"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout and "at step 2" in r.stdout
    real = read_metrics(tmp_path / "real")
    assert sorted(real) == [3, 4, 5, 6]

    # the real processes' step 4 -> local_tensor, steps 5..6
    (tmp_path / "back" / "checkpoint").mkdir(parents=True)
    shutil.copytree(tmp_path / "real" / "checkpoint" / "step-4", tmp_path / "back" / "checkpoint" / "step-4")
    r = run_train(1, *args, *local, "--job.dump_folder", str(tmp_path / "back"))
    assert r.returncode == 0, r.stderr[-3000:]
    back = read_metrics(tmp_path / "back")
    assert sorted(back) == [5, 6]
    for resumed in (real, back):
        for step, rec in resumed.items():
            for key in ("loss", "grad_norm"):
                gap = abs(rec[key] - ref[step][key]) / abs(ref[step][key])
                assert gap <= FP32_REDUCTION_ORDER, (step, key, rec[key], ref[step][key])

    # local_tensor's own step 4 -> local_tensor, steps 5..6: bitwise
    (tmp_path / "again" / "checkpoint").mkdir(parents=True)
    shutil.copytree(tmp_path / "local" / "checkpoint" / "step-4", tmp_path / "again" / "checkpoint" / "step-4")
    r = run_train(1, *args, *local, "--job.dump_folder", str(tmp_path / "again"))
    assert r.returncode == 0, r.stderr[-3000:]
    again = read_metrics(tmp_path / "again")
    assert sorted(again) == [5, 6]
    for step, rec in again.items():
        assert (rec["loss"], rec["grad_norm"]) == (ref[step]["loss"], ref[step]["grad_norm"]), step


def test_float8_moe_layout_is_bitwise_the_real_processes(tmp_path):
    """deepseek_v3 ep=2 with float8 linears and float8 routed experts (docs/float8.md) on 2
    simulated ranks: the experts' per-expert float8 GEMMs read each rank's group sizes on the
    host, so they run once per simulated rank (``per_rank_autograd``), each on its own tokens.
    Two ranks: bitwise the 2-process run."""
    real, local = _both(
        tmp_path, "deepseek_v3.toml", 2, 2, "--parallelism.ep", "2", "--model.converters", "float8,float8_experts"
    )
    assert sorted(real) == sorted(local) == [1, 2]
    for step in real:
        assert (local[step]["loss"], local[step]["grad_norm"]) == (real[step]["loss"], real[step]["grad_norm"]), step
