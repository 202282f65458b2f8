"""LoRA is layout-invariant: ``python -m tools.compare_loss`` with ``model.converters = ["lora"]``
gives the one-process loss and grad norm on every step within the tool's DEFAULT tolerance (1e-5
loss, 1e-4 grad norm, relative), from one seed checkpoint (the frozen base).

* llama3: fsdp=2, tp=2 (adapters sharded like their column-/row-wise base), fsdp=2 x tp=2, pp=2,
  cp=2;
* deepseek_v3 with per-expert adapters (``lora.experts``): fsdp=2 x ep=2 (expert adapters split
  along the expert dimension with their weights), tp=2 (MLA's replicated low-rank projections
  with plain adapters next to column-/row-wise ones; the experts replicated over tp), tp=2 x etp=2
  (expert adapters split over etp like their weights' hidden dim, the other factor's gradient
  summed over etp; without that sum, measured once: grad norm 7.6e-3 away at step 1).

Shapes as tests/e2e/test_compare_loss.py's (2 blocks, seq_len 64, global batch 8, local 2, 3
steps: the adapters' B starts at zero, so step 1 trains B only, step 2 A too, and step 3 is the
first that reads carried optimizer state for both), forked ranks. Negative controls, one
single-process run each:
llama3 with lora.alpha 8 instead of 16 (the adapters' scale halved) and deepseek_v3 without the
expert adapters. Measured (CPU): every layout within 1.2e-7 relative loss and 1.1e-7 grad norm
(deepseek fsdp x ep: bitwise); the alpha control 1.6e-4 loss / 0.50 grad norm away, the
experts control 6.7e-5 / 2.3e-2 (the grad norm of step 1 misses the expert B gradients): the
controls are asserted beyond 10x the grad-norm tolerance and beyond the loss tolerance.
"""

from __future__ import annotations

import json

import pytest

from .helpers import read_metrics, run_compare_loss, run_forked

pytestmark = pytest.mark.e2e

STEPS = 3
COMMON = [
    "--training.seq_len",
    "64",
    "--training.global_batch_size",
    "8",
    "--training.local_batch_size",
    "2",
    "--metrics.enable_tensorboard",
    "false",
    "--model.n_layers",
    "2",
    "--model.converters",
    "lora",
]


def _compare(tmp_path, config: str, layouts: list[str], extra: list[str]) -> dict:
    out = tmp_path / "cmp"
    proc = run_compare_loss(
        "--config",
        f"train_configs/{config}",
        "--steps",
        str(STEPS),
        "--out",
        str(out),
        "--timeout",
        "300",
        "--launcher",
        "fork",
        "--layouts",
        *layouts,
        "--",
        *COMMON,
        *extra,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["passed"] and (summary["rtol"], summary["grad_norm_rtol"]) == (1e-5, 1e-4)
    assert len(summary["runs"]) == len(layouts)
    for run in summary["runs"]:
        assert run["status"] in ("ok", "baseline") and run["first_step_beyond"] is None, run
        print(f"{run['layout']:<20} rel loss {run['max_rel_diff']:.2e}  grad norm {run['grad_norm_max_rel_diff']:.2e}")
    return summary


def _beyond(tmp_path, config: str, baseline: dict, extra: list[str]) -> tuple[float, float]:
    """Largest relative (loss, grad norm) gaps over the steps of a one-process control run
    against the baseline."""
    out = tmp_path / "control"
    res = run_forked(
        1, "--config", config, *COMMON, "--training.steps", str(STEPS), "--metrics.log_freq", "1",
        "--job.dump_folder", str(out), *extra,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    m = read_metrics(out)
    rel = lambda key, s: abs(m[s][key] - baseline[s][key]) / abs(baseline[s][key])  # noqa: E731
    return max(rel("loss", s) for s in m), max(rel("grad_norm", s) for s in m)


def test_llama3_lora_layouts(tmp_path):
    layouts = ["single", "fsdp=2", "tp=2", "fsdp=2,tp=2", "pp=2", "cp=2"]
    summary = _compare(tmp_path, "llama3.toml", layouts, [])
    baseline = read_metrics(summary["runs"][0]["folder"])
    loss_gap, norm_gap = _beyond(tmp_path, "llama3.toml", baseline, ["--lora.alpha", "8"])
    print(f"control lora.alpha 8: rel loss {loss_gap:.2e}, grad norm {norm_gap:.2e}")
    assert loss_gap > 10 * 1e-5 and norm_gap > 10 * 1e-4, (loss_gap, norm_gap)


def test_deepseek_v3_expert_adapters_fsdp_ep(tmp_path):
    layouts = ["single", "fsdp=2,ep=2", "tp=2", "tp=2,etp=2"]
    summary = _compare(tmp_path, "deepseek_v3.toml", layouts, ["--lora.experts", "true"])
    baseline = read_metrics(summary["runs"][0]["folder"])
    loss_gap, norm_gap = _beyond(tmp_path, "deepseek_v3.toml", baseline, ["--lora.experts", "false"])
    print(f"control lora.experts false: rel loss {loss_gap:.2e}, grad norm {norm_gap:.2e}")
    assert loss_gap > 1e-5 and norm_gap > 10 * 1e-4, (loss_gap, norm_gap)
