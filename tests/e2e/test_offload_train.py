"""CPU offload and activation offload through ``train.py`` (issue 53 items 2 and 3).

Four forked 2-rank runs of the llama3 debug model (2 blocks, seq_len 64, global batch 8, 3 steps):

* P: plain fsdp=2;
* O: fsdp=2 with ``training.cpu_offload`` (FSDP2's CPUOffloadPolicy on every unit, the optimizer
  stepping on the host shards) and ``activation_checkpoint.offload`` under full AC, checkpoint at
  step 2;
* R: O resumed from its step-2 checkpoint (DCP load into the offloaded parameters and the
  optimizer state on the host);
* T: tp=2 (activations are DTensors) with both offloads under per-op selective AC, whose kept
  outputs move too, within compare_loss's default tolerance (1e-5) of P: another layout sums in
  another order.

Asserted bitwise: O's loss and grad norm equal P's on every step, and R's step 3 equals O's.
Bitwise is the rule's case: on a CPU compute device the offloaded shards are the same tensors,
the same kernels run on the same shapes in the same order, and full AC recomputes each block
with the same kernels (the saved-tensor hooks only hold references; the copy round trip on a
real host copy is tests/unit/test_activation_offload.py). The start-up line says what the options
save. Nothing is refused: every layout tried on this CPU host ran bitwise equal with and without
CPU offload (docs/memory.md lists them); the predicted bytes are tests/unit/test_cpu_offload.py's.
"""

from __future__ import annotations

import shutil

import pytest

from .helpers import FAST, _env, read_metrics, run_forked

BASE = ["--config", "llama3.toml", *FAST, "--model.n_layers", "2", "--parallelism.dp_shard", "2"]
OFFLOAD = ["--training.cpu_offload", "true", "--activation_checkpoint.mode", "full"]
OFFLOAD += ["--activation_checkpoint.offload", "true"]


def _run(folder, steps, *extra):
    res = run_forked(2, *BASE, "--training.steps", str(steps), "--job.dump_folder", str(folder), *extra, env=_env())
    assert res.returncode == 0, f"{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
    return res, read_metrics(folder)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("offload")
    _, plain = _run(tmp / "plain", 3)
    ckpt = ["--checkpoint.enable", "true", "--checkpoint.interval", "2"]
    res, offloaded = _run(tmp / "offload", 3, *OFFLOAD, *ckpt)
    (tmp / "resume" / "checkpoint").mkdir(parents=True)
    shutil.copytree(tmp / "offload" / "checkpoint" / "step-2", tmp / "resume" / "checkpoint" / "step-2")
    _, resumed = _run(tmp / "resume", 3, *OFFLOAD, *ckpt)
    # tp=2 (DTensor activations) with per-op selective AC, whose kept outputs are offloaded too
    selective = ["--parallelism.dp_shard", "1", "--parallelism.tp", "2", "--activation_checkpoint.mode", "selective"]
    _, tp = _run(tmp / "tp", 3, *OFFLOAD, *selective)
    return {"plain": plain, "offload": offloaded, "resume": resumed, "tp": tp, "stdout": res.stdout}


def test_offload_curve_is_the_plain_curve(runs):
    plain, off = runs["plain"], runs["offload"]
    assert sorted(off) == [1, 2, 3]
    for step in (1, 2, 3):
        assert off[step]["loss"] == plain[step]["loss"], step
        assert off[step]["grad_norm"] == plain[step]["grad_norm"], step


def test_tp_selective_offload_follows_the_plain_curve(runs):
    """Another layout sums in another order: compare_loss's default tolerance (measured: 6e-8)."""
    for step in (1, 2, 3):
        assert runs["tp"][step]["loss"] == pytest.approx(runs["plain"][step]["loss"], rel=1e-5, abs=1e-5)
        assert runs["tp"][step]["grad_norm"] == pytest.approx(runs["plain"][step]["grad_norm"], rel=1e-5, abs=1e-5)


def test_offload_resumes_bitwise(runs):
    assert sorted(runs["resume"]) == [3]
    for key in ("loss", "grad_norm"):
        assert runs["resume"][3][key] == runs["offload"][3][key]


def test_startup_line_says_what_offload_saves(runs):
    from models.parallel.activation_offload import attention_input_bytes, block_input_bytes

    # fsdp=2: 2 blocks' inputs of 2 x 64 tokens x dim 256 in float32 per micro-batch, and the
    # RoPE rows [64, head_dim / 2 = 8, 2] in float32 once
    inputs = (block_input_bytes(2, 2, 64, 256) + attention_input_bytes((8, 2), 2, 64)) / 2**20
    lines = [line for line in runs["stdout"].splitlines() if line.startswith("memory: ")]
    assert len(lines) == 1, runs["stdout"][-2000:]
    assert "cpu_offload saves" in lines[0] and "optimizer state" in lines[0]
    assert f"activation offload saves {inputs:.1f} MiB (the blocks' inputs and RoPE rows) per micro-batch" in lines[0]
    # what the hooks counted in step 1 (rank 0): 2 micro-batches of 2 sequences per rank
    moved = 2 * (block_input_bytes(2, 2, 64, 256) + attention_input_bytes((8, 2), 2, 64))
    assert f"activation offload: step 1 moved {moved:,} bytes" in runs["stdout"], runs["stdout"][-2000:]
