"""Pipeline parallelism (gloo) against a single-process reference on the same weights and batch.

Each layout runs one optimizer step: pipeline forward/backward over 4 micro-batches, loss summed
over pp and the loss mesh, grad norm over pp (trainer/grad_clip.py), clip, AdamW. Every rank
returns its stages' full (un-sharded) grads and updated weights by FQN; the test process merges
them and compares them, the loss and the norm with the unsplit model.

Tolerances (fp32). Loss and grad norm: 1e-5 relative (the brief's bar); measured <= 1e-6
(worst: 5e-7 loss with tp=2, 4e-7 norm). Gradients: 1e-5 of each tensor's largest entry;
measured <= 3.5e-6 (tp=2). Updated weights: 1e-6 absolute with lr 1e-3; measured <= 2.4e-7.
What differs from the reference is only summation order (micro-batch sums, reduce-scatters,
split matmuls); a wrong normalization or a lost micro-batch is O(1e-1) off.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models.parallel.pipeline import (
    SCHEDULES,
    bubble_fraction,
    build_pipeline_schedule,
    split_model,
    stage_indices_for_rank,
    stage_layer_ranges,
)
from models.registry import build_model
from tests.distributed.launcher import run_distributed
from tests.distributed.parallel_harness import SEED, _optimizer, make_batch, small_overrides

GLOBAL_BS, SEQ, N_MICROBATCHES, MAX_NORM = 8, 32, 4, 1.0
LOSS_RTOL = NORM_RTOL = 1e-5
GRAD_RTOL = 1e-5
WEIGHT_ATOL = 1e-6


def _overrides(model_name: str, n_layers: int) -> dict:
    return {**small_overrides(model_name), "n_layers": n_layers}


def _cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")


def _full(t: torch.Tensor):
    """Full value as a numpy array: tensors sent through the launcher's queue travel as shared
    memory handles that die with the sending process, arrays travel by value."""
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().numpy().copy()


def _pipeline_step_worker(rank, world_size, model_name, degrees, schedule, n_layers, opts_kwargs):
    import torch.distributed as dist

    from models.deepseek_v3.moe import moe_layers
    from models.parallel.pipeline import pipeline_step, sum_loss_over_pp
    from models.parallelize import ParallelizeOptions, check_model_fits_layout, parallelize_model
    from parallel_dims import ParallelDims
    from trainer.grad_clip import clip_grad_norm_, finalize_grads

    torch.manual_seed(0)
    pd = ParallelDims(world_size=world_size, **degrees)
    pd.build_mesh("cpu")
    opts = ParallelizeOptions(**opts_kwargs)
    meta = build_model(model_name, "debugmodel", device="meta", **_overrides(model_name, n_layers))
    check_model_fits_layout(meta.args, pd, seq_len=SEQ, sequence_parallel=opts.sequence_parallel)
    split = split_model(meta, pd, n_layers, None, schedule)
    for module in split.modules:
        parallelize_model(module, pd, opts)
        module.to_empty(device="cpu")
        module.init_weights(SEED)
    initial = {n: _full(p) for m in split.modules for n, p in m.named_parameters()}

    local_bs = GLOBAL_BS // pd.size("batch")
    pipe = build_pipeline_schedule(
        split.modules,
        split.stage_indices,
        pd,
        schedule,
        N_MICROBATCHES,
        _cross_entropy_sum,
        local_batch_size=local_bs,
        seq_len=SEQ,
        loss_parallel=pd.tp > 1 and opts.loss_parallel,
    )
    inputs, labels = make_batch(GLOBAL_BS, SEQ, meta.args.vocab_size)
    b = pd.coordinate("batch")
    inputs, labels = inputs[b * local_bs : (b + 1) * local_bs], labels[b * local_bs : (b + 1) * local_bs]
    local_loss = pipeline_step(pipe, inputs, labels, GLOBAL_BS * SEQ)
    loss = sum_loss_over_pp(local_loss, pd.get_optional_mesh("pp"))
    loss_mesh = pd.get_optional_mesh("loss")
    if loss_mesh is not None:
        dist.all_reduce(loss, group=loss_mesh.get_group())

    params = [p for m in split.modules for p in m.parameters()]
    finalize_grads(params)
    grads = {n: _full(p.grad) for m in split.modules for n, p in m.named_parameters()}
    norm = clip_grad_norm_(params, MAX_NORM, pd.get_optional_mesh("pp"))
    _optimizer(params).step()
    weights = {n: _full(p) for m in split.modules for n, p in m.named_parameters()}
    # routing counts of this rank's tokens per MoE layer (summed over batch ranks in the test)
    counts = {
        f"layer{moe_owner}": _full(moe.tokens_per_expert)
        for m in split.modules
        for moe_owner, moe in _moes_by_layer(m, moe_layers)
    }
    return {
        "pp_rank": pd.coordinate("pp"),
        "batch_rank": b,
        "tp_rank": pd.coordinate("tp"),
        "stage_indices": split.stage_indices,
        "loss": loss.item(),
        "norm": norm.item(),
        "initial": initial,
        "grads": grads,
        "weights": weights,
        "tokens_per_expert": counts,
    }


def _moes_by_layer(module, moe_layers):
    return [(k, b.moe) for k, b in module.layers.items() if getattr(b, "moe", None) is not None]


def _reference(model_name: str, n_layers: int) -> dict:
    """The unsplit model on one process: same seed, same global batch, same step."""
    torch.manual_seed(0)
    model = build_model(model_name, "debugmodel", device="cpu", **_overrides(model_name, n_layers))
    model.init_weights(SEED)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    inputs, labels = make_batch(GLOBAL_BS, SEQ, model.args.vocab_size)
    loss = _cross_entropy_sum(model(inputs), labels) / labels.numel()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    # float64 norm: the exact value both sides approximate
    norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters())).item()
    scale = min(1.0, MAX_NORM / (norm + 1e-6))
    for p in model.parameters():
        p.grad.mul_(scale)
    _optimizer(model.parameters()).step()
    counts = {
        f"layer{k}": b.moe.tokens_per_expert.clone()
        for k, b in model.layers.items()
        if getattr(b, "moe", None) is not None
    }
    return {
        "loss": loss.item(),
        "norm": norm,
        "initial": initial,
        "grads": grads,
        "weights": {n: p.detach().clone() for n, p in model.named_parameters()},
        "tokens_per_expert": counts,
    }


def _merge(results: list[dict], key: str) -> dict:
    """One copy of every FQN: from the batch-rank-0, tp-rank-0 member of each pp rank."""
    merged: dict = {}
    for r in results:
        if r["batch_rank"] == 0 and r["tp_rank"] == 0:
            overlap = set(merged) & set(r[key])
            assert not overlap, f"two pp ranks hold {sorted(overlap)}"
            merged.update({n: torch.from_numpy(a) for n, a in r[key].items()})
    return merged


def _compare(results: list[dict], ref: dict) -> dict:
    losses = {r["loss"] for r in results}
    norms = {r["norm"] for r in results}
    out = {
        "loss_rel": max(abs(v - ref["loss"]) / abs(ref["loss"]) for v in losses),
        "norm_rel": max(abs(v - ref["norm"]) / ref["norm"] for v in norms),
    }
    initial = _merge(results, "initial")
    grads = _merge(results, "grads")
    weights = _merge(results, "weights")
    assert sorted(weights) == sorted(ref["weights"]), "stages do not cover the model's parameters"
    out["initial_abs"] = max((initial[n] - ref["initial"][n]).abs().max().item() for n in initial)
    out["grad_rel"] = max(
        ((grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-12)).item()
        for n, g in ref["grads"].items()
    )
    out["weight_abs"] = max((weights[n] - w).abs().max().item() for n, w in ref["weights"].items())
    # AdamW's first update is lr * g / (|g| + eps): where |g| is near eps a grad that differs in
    # the 9th digit moves the weight by up to lr, so the weight check covers the elements whose
    # update is well conditioned: |clipped g| >= 1e-6 = 100 eps, or exactly 0 (embedding rows of
    # tokens not in the batch, where both sides apply weight decay only).
    scale = min(1.0, MAX_NORM / (ref["norm"] + 1e-6))
    conditioned = []
    for n, w in ref["weights"].items():
        g = (ref["grads"][n] * scale).abs()
        mask = (g >= 1e-6) | (g == 0)
        conditioned.append((weights[n] - w)[mask].abs().max().item() if mask.any() else 0.0)
        out.setdefault("ill_conditioned_fraction", []).append((~mask).float().mean().item())
    out["weight_abs_conditioned"] = max(conditioned)
    out["ill_conditioned_fraction"] = max(out["ill_conditioned_fraction"])
    if ref["tokens_per_expert"]:
        summed: dict = {}
        for r in results:
            if r["tp_rank"] == 0:
                for k, c in r["tokens_per_expert"].items():
                    summed[k] = summed.get(k, 0) + torch.from_numpy(c)
        assert sorted(summed) == sorted(ref["tokens_per_expert"])
        out["routing_counts_equal"] = all(
            torch.equal(summed[k], ref["tokens_per_expert"][k]) for k in summed
        )
    return out


def _check(report: dict) -> None:
    assert report["initial_abs"] == 0.0, report  # FQN-seeded init: stages equal the full model
    assert report["loss_rel"] < LOSS_RTOL, report
    assert report["norm_rel"] < NORM_RTOL, report
    assert report["grad_rel"] < GRAD_RTOL, report
    assert report["weight_abs_conditioned"] < WEIGHT_ATOL, report
    if "routing_counts_equal" in report:
        assert report["routing_counts_equal"], report


def _degrees(pp=2, dp_shard=1, tp=1, ep=1) -> dict:
    return dict(dp_replicate=1, dp_shard=dp_shard, cp=1, tp=tp, pp=pp, ep=ep, etp=1)


def _run(model_name, degrees, schedule, n_layers, **opts):
    world = 1
    for k in ("dp_replicate", "dp_shard", "cp", "tp", "pp"):
        world *= degrees[k]
    results = run_distributed(
        _pipeline_step_worker, world, model_name, degrees, schedule, n_layers, opts
    )
    report = _compare(results, _reference(model_name, n_layers))
    print(f"{model_name} {degrees} {schedule}: {report}")
    return report


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_pp2_schedules_match_reference(schedule):
    _check(_run("llama3", _degrees(), schedule, n_layers=4))


def test_pp2_fsdp2_matches_reference():
    _check(_run("llama3", _degrees(dp_shard=2), "1F1B", n_layers=4))


def test_pp2_tp2_matches_reference():
    _check(_run("llama3", _degrees(tp=2), "Interleaved1F1B", n_layers=4))


def test_deepseek_pp2_ep2_matches_reference():
    # ep folds over dp_shard; the counts check proves no stage routed garbage during set-up
    _check(_run("deepseek_v3", _degrees(dp_shard=2, ep=2), "1F1B", n_layers=4))


# ----------------------------------------------------------------------------- validation
class _FakePD:
    """Just the degrees split_model reads; validation happens before any process group."""

    def __init__(self, pp: int, rank: int = 0, cp: int = 1):
        self.pp, self.cp, self._rank = pp, cp, rank

    def coordinate(self, name: str) -> int:
        return self._rank


def _meta(n_layers: int = 4):
    return build_model("llama3", "debugmodel", device="meta", **_overrides("llama3", n_layers))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(schedule="Zigzag"), "legal schedules: GPipe, 1F1B, Interleaved1F1B"),
        (dict(n_layers=4, pp=4, schedule="Interleaved1F1B"), "n_layers=4 is fewer than the 8 pipeline stages"),
        (dict(split_points=[2, 1, 3], schedule="Interleaved1F1B"), "strictly increasing"),
        (dict(split_points=[0], schedule="1F1B"), "out of range"),
        (dict(split_points=["layers.4"], schedule="1F1B"), "out of range"),
        (dict(split_points=[1, 2], schedule="1F1B"), "make 3 stages"),
        (dict(split_points=["layer4"], schedule="1F1B"), "neither a layer index"),
        (dict(stages_per_rank=2, schedule="1F1B"), "use one of Interleaved1F1B"),
        (dict(stages_per_rank=1, schedule="Interleaved1F1B"), "use GPipe or 1F1B"),
        (dict(stages_per_rank=1, schedule="ZBVZeroBubble"), "exactly 2 stages per rank"),
        (dict(layers_per_stage=3, schedule="1F1B"), "does not divide n_layers=4"),
        (dict(layers_per_stage=1, schedule="1F1B"), "runs 1 stage(s) per rank"),
        (dict(pp=1), "pp=1"),
        (dict(n_layers=6), "the model has 4 layers"),
    ],
)
def test_split_validation(kwargs, message):
    pp = kwargs.pop("pp", 2)
    n_layers = kwargs.pop("n_layers", 4)
    model = _meta(min(n_layers, 4))
    with pytest.raises(ValueError, match=None) as info:
        split_model(model, _FakePD(pp), n_layers, **kwargs)
    assert message in str(info.value), str(info.value)


def test_split_layouts():
    # even split, extra layers to the middle, then first, then last stage
    assert stage_layer_ranges(4, 2) == [(0, 2), (2, 4)]
    assert stage_layer_ranges(6, 4) == [(0, 1), (1, 3), (3, 5), (5, 6)]
    assert stage_layer_ranges(3, 2) == [(0, 2), (2, 3)]
    assert stage_layer_ranges(5, 2, ["layers.1"]) == [(0, 1), (1, 5)]
    assert stage_indices_for_rank(1, 2, 4) == [1, 3]
    assert stage_indices_for_rank(0, 2, 4, "v") == [0, 3]
    # a stage owns exactly its layers and the ends, with the full model's FQNs
    split = split_model(_meta(4), _FakePD(2, rank=1), 4, None, "Interleaved1F1B")
    assert split.stage_indices == [1, 3] and split.num_stages == 4
    first, last = split.modules
    assert list(first.layers) == ["1"] and first.tok_embeddings is None and first.output is None
    assert list(last.layers) == ["3"] and last.norm is not None and last.output is not None
    split = split_model(_meta(4), _FakePD(2, rank=0), 4, None, "ZBVZeroBubble")
    assert split.stage_indices == [0, 3]
    assert split.modules[0].tok_embeddings is not None and split.modules[1].output is not None


def test_bubble_fraction():
    assert bubble_fraction("GPipe", 2, 4) == pytest.approx(1 / 5)
    assert bubble_fraction("Interleaved1F1B", 4, 8, 2) == pytest.approx(3 / 19)
    with pytest.raises(ValueError, match="legal schedules"):
        bubble_fraction("nope", 2, 4)


def _schedule_validation_worker(rank, world_size, cases):
    from parallel_dims import ParallelDims

    pd = ParallelDims(world_size=world_size, **_degrees())
    pd.build_mesh("cpu")
    messages = []
    for schedule, n_mb, local_bs in cases:
        split = split_model(_meta(4), pd, 4, None, schedule)
        for m in split.modules:
            m.to_empty(device="cpu")
            m.init_weights(SEED)
        try:
            build_pipeline_schedule(
                split.modules, split.stage_indices, pd, schedule, n_mb, _cross_entropy_sum,
                local_batch_size=local_bs, seq_len=SEQ,
            )
            messages.append(None)
        except ValueError as exc:
            messages.append(str(exc))
    return messages


def test_schedule_validation():
    cases = [
        ("1F1B", 3, 8),  # microbatches do not divide the local batch
        ("1F1B", 1, 8),  # 1F1B needs at least as many microbatches as stages
        ("Interleaved1F1B", 6, 12),  # rounds = 3 does not divide 6? it does: accepted
        ("Interleaved1F1B", 5, 10),  # rounds = 2 does not divide 5
        ("GPipe", 1, 8),  # GPipe runs any count
    ]
    messages = run_distributed(_schedule_validation_worker, 2, cases)[0]
    assert "legal microbatch counts: 1, 2, 4, 8" in messages[0]
    assert "needs n_microbatches >= the 2 pipeline stages" in messages[1]
    assert messages[2] is None
    assert "multiple of its rounds" in messages[3]
    assert messages[4] is None
