"""``optimizer.state_dtype = "bfloat16"`` through train.py (trainer/optim/low_precision.py): Llama 3
with 2 blocks, Muon for the hidden matrices and AdamW for the rest, two parameter groups, grad
clipping (the shipped max_norm = 1.0), 4 steps, checkpoints at 2 and 4.

- fsdp=2 against one process: the losses and grad norms within the layout tolerance of
  tests/e2e/test_train.py (rel 1e-5 / 1e-4); and the step-4 moments in the two checkpoints
  bitwise equal but for >= 99% of the elements. Why: the rounding bits hash each element's
  global index, so both runs round alike; only the gradients' fp32 reduction order differs
  (~1e-7 relative), which moves a value across a rounding threshold with probability about
  1e-7 / 2^-8 per element and step. Negative control: one process with float32 state, its
  step-4 moments rounded to bf16 (round-to-nearest), differ from the bf16 run's in > 20% of the
  elements (stochastic rounding of one draw is ~50% off the nearest).
- A resume from step 2 on fsdp=2: steps 3-4 bitwise the uninterrupted run.
- Across state dtypes (a cast, docs/optimizers.md): the float32 run's step-2 checkpoint resumes
  into bf16 state on fsdp=2 and the bf16 run's into float32 state; steps 3-4 within the layout
  tolerance of the run in the new dtype.
"""

from __future__ import annotations

import re

import pytest
import torch

from .helpers import FAST, read_metrics, run_forked
from .test_train import _copy_checkpoint, _near

GROUPS = "[{pattern = 'norm', lr_mult = 2.0}, {pattern = 'attention.wo', weight_decay = 0.0}]"
JOB = ["--config", "llama3.toml", *FAST, "--model.n_layers", "2", "--training.steps", "4",
       "--checkpoint.enable", "true", "--checkpoint.interval", "2", "--lr_scheduler.warmup_steps", "2",
       "--optimizer.name", "Muon", "--optimizer.param_groups", GROUPS]  # fmt: skip
BF16 = ["--optimizer.state_dtype", "bfloat16"]
MOMENTS = ("exp_avg", "exp_avg_sq", "momentum_buffer")


def _train(nproc: int, folder, *extra: str):
    res = run_forked(nproc, *JOB, "--job.dump_folder", str(folder), *extra)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    return res


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """fsdp=2 and one process with bf16 state; one process with float32 state (the control)."""
    base = tmp_path_factory.mktemp("bf16_state")
    out = {"fsdp": base / "fsdp", "single": base / "single", "fp32": base / "fp32"}
    res = _train(2, out["fsdp"], *BF16)
    assert "optimizer.state_dtype = bfloat16" in res.stdout, res.stdout[-3000:]
    out["log"] = {"fsdp": res.stdout, "single": _train(1, out["single"], *BF16).stdout}
    out["log"]["fp32"] = _train(1, out["fp32"]).stdout
    return out


def _moments(run, step: int) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = run / f"step{step}.pt"
    dcp_to_torch_save(run / "checkpoint" / f"step-{step}", path)
    sd = torch.load(path, weights_only=False)
    return {k: v for k, v in sd["optimizer"].items() if k.endswith(MOMENTS)}


def test_fsdp2_bf16_state_matches_one_process(runs):
    _near(read_metrics(runs["single"]), read_metrics(runs["fsdp"]), (1, 2, 3, 4), "bf16 state fsdp=2")
    a, b, ctl = _moments(runs["single"], 4), _moments(runs["fsdp"], 4), _moments(runs["fp32"], 4)
    assert a.keys() == b.keys() == ctl.keys() and len(a) > 10
    assert all(v.dtype == torch.bfloat16 for v in (*a.values(), *b.values()))
    assert all(v.dtype == torch.float32 for v in ctl.values())
    n = sum(v.numel() for v in a.values())
    same = sum(int((a[k] == b[k]).sum()) for k in a) / n
    control = sum(int((a[k] == ctl[k].to(torch.bfloat16)).sum()) for k in a) / n
    assert same >= 0.99, same
    assert control < 0.8, control


def _said_saving(log: str) -> int | None:
    """The bytes the start-up line says ``optimizer.state_dtype`` saves (trainer/forward.py)."""
    m = re.search(r"optimizer state in bfloat16: saves [\d.,]+ MiB \(([\d,]+) bytes\)", log)
    return int(m.group(1).replace(",", "")) if m else None


def test_startup_line_states_the_state_saving(runs):
    """The start-up memory line's bf16-state saving (counted before the optimizer exists) is the
    measured one: one process, the float32 bytes minus the bf16 bytes of the step-4 moments in
    its checkpoint, exactly; on fsdp=2 rank 0 holds at least half the elements (FSDP's first
    shards get the ceil rows) and at most all. Negative control: the float32 run says nothing."""
    moments = _moments(runs["single"], 4)
    measured = sum(v.numel() * (4 - v.element_size()) for v in moments.values())
    assert _said_saving(runs["log"]["single"]) == measured, runs["log"]["single"][-2000:]
    assert measured / 2 <= _said_saving(runs["log"]["fsdp"]) < measured
    assert _said_saving(runs["log"]["fp32"]) is None and "optimizer state in" not in runs["log"]["fp32"]


def test_bf16_state_resume_is_bitwise(runs, tmp_path):
    run = tmp_path / "resumed"
    _copy_checkpoint(runs["fsdp"], 2, run)
    res = _train(2, run, *BF16)
    assert f"resumed from {run / 'checkpoint'} at step 2" in res.stdout, res.stdout[-2000:]
    a, b = read_metrics(runs["fsdp"]), read_metrics(run)
    assert sorted(b) == [3, 4]
    for step in (3, 4):
        assert (b[step]["loss"], b[step]["grad_norm"]) == (a[step]["loss"], a[step]["grad_norm"]), step


def test_checkpoints_resume_across_state_dtypes(runs, tmp_path):
    """A float32 checkpoint into bf16 state (round-to-nearest cast) and a bf16 one into float32
    state (exact), both on fsdp=2: the state takes the new dtype, and steps 3-4 stay within the
    layout tolerance of the run they continue in the new dtype."""
    for src, extra, dtype, ref in (
        (runs["fp32"], BF16, torch.bfloat16, "fsdp"),
        (runs["fsdp"], [], torch.float32, "fp32"),
    ):
        run = tmp_path / f"into_{dtype}".replace("torch.", "")
        _copy_checkpoint(src, 2, run)
        res = _train(2, run, *extra)
        assert f"resumed from {run / 'checkpoint'} at step 2" in res.stdout, res.stdout[-2000:]
        assert all(v.dtype == dtype for v in _moments(run, 4).values())
        _near(read_metrics(runs[ref]), read_metrics(run), (3, 4), f"resume into {dtype}")
