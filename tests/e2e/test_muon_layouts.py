"""Muon (``optimizer.name = "Muon"``) with parameter groups through ``train.py`` on every layout
family: the one-process loss and grad-norm curves on Llama 3 over fsdp, tp, fsdp x tp,
dp_replicate x fsdp and pp and on DeepSeek-V3 over fsdp x ep and fsdp x tp x ep x etp
(``tools.compare_loss``, its DEFAULT tolerances, forked ranks, one launch per model); the
negative control (a Muon that orthogonalises each rank's shard on its own,
``MESHTRAIN_TEST_MUON_PER_SHARD=1``) failing that comparison; a resume bitwise on the same
layout and within tolerance on another; a changed grouping refused at resume with one line.

Shapes as tests/e2e/test_compare_loss.py's matrices (2 blocks: FSDP wraps each, pp=2 gets one
per stage, DeepSeek-V3 keeps a dense and a MoE block; seq_len 64, global batch 8, 3 steps:
step 3 is the first whose update reads two steps of carried momentum). Every run also carries
two parameter groups (norms at 2x lr, attention outputs without weight decay), so each layout
routes, shards and steps groups too. Measured (CPU, 2 cores): max rel loss diff <= 1.2e-7
(Llama and DeepSeek layouts) against the tolerance's 1e-5; the per-shard control diverges at
step 2 by 3.0e-4 (30x the tolerance).
"""

from __future__ import annotations

import json
import os

import pytest

from .helpers import FAST, read_metrics, run_compare_loss, run_forked
from .test_compare_loss import MATRIX, STEPS, _assert_all_agree, _explain
from .test_train import _copy_checkpoint, _near

GROUPS = "[{pattern = 'norm', lr_mult = 2.0}, {pattern = 'attention.wo', weight_decay = 0.0}]"
MUON = ["--optimizer.name", "Muon", "--optimizer.param_groups", GROUPS]
LLAMA_LAYOUTS = ["single", "fsdp=2", "tp=2", "tp=2,fsdp=2", "dp_replicate=2,fsdp=2", "pp=2"]
DEEPSEEK_LAYOUTS = ["single", "fsdp=2,ep=2", "fsdp=2,tp=2,ep=2,etp=2"]


def _compare(out, config, layouts, env=None):
    args = ["--config", config, "--steps", str(STEPS), "--out", str(out), "--timeout", "300", "--launcher", "fork"]
    if env:
        os.environ.update(env)
    try:
        return run_compare_loss(*args, "--layouts", *layouts, "--", *MATRIX, *MUON)
    finally:
        for k in env or {}:
            os.environ.pop(k)


def test_llama3_muon_layouts_match_one_process(tmp_path):
    """fsdp=2, tp=2, fsdp=2 x tp=2 (strided FSDP-over-TP shards), dp_replicate=2 x fsdp=2 and
    pp=2 give the one-process curves within compare_loss's default tolerance on every step."""
    out = tmp_path / "cmp"
    _assert_all_agree(_compare(out, "train_configs/llama3.toml", LLAMA_LAYOUTS), out, LLAMA_LAYOUTS)


def test_deepseek_v3_muon_layouts_match_one_process(tmp_path):
    """fsdp=2 x ep=2 (experts local: each rank orthogonalises its own experts) and
    fsdp=2 x tp=2 x ep=2 x etp=2 (expert matrices assembled over etp) match one process."""
    out = tmp_path / "cmp"
    _assert_all_agree(_compare(out, "train_configs/deepseek_v3.toml", DEEPSEEK_LAYOUTS), out, DEEPSEEK_LAYOUTS)


def test_negative_control_per_shard_muon_fails_the_comparison(tmp_path):
    """The easy wrong version: orthogonalising each shard separately. One process is unaffected
    (it holds whole matrices); fsdp=2 and tp=2 must be reported beyond tolerance (exit 1)."""
    out = tmp_path / "cmp"
    proc = _compare(
        out, "train_configs/llama3.toml", ["single", "fsdp=2", "tp=2"], {"MESHTRAIN_TEST_MUON_PER_SHARD": "1"}
    )
    assert proc.returncode == 1, _explain(proc)
    summary = json.loads((out / "summary.json").read_text())
    runs = {r["layout"]: r for r in summary["runs"]}
    for layout in ("fsdp=2", "tp=2"):
        assert runs[layout]["first_step_beyond"] is not None, runs[layout]
        assert runs[layout]["max_rel_diff"] > 10 * summary["rtol"], runs[layout]


# the resume job: 2 blocks, 4 steps, checkpoints at 2 and 4, Muon with the groups
RESUME_JOB = ["--config", "llama3.toml", *FAST, "--model.n_layers", "2", "--training.steps", "4",
              "--checkpoint.enable", "true", "--checkpoint.interval", "2", "--lr_scheduler.warmup_steps", "2",
              *MUON]  # fmt: skip


@pytest.fixture(scope="module")
def muon_reference(tmp_path_factory):
    """RESUME_JOB on fsdp=2 without interruption (saves step-2 and step-4)."""
    ref = tmp_path_factory.mktemp("muon_ref")
    res = run_forked(2, *RESUME_JOB, "--job.dump_folder", str(ref))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert "optimizer group default: Muon, 12 tensors" in res.stdout, res.stdout[-3000:]
    return ref


def test_muon_resume_is_bitwise_and_reshards(tmp_path, muon_reference):
    """Resumed from step 2 on the same layout: steps 3-4 bitwise the uninterrupted run (the
    momentum buffers and every group's AdamW moments restored); on tp=2 instead of fsdp=2:
    within rel 1e-5 (loss) and 1e-4 (grad norm), the buffers re-cut from FSDP to TP shards."""
    a = read_metrics(muon_reference)
    same, other = tmp_path / "same", tmp_path / "other"
    for folder, extra in ((same, []), (other, ["--parallelism.dp_shard", "1", "--parallelism.tp", "2"])):
        _copy_checkpoint(muon_reference, 2, folder)
        res = run_forked(2, *RESUME_JOB, "--job.dump_folder", str(folder), *extra)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
        assert f"resumed from {folder / 'checkpoint'} at step 2" in res.stdout, res.stdout[-2000:]
    b = read_metrics(same)
    assert sorted(b) == [3, 4]
    for step in (3, 4):
        assert (b[step]["loss"], b[step]["grad_norm"]) == (a[step]["loss"], a[step]["grad_norm"]), step
    _near(a, read_metrics(other), (3, 4), "Muon fsdp=2 -> tp=2")


def test_changed_grouping_at_resume_is_refused_unless_the_optimizer_is_reset(tmp_path, muon_reference):
    run = tmp_path / "regrouped"
    _copy_checkpoint(muon_reference, 2, run)
    regrouped = [*RESUME_JOB, "--optimizer.param_groups", "[{pattern = 'norm'}]", "--job.dump_folder", str(run)]
    res = run_forked(2, *regrouped)
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-3000:]
    errors = [line for line in res.stderr.splitlines() if line.startswith("error: ")]
    assert errors and "another parameter grouping" in errors[0] and "Traceback" not in res.stderr, res.stderr[-3000:]
    res = run_forked(2, *regrouped, "--checkpoint.exclude_from_loading", "optimizer")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert sorted(read_metrics(run)) == [3, 4]
