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

Both sides run on ranks forked from tools/forkserver.py's server (``run_forked``): the "real
processes" are real gloo processes, one per rank, bitwise what torchrun starts
(tests/e2e/test_launcher.py); the local_tensor side is the one ``train.py`` process a user runs,
forked too. The math is the claim, not the launcher; the one-process refusals below are forked
as well (their claim is the message and exit code 2, which a forked rank gives through the same
exit path, trainer/lifecycle/shutdown.py; a fresh ``python train.py`` that stops on bad input is
tests/e2e/test_exit.py's). The models have 2 layers (``--model.n_layers 2``; deepseek_v3: 1 dense + 1
MoE layer): every parallel plan wraps and shards each block alike, so 2 blocks exercise every
collective of the 6-layer flavor (TP's per-block all-gathers and reduce-scatters, FSDP's per-block
all-gather and reduce-scatter, cp's per-block K/V all-gather, the MoE layer's all-to-alls); the
measured gaps below are from these 2-layer runs and are of the same order as the 6-layer ones.
"""

from __future__ import annotations

import shutil
import textwrap

import pytest

from .helpers import FAST, ROOT, _env, read_metrics, run_forked

pytestmark = pytest.mark.fake_backend  # the same torch floor (>= 2.13) as the fake backend

FP32_REDUCTION_ORDER = 1e-6
SMALL = ["--model.n_layers", "2"]  # module docstring


def _both(tmp_path, config: str, world: int, steps: int, *layout: str, said: list | None = None) -> tuple[dict, dict]:
    """The real processes' and the simulation's metrics (``said``: gets the simulation's stdout)."""
    args = ["--config", config, *FAST, *SMALL, "--training.steps", str(steps), "--checkpoint.enable", "false"]
    args += layout
    real = run_forked(world, *args, "--job.dump_folder", str(tmp_path / "real"))
    assert real.returncode == 0, real.stderr[-3000:]
    local = run_forked(
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
    if said is not None:
        said.append(local.stdout)
    return read_metrics(tmp_path / "real"), read_metrics(tmp_path / "local")


def test_tp_layout_is_bitwise_the_real_processes(tmp_path):
    """llama3 tp=2 on 2 simulated ranks: TP's sharded linears, sequence parallel and loss
    parallel. Every collective adds two terms, so the losses and grad norms are bitwise the
    2-process run's. 3 steps: the AdamW state of two steps carried into a third."""
    real, local = _both(tmp_path, "llama3.toml", 2, 3, "--parallelism.tp", "2")
    assert sorted(real) == sorted(local) == [1, 2, 3]
    for step in real:
        assert (local[step]["loss"], local[step]["grad_norm"]) == (real[step]["loss"], real[step]["grad_norm"]), step
    assert real[3]["loss"] < real[1]["loss"]  # it trained


def test_eight_rank_moe_layout_matches_the_real_processes(tmp_path):
    """deepseek_v3 tp=2 x ep=4 x etp=2 (dp_shard 4) on 8 simulated ranks: the uneven token
    all-to-all with real per-rank counts, the etp all-gather, expert FSDP. Within the fp32
    reduction-order tolerance of the module docstring.

    2 layers (1 dense + 1 MoE: the MoE layer holds every one of these collectives) and 2 steps
    (the second routes its tokens with the weights the first step's expert gradients updated).
    Measured on these 2-layer runs: the 8-rank sums round differently, as on 6 layers (grad norm
    9.8e-8 relative at step 1, bitwise at step 2; losses bitwise), 10x below the tolerance."""
    real, local = _both(
        tmp_path,
        "deepseek_v3.toml",
        8,
        2,
        "--parallelism.tp",
        "2",
        "--parallelism.ep",
        "4",
        "--parallelism.etp",
        "2",
    )
    assert sorted(real) == sorted(local) == [1, 2]
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
    within 6.0e-8 relative on these 2-layer runs (1.3e-7 on 6 layers: the step loss is summed
    over the 4 ranks of the loss mesh, in rank order here and in gloo's order there); checked
    with the fp32 reduction-order tolerance of the module docstring. Negative control, measured
    on the 2-layer runs: every simulated rank slicing cp chunk 0 of the batch moves the first
    loss from 8.0988 to 8.0587 on 4 ranks (5.0e-3 relative, ~5000x the tolerance) and from
    8.1032 to 8.0625 on 2 ranks (5.0e-3)."""
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
    r = run_forked(
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
    from trainer.simulation.local_tensor import PlainTensorInLocalMode, check_all_local, enter_local_tensor_mode

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


def test_a_plain_tensor_reaching_a_parameter_fails_loudly(tmp_path):
    """The guard the trainer runs after every optimizer step in local_tensor mode: parameters,
    gradients and AdamW state created in the mode pass (2 params + 2 grads + 4 moments), and a
    plain tensor made outside it (one value for every rank) is named. Run as a script in one
    process forked from the launcher's server (torch already imported; the mode is entered
    there, never in the pytest process)."""
    from tools.forkserver import run_train as run_script

    script = tmp_path / "guard.py"
    script.write_text(GUARD)
    r = run_script(1, [], env=_env(), cwd=ROOT, timeout=300, script=script)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "checked 8" in r.stdout, r.stdout
    assert (
        "refused: comm.mode = local_tensor: parameter bias (part 0) is a plain Parameter, not a LocalTensor" in r.stdout
    ), r.stdout


def _resume_from(tmp_path, name: str, source, nproc: int, args: list[str]) -> dict:
    """Copy checkpoint ``source`` into a fresh run folder ``name`` and run the job there: it
    resumes from that step. Returns the resumed steps' metrics."""
    (tmp_path / name / "checkpoint").mkdir(parents=True)
    shutil.copytree(source, tmp_path / name / "checkpoint" / source.name)
    r = run_forked(nproc, *args, "--job.dump_folder", str(tmp_path / name))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout and f"at step {source.name.split('-')[1]}" in r.stdout, r.stdout[-2000:]
    return read_metrics(tmp_path / name)


def test_checkpoints_resume_across_modes(tmp_path):
    """A checkpoint saved in local_tensor mode (full tensors, one writer) resumes on 4 real
    processes, and a checkpoint the real processes saved (sharded, 4 writers) resumes in
    local_tensor mode: llama3 tp=2 x dp_shard=2 (2 layers: each block's weights are sharded 2-D,
    TP x FSDP, as on 6), a save after every one of 3 steps. Across modes the resumed steps match
    the uninterrupted local run within the reduction-order tolerance; a local run resumed from
    its own checkpoint repeats it bitwise (same kernels, same order: the save and load round trip
    loses nothing). Each resume restores the weights, the AdamW moments, the lr schedule's step
    and the data position of a step that is neither the first nor the last."""
    args = ["--config", "llama3.toml", *FAST, *SMALL, "--training.steps", "3", "--checkpoint.interval", "1"]
    args += ["--checkpoint.keep_latest_k", "0"]
    args += ["--parallelism.tp", "2"]
    local = ["--comm.mode", "local_tensor", "--comm.fake_world_size", "4"]
    r = run_forked(1, *args, *local, "--job.dump_folder", str(tmp_path / "local"))
    assert r.returncode == 0, r.stderr[-3000:]
    ref = read_metrics(tmp_path / "local")
    saved = tmp_path / "local" / "checkpoint"
    assert sorted(p.name for p in saved.iterdir()) == ["step-1", "step-2", "step-3"]

    # local_tensor's step 1 -> real processes, steps 2..3
    real = _resume_from(tmp_path, "real", saved / "step-1", 4, args)
    assert sorted(real) == [2, 3]
    # the real processes' step 2 -> local_tensor, step 3
    back = _resume_from(tmp_path, "back", tmp_path / "real" / "checkpoint" / "step-2", 1, [*args, *local])
    assert sorted(back) == [3]
    for resumed in (real, back):
        for step, rec in resumed.items():
            for key in ("loss", "grad_norm"):
                gap = abs(rec[key] - ref[step][key]) / abs(ref[step][key])
                assert gap <= FP32_REDUCTION_ORDER, (step, key, rec[key], ref[step][key])

    # local_tensor's own step 2 -> local_tensor, step 3: bitwise
    again = _resume_from(tmp_path, "again", saved / "step-2", 1, [*args, *local])
    assert sorted(again) == [3]
    for step, rec in again.items():
        assert (rec["loss"], rec["grad_norm"]) == (ref[step]["loss"], ref[step]["grad_norm"]), step


def test_float8_moe_layout_is_bitwise_the_real_processes(tmp_path):
    """deepseek_v3 ep=2 with float8 linears and float8 routed experts (docs/float8.md) on 2
    simulated ranks: the experts' per-expert float8 GEMMs read each rank's group sizes on the
    host, so they run once per simulated rank (``per_rank_autograd``), each on its own tokens.
    Two ranks: bitwise the 2-process run (2 layers: the MoE layer's 1 routed-expert module and
    14 float8 linears; measured bitwise over both steps)."""
    real, local = _both(
        tmp_path, "deepseek_v3.toml", 2, 2, "--parallelism.ep", "2", "--model.converters", "float8,float8_experts"
    )
    assert sorted(real) == sorted(local) == [1, 2]
    for step in real:
        assert (local[step]["loss"], local[step]["grad_norm"]) == (real[step]["loss"], real[step]["grad_norm"]), step


def test_muon_on_fsdp_x_tp_matches_the_real_processes(tmp_path):
    """Muon (docs/optimizers.md) on dp_shard=2 x tp=2, 4 simulated ranks: each hidden matrix
    assembled whole over the FSDP and TP shards for Newton-Schulz. The real processes run
    round_robin (point-to-point to each matrix's owner rank), which one process cannot simulate;
    the simulation runs gather instead (its start-up line says so), the same update bitwise
    (tests/distributed/test_muon_round_robin.py). 3 steps: the momentum of two steps carried
    into a third. Measured bitwise (losses and grad norms, every step); asserted within the
    module's fp32 reduction-order tolerance, as the 4-rank layouts above."""
    said: list[str] = []
    layout = ("--parallelism.tp", "2", "--parallelism.dp_shard", "2", "--optimizer.name", "Muon")
    real, local = _both(tmp_path, "llama3.toml", 4, 3, *layout, said=said)
    assert sorted(real) == sorted(local) == [1, 2, 3]
    for step in real:
        print(step, {k: (real[step][k], local[step][k]) for k in ("loss", "grad_norm")})
        for key in ("loss", "grad_norm"):
            assert abs(local[step][key] - real[step][key]) <= FP32_REDUCTION_ORDER * abs(real[step][key]), (step, key)
    assert "muon_distribution = gather (the same update, bitwise)" in said[0]
