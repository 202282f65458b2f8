"""Proof that each parallel layout computes the single-process training step (tier 2, gloo).

Every layout runs one step (forward, backward, cross-mesh grad clipping, AdamW) on the global
batch of 8 x 32 tokens and is compared, on rank 0, with the unsharded model on one process from
the same seeded weights (tests/distributed/parallel_harness.py).

Tolerances, fp32. Only summation order differs from the reference (reduce-scatters over dp and
cp, split matmuls over tp, expert all-to-alls), so differences are round-off; a missing or
doubled reduction is O(1e-1) or worse. Measured maxima over all layouts below (CPU, 1 thread):

==============================  =========  =========  ==============================
quantity                        tolerance  measured   note
==============================  =========  =========  ==============================
loss, relative                  1e-6       9.2e-8
grad norm, relative             1e-6       9.2e-8
grads, max abs err / max |g|    5e-6       7.4e-7     per parameter tensor
updated weights, abs            5e-5       1.6e-5     = 1.6% of lr, see below
initial weights                 exact      0          seeded init after sharding
MoE routing counts              exact      exact      summed over all ranks
ranks agree (bit for bit)       exact      exact      loss, norm, full grads, weights
==============================  =========  =========  ==============================

Why the weight tolerance is so much looser than the gradient one: AdamW's first step moves each
weight by ``lr * g / (|g| + eps)`` (plus decay), i.e. about ``lr * sign(g)``. For an entry whose
gradient is within a few ``eps`` = 1e-8 of zero, a round-off change of the gradient that is tiny
relative to the tensor's largest entry still changes that weight's step by a percent of ``lr``
(1e-3). 5e-5 is 5% of lr: far below the ``2 * lr`` a wrong-signed or missing gradient gives.

Layouts of one world size and model share one launch (``parallel_steps``): a rank's imports
cost seconds, a layout's step a fraction of that. Only the layouts selected for this session
(e.g. with ``-k``) are run.
"""

from __future__ import annotations

import pytest

from tests.distributed.launcher import run_distributed
from tests.distributed.parallel_harness import full_degrees, parallel_steps, world_size_of

GLOBAL_BS, SEQ_LEN, MAX_NORM = 8, 32, 1.0
LOSS_RTOL = NORM_RTOL = 1e-6
GRAD_RTOL = 5e-6
WEIGHT_ATOL = 5e-5

# id -> (model, degrees). Default options: sequence parallel and loss parallel on whenever tp > 1.
LAYOUTS = {
    "llama3-fsdp4": ("llama3", dict(dp_shard=4)),
    "llama3-hsdp2x2": ("llama3", dict(dp_replicate=2, dp_shard=2)),
    "llama3-tp2": ("llama3", dict(tp=2)),
    "llama3-fsdp2-tp2": ("llama3", dict(dp_shard=2, tp=2)),
    "llama3-cp2": ("llama3", dict(cp=2)),
    "llama3-cp2-tp2": ("llama3", dict(cp=2, tp=2)),
    "llama3-ddp4": ("llama3", dict(dp_replicate=4)),
    "deepseek-fsdp4": ("deepseek_v3", dict(dp_shard=4)),
    "deepseek-tp2": ("deepseek_v3", dict(tp=2)),
    "deepseek-fsdp2-ep2": ("deepseek_v3", dict(dp_shard=2, ep=2)),
    "deepseek-fsdp4-ep2": ("deepseek_v3", dict(dp_shard=4, ep=2)),
    # ep folds over dp_shard x cp: experts are spread over ranks holding other sequence chunks
    "deepseek-fsdp2-cp2-ep4": ("deepseek_v3", dict(dp_shard=2, cp=2, ep=4)),
    "deepseek-fsdp2-tp2-ep2-etp2": ("deepseek_v3", dict(dp_shard=2, tp=2, ep=2, etp=2)),
    "deepseek-hsdp2x2-ep2": ("deepseek_v3", dict(dp_replicate=2, dp_shard=2, ep=2)),
}


def _group(layout_id: str) -> tuple[str, int]:
    model, degrees = LAYOUTS[layout_id]
    return model, world_size_of(degrees)


def _case(layout_id: str) -> tuple:
    model, degrees = LAYOUTS[layout_id]
    return (model, full_degrees(**degrees), {}, GLOBAL_BS, SEQ_LEN, MAX_NORM)


@pytest.fixture(scope="module")
def launch_results(request):
    """Runs each (model, world size) group of the layouts selected in this session in one
    launch, on first use; maps layout id -> per-rank results (or the launch's exception)."""
    selected = {
        item.callspec.params["layout_id"]
        for item in request.session.items
        if item.module is request.module and hasattr(item, "callspec")
    }
    cache: dict = {}

    def get(layout_id: str):
        if layout_id not in cache:
            group = [i for i in LAYOUTS if i in selected | {layout_id} and _group(i) == _group(layout_id)]
            try:
                per_rank = run_distributed(
                    parallel_steps, _group(layout_id)[1], [_case(i) for i in group]
                )
                for k, i in enumerate(group):
                    cache[i] = [r[k] for r in per_rank]
            except Exception as exc:  # every layout of the launch reports it
                cache.update({i: exc for i in group})
        if isinstance(cache[layout_id], Exception):
            raise cache[layout_id]
        return cache[layout_id]

    return get


def _worst(errors: dict[str, float], n: int = 3) -> str:
    top = sorted(errors.items(), key=lambda kv: -kv[1])[:n]
    return ", ".join(f"{name}={err:.2e}" for name, err in top)


@pytest.mark.parametrize("layout_id", list(LAYOUTS))
def test_layout_matches_single_process(layout_id, launch_results):
    per_rank = launch_results(layout_id)
    report = per_rank[0]
    assert report["names"], "parameter names differ from the unsharded model's"
    assert report["initial_abs_err"] == 0.0, "layouts must start from identical weights"
    assert report["loss_rel_err"] <= LOSS_RTOL, f"loss (parallel, reference) = {report['loss']}"
    assert report["norm_rel_err"] <= NORM_RTOL, f"grad norm (parallel, reference) = {report['norm']}"
    worst_grad = max(report["grad_rel_err"].values())
    assert worst_grad <= GRAD_RTOL, f"grad errors: {_worst(report['grad_rel_err'])}"
    worst_weight = max(report["weight_abs_err"].values())
    assert worst_weight <= WEIGHT_ATOL, f"updated-weight errors: {_worst(report['weight_abs_err'])}"
    assert report["routing_equal"], "MoE routing counts differ from the reference"
    digests = {r["fingerprint"] for r in per_rank}
    assert len(digests) == 1, "ranks disagree on loss, norm, full grads or updated weights"
