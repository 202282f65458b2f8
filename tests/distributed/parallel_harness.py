"""One training step under a layout vs a single-process reference on the same weights/batch.

Used by the model-parallelism proof tests. Rank 0 computes the reference itself (the debug models
are tiny, and the reference is cached per process), so only small summaries travel back to the
test process: float errors, and per-rank fingerprints that prove every rank ends the step with
bit-identical full weights.

What is compared, and why each catches something different:

* initial weights: every layout must start from the same weights (seeded init after sharding);
* loss: reduced over ``loss`` and divided by the global token count;
* grads, before clipping: a missing or doubled reduction (over dp, cp, tp or the expert meshes)
  shows up as a factor of 2 or a partial sum in some parameter;
* grad norm: the cross-mesh norm of :mod:`trainer.optim.grad_clip`;
* updated weights after clipping and AdamW: the optimizer sees the right shards and grads;
* MoE routing counts summed over all ranks: every token is routed exactly once, to the same
  experts as in the reference. Compared exactly (integers): the reference's smallest top-k gap
  is checked to be far above the router scores' round-off (``ROUTING_MIN_MARGIN``), so no
  layout can route a token differently by rounding alone.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import warnings

import torch
import torch.nn.functional as F

from models.common.sequence import load_balanced_shard
from models.parallel.tensor_parallel import loss_parallel_context
from models.parallelize import parallelize_model
from parallel_dims.axes import AXES, DEGREE_NAMES
from trainer.config import load_config
from trainer.optim.grad_clip import clip_grad_norm_, finalize_grads
from trainer.plan import JobPlan, plan_job

SEED = 1234
LR = 1e-3

# fp32 tolerances of a layout's step against the reference. Only summation order differs, so
# the errors are round-off (measured maxima in tests/distributed/test_parallelize_equivalence.py
# are 3x (weights) to 14x (loss) below these); a missing or doubled reduction is O(1e-1) or worse.
LOSS_RTOL = NORM_RTOL = 1e-6
GRAD_RTOL = 5e-6  # per tensor: max abs error / max |reference grad|
# AdamW's first step moves a weight by about lr * g / (|g| + eps): for an entry whose grad is
# within a few eps (1e-8) of zero, round-off that is tiny relative to the tensor's largest grad
# still changes the step by a percent of lr (1e-3). 5e-5 = 5% of lr, far below the 2 * lr of a
# wrong-signed or missing gradient.
WEIGHT_ATOL = 5e-5
# Routing is a discrete choice on float32 router scores: a layout routes a token differently
# from the reference only if round-off moves a score across the token's top-k boundary. So the
# exact comparison of routing counts is sound only where the reference's smallest gap between
# the last candidate a token picks and the best one it drops (experts, and groups under
# group-limited routing) is far above the scores' round-off. The sigmoid scores of the float32
# reference forward are within 5.7e-8 of the same model run in float64 (RoPE rotates in float32
# either way) on every MoE layer of the harness models: the scores lie in (0, 1), so that is
# about one float32 ulp, and two float32 layouts, each that close to exact math, are within
# ~1.2e-7 of each other. ROUTING_MIN_MARGIN = 1e-6 is 8x that, checked on every run (the
# smallest gaps of the harness batches: 2.2e-4 on the 3-layer model here, 1.2e-5 on
# test_pipeline's 4-layer one). The floor is kept near the real risk on purpose: the weights
# come from torch's seeded normal_, whose values depend on the CPU kernel torch picks (measured:
# AVX2 and ATEN_CPU_CAPABILITY=default draw different weights from the same seed), so another
# machine can draw other weights and other gaps; a higher floor would fail batches that cannot flip. A batch
# below it fails with a message naming the cause (change SEED), not as a wrong comparison.
# A wrong dispatch moves whole tokens: a count off by >= 1.
ROUTING_MIN_MARGIN = 1e-6


VOCAB = 512
# The EOS id the harness's "tokenizer" reports (the trainer sets the model's eos_id from the
# tokenizer): it ends each packed document under --model.attn_mask_type block_causal. 1 is also
# the shipped tokenizer's EOS.
EOS = 1


def small_layers(model_name: str) -> int:
    return 2 if model_name == "llama3" else 3


def harness_plan(
    model_name: str,
    degrees: dict,
    global_bs: int,
    seq_len: int,
    opts_kwargs: dict | None = None,
    *,
    n_layers: int | None = None,
    local_bs: int | None = None,
    config: tuple[str, ...] = (),
) -> JobPlan:
    """The trainer's job plan (:func:`trainer.plan.plan_job`) of one harness case: the same
    validation, degrees, model args (``debugmodel`` with ``n_layers`` layers and a 512-token
    vocabulary) and parallelize options as a real run of that config. ``local_bs`` defaults to
    the whole per-rank slice (no accumulation); ``opts_kwargs`` are ParallelizeOptions fields
    on top of the config's; ``config`` adds ``--section.key value`` arguments."""
    d = full_degrees(**degrees)
    batch_degree = d["dp_replicate"] * d["dp_shard"]
    argv = [
        *("--model.name", model_name, "--model.flavor", "debugmodel"),
        *("--model.n_layers", str(n_layers or small_layers(model_name)), "--model.vocab_size", str(VOCAB)),
        *("--training.seq_len", str(seq_len), "--training.global_batch_size", str(global_bs)),
        *("--training.local_batch_size", str(local_bs or global_bs // batch_degree)),
        *config,
    ]
    for axis in AXES:
        argv += [f"--parallelism.{axis.name}", str(d[axis.name])]
    plan = plan_job(load_config(argv), world_size_of(degrees), tokenizer_vocab=VOCAB, tokenizer_eos=EOS)
    if opts_kwargs:
        plan = dataclasses.replace(plan, parallelize=dataclasses.replace(plan.parallelize, **opts_kwargs))
    return plan


def full_degrees(**degrees: int) -> dict:
    """All seven degrees, the unnamed ones 1 (never -1: the world size must be explicit)."""
    unknown = set(degrees) - set(DEGREE_NAMES)
    if unknown:
        raise ValueError(f"unknown degrees {sorted(unknown)}; valid: {DEGREE_NAMES}")
    return {n: degrees.get(n, 1) for n in DEGREE_NAMES}


def world_size_of(degrees: dict) -> int:
    d = full_degrees(**degrees)
    return d["dp_replicate"] * d["dp_shard"] * d["cp"] * d["tp"] * d["pp"]


def make_batch(global_bs: int, seq_len: int, vocab: int):
    g = torch.Generator().manual_seed(SEED + 1)
    tokens = torch.randint(0, vocab, (global_bs, seq_len + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def make_packed_batch(global_bs: int, seq_len: int, vocab: int, mean_doc_len: int = 8):
    """:func:`make_batch` with EOS at seeded positions instead (none elsewhere): rows of packed
    documents, 1 to 2 * mean_doc_len - 1 tokens long, cut by the row edges like the trainer's
    windows, so block-causal masking has several documents per row to keep apart."""
    inputs, labels = make_batch(global_bs, seq_len, vocab)
    tokens = torch.cat([inputs, labels[:, -1:]], dim=1)
    tokens[tokens == EOS] = EOS + 1
    g = torch.Generator().manual_seed(SEED + 2)
    for row in tokens:
        pos = int(torch.randint(0, mean_doc_len, (1,), generator=g))
        while pos < row.numel():
            row[pos] = EOS
            pos += int(torch.randint(1, 2 * mean_doc_len, (1,), generator=g))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _optimizer(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1, foreach=False)


def adamw_step(params) -> None:
    """One step of :func:`_optimizer` on ``params`` (with their grads), run on each DTensor's
    local shard: the per-element update DTensor's dispatch would run on that shard, bit for bit
    (AdamW is elementwise; a grad whose placements differ from its parameter's is first
    redistributed to them, as that dispatch would), without its cost: sharding propagation of
    every optimizer op on every new mesh was about half of a layout's step on the CPU. The
    trainer's optimizer on DTensors is proven by the trainer-based tests (tests/e2e compare_loss,
    tests/unit/test_optim.py)."""
    from torch.distributed.tensor import DTensor

    shards = []
    for p in params:
        if p.grad is None:
            continue
        grad = p.grad
        if isinstance(p, DTensor):
            if grad.device_mesh != p.device_mesh or grad.placements != p.placements:
                grad = grad.redistribute(p.device_mesh, p.placements)
            p, grad = p._local_tensor, grad._local_tensor
        shard = p.detach()  # the same storage: the update lands in the parameter
        shard.grad = grad.detach()
        shards.append(shard)
    _optimizer(shards).step()


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _routing_counts(model) -> dict[str, torch.Tensor]:
    return {
        name: block.moe.tokens_per_expert.detach().clone()
        for name, block in model.layers.items()
        if getattr(block, "moe", None) is not None
    }


def routing_margin(router, scores: torch.Tensor, expert_bias: torch.Tensor | None, selected: torch.Tensor) -> float:
    """Smallest gap, over the tokens of one router call, between the last candidate a token
    picks and the best one it drops, in the router's own selection values (scores plus the
    balancing bias): for the kept groups under group-limited routing, then for the experts.
    ``selected`` (the router's picks) guards this copy of the router's rule against drift."""
    with torch.no_grad():
        choice = scores if expert_bias is None else scores + expert_bias.float()
        gaps = []
        if router.num_limited_groups < router.num_groups:
            grouped = choice.view(choice.shape[0], router.num_groups, -1)
            if router.score_func == "sigmoid":
                group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
            else:
                group_scores = grouped.amax(dim=-1)
            top = group_scores.topk(router.num_limited_groups + 1, dim=-1).values
            gaps.append((top[:, -2] - top[:, -1]).min().item())
            choice = router._mask_groups(choice)
        if router.top_k < choice.shape[-1]:
            top = choice.topk(router.top_k + 1, dim=-1)
            gaps.append((top.values[:, -2] - top.values[:, -1]).min().item())
            same = torch.equal(top.indices[:, :-1].sort(dim=-1).values, selected.sort(dim=-1).values)
            if not same and min(gaps) > 0:  # (with a tie either pick is right)
                raise RuntimeError("routing_margin no longer reproduces TokenChoiceRouter's selection")
    return min(gaps, default=float("inf"))


def record_routing_margins(model) -> list[float]:
    """Hooks every MoE router of ``model``: each router call appends its :func:`routing_margin`
    to the returned list."""
    margins: list[float] = []

    def hook(router, args, output):
        _, selected, scores = output
        margins.append(routing_margin(router, scores, args[1] if len(args) > 1 else None, selected))

    for block in model.layers.values():
        if getattr(block, "moe", None) is not None:
            block.moe.router.register_forward_hook(hook)
    return margins


def _call_counter(modules) -> dict[str, int]:
    """Counts forward calls of ``modules``. For attention: n_layers per step, plus one per
    block that activation checkpointing recomputes in backward (its forward runs again)."""
    calls = {"n": 0}

    def hook(*_):
        calls["n"] += 1

    for module in modules:
        module.register_forward_pre_hook(hook)
    return calls


@functools.lru_cache(maxsize=4)
def reference_step(model_name: str, global_bs: int, seq_len: int, max_norm: float) -> dict:
    """The unsharded model on one process. Cached: several layouts of one launch share it
    (callers only read the result)."""
    torch.manual_seed(0)
    plan = harness_plan(model_name, {}, global_bs, seq_len)
    with torch.device("cpu"):
        model = plan.model.model_cls(plan.model_args)
    model.init_weights(SEED)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    inputs, labels = make_batch(global_bs, seq_len, model.args.vocab_size)
    margins = record_routing_margins(model)
    logits = model(inputs)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum") / labels.numel()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    # float64 norm: torch's float32 clip_grad_norm_ is itself ~3e-6 off on these models
    norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters()))
    scale = min(1.0, max_norm / (norm.item() + 1e-6))
    for p in model.parameters():
        p.grad.mul_(scale)
    adamw_step(model.parameters())
    return {
        "loss": loss.item(),
        "norm": norm.item(),
        "initial": initial,
        "grads": grads,
        "weights": {n: p.detach().clone() for n, p in model.named_parameters()},
        "routing": _routing_counts(model),
        "routing_margin": min(margins, default=None),
    }


def build_layout_model(plan: JobPlan):
    """The plan's model built on meta, parallelized with its options, then materialized on CPU
    with the harness's seeded, layout-independent init (the mesh must be built already)."""
    with torch.device("meta"):
        model = plan.model.model_cls(plan.model_args)
    parallelize_model(model, plan.parallel_dims, plan.parallelize)
    model.to_empty(device="cpu")
    model.init_weights(SEED)
    return model


def build_layout_stages(plan: JobPlan):
    """:func:`build_layout_model` for a pp plan: the model split along ``plan.stages``, each of
    this rank's stage modules parallelized and initialized; returns the split."""
    from models.parallel.pipeline import split_model

    with torch.device("meta"):
        meta = plan.model.model_cls(plan.model_args)
    split = split_model(meta, plan.stages, plan.parallel_dims)
    for module in split.modules:
        parallelize_model(module, plan.parallel_dims, plan.parallelize)
        module.to_empty(device="cpu")
        module.init_weights(SEED)
    return split


def run_layout(
    world_size, model_name, degrees, opts_kwargs, global_bs, seq_len, max_norm, *, n_layers: int | None = None
) -> dict:
    """One step under ``degrees`` on this rank (all ranks must call it). Returns the global loss
    and grad norm and this rank's view of the FULL initial weights, grads (before clipping),
    updated weights, and world-summed MoE routing counts (the keys of :func:`reference_step`),
    plus ``attention_calls``. ``n_layers``: :func:`small_layers` unless given (the reference
    step has that many)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    plan = harness_plan(model_name, degrees, global_bs, seq_len, opts_kwargs, n_layers=n_layers)
    if plan.world_size != world_size:
        raise ValueError(f"degrees {degrees} need {plan.world_size} ranks, the launch has {world_size}")
    pd, opts = plan.parallel_dims, plan.parallelize
    pd.build_mesh("cpu")
    model = build_layout_model(plan)
    initial = {n: _full(p) for n, p in model.named_parameters()}

    inputs, labels = make_batch(global_bs, seq_len, model.args.vocab_size)
    per_rank = global_bs // pd.size("batch")
    b = pd.coordinate("batch")
    inputs, labels = inputs[b * per_rank : (b + 1) * per_rank], labels[b * per_rank : (b + 1) * per_rank]
    cp_rank, cp = pd.coordinate("cp"), pd.size("cp")
    inputs = load_balanced_shard(inputs, 1, cp_rank, cp)
    labels = load_balanced_shard(labels, 1, cp_rank, cp)
    n_tokens = global_bs * seq_len

    attention_calls = _call_counter([block.attention for block in model.layers.values()])
    with loss_parallel_context(pd.tp > 1 and opts.loss_parallel), warnings.catch_warnings():
        # FSDP2 warns of a wrapped module's output that is a view (an in-place op on it would
        # drop its pre-backward hook): no layout may hand it one (tensor_parallel._own_storage)
        warnings.filterwarnings("error", message=".*returned a view tensor")
        logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum") / n_tokens
        loss.backward()
    local_loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
    total = local_loss.detach().clone()
    loss_mesh = pd.get_optional_mesh("loss")
    if loss_mesh is not None:
        dist.all_reduce(total, group=loss_mesh.get_group())
    finalize_grads(model.parameters())
    grads = {n: _full(p.grad) for n, p in model.named_parameters()}
    norm = clip_grad_norm_(list(model.parameters()), max_norm, pd.get_optional_mesh("pp"))
    adamw_step(model.parameters())
    routing = _routing_counts(model)
    for counts in routing.values():
        # each token is routed on exactly one rank (its batch, cp and sequence-parallel slice)
        dist.all_reduce(counts)
    return {
        "loss": total.item(),
        "norm": norm.item(),
        "initial": initial,
        "grads": grads,
        "weights": {n: _full(p) for n, p in model.named_parameters()},
        "routing": routing,
        "attention_calls": attention_calls["n"],
    }


def computed_once(rank: int, directory: str, name: str, compute):
    """``compute()`` on every rank of a launch, computed by rank 0 only: it saves the result in
    ``directory`` under ``name`` (unless an earlier launch did), the other ranks load it. For the
    single-process references several ranks need (the same tensors, bit for bit, at the cost of a
    file read instead of a model step per rank). All ranks must call it (a barrier)."""
    import os

    import torch.distributed as dist

    path = os.path.join(directory, f"{name}.pt")
    if rank == 0 and not os.path.exists(path):
        torch.save(compute(), path + ".part")
        os.replace(path + ".part", path)
    dist.barrier()
    return torch.load(path, weights_only=False)


def fingerprint(result: dict) -> str:
    """Digest of the loss, norm, full grads and full updated weights, bit for bit: ranks of one
    layout must agree exactly (replicas that drifted apart would differ here)."""
    h = hashlib.sha256()
    h.update(torch.tensor([result["loss"], result["norm"]], dtype=torch.float64).numpy().tobytes())
    for key in ("grads", "weights"):
        for name in sorted(result[key]):
            h.update(name.encode())
            h.update(result[key][name].contiguous().numpy().tobytes())
    return h.hexdigest()


def compare(result: dict, ref: dict) -> dict:
    """Errors of one layout's step against the reference: plain floats, cheap to send."""

    def rel(a: float, b: float) -> float:
        return abs(a - b) / abs(b)

    names = sorted(result["grads"]) == sorted(ref["grads"])
    report = {
        "loss": (result["loss"], ref["loss"]),
        "norm": (result["norm"], ref["norm"]),
        "loss_rel_err": rel(result["loss"], ref["loss"]),
        "norm_rel_err": rel(result["norm"], ref["norm"]),
        "names": names,
    }
    if not names:
        return report
    report["initial_abs_err"] = max((result["initial"][n] - w).abs().max().item() for n, w in ref["initial"].items())
    # relative to the tensor's largest entry: elementwise relative errors blow up on entries
    # that are zero up to round-off
    report["grad_rel_err"] = {
        n: ((result["grads"][n] - g).abs().max() / g.abs().max().clamp_min(1e-12)).item()
        for n, g in ref["grads"].items()
    }
    report["weight_abs_err"] = {n: (result["weights"][n] - w).abs().max().item() for n, w in ref["weights"].items()}
    # exact: integer counts, and no reference token is within ROUTING_MIN_MARGIN of a tie
    report["routing_equal"] = sorted(result["routing"]) == sorted(ref["routing"]) and all(
        torch.equal(result["routing"][k], c) for k, c in ref["routing"].items()
    )
    report["routing_margin"] = ref["routing_margin"]
    if ref["routing"] and sorted(result["routing"]) == sorted(ref["routing"]):
        # tokens that picked another expert show up twice (one count lost, one gained)
        report["routing_moved_tokens"] = int(
            sum((result["routing"][k] - c).abs().sum().item() for k, c in ref["routing"].items()) // 2
        )
    return report


def _worst(errors: dict[str, float], n: int = 3) -> str:
    top = sorted(errors.items(), key=lambda kv: -kv[1])[:n]
    return ", ".join(f"{name}={err:.2e}" for name, err in top)


def fp32_failures(per_rank: list[dict]) -> list[str]:
    """Every fp32 check of one layout's per-rank :func:`parallel_step` results, as messages
    (empty when all pass). All checks run, so a failure shows the whole picture: a wrong
    reduction may move the grads a lot but the loss or the norm only slightly, and vice versa."""
    report = per_rank[0]
    if not report["names"]:
        return ["parameter names differ from the unsharded model's"]
    failures = []
    if report["initial_abs_err"] != 0.0:
        failures.append(f"initial weights differ by {report['initial_abs_err']:.2e}")
    if report["loss_rel_err"] > LOSS_RTOL:
        failures.append(f"loss rel err {report['loss_rel_err']:.2e}; (parallel, ref) = {report['loss']}")
    if report["norm_rel_err"] > NORM_RTOL:
        failures.append(f"grad norm rel err {report['norm_rel_err']:.2e}; (parallel, ref) = {report['norm']}")
    if max(report["grad_rel_err"].values()) > GRAD_RTOL:
        failures.append(f"grad rel errs: {_worst(report['grad_rel_err'])}")
    if max(report["weight_abs_err"].values()) > WEIGHT_ATOL:
        failures.append(f"updated-weight abs errs: {_worst(report['weight_abs_err'])}")
    if report["routing_margin"] is not None and report["routing_margin"] < ROUTING_MIN_MARGIN:
        failures.append(
            f"the reference batch has a token within {report['routing_margin']:.1e} of a top-k tie "
            f"(< ROUTING_MIN_MARGIN = {ROUTING_MIN_MARGIN:.0e}): round-off could flip it, so the exact "
            "routing check needs another batch (SEED)"
        )
    if not report["routing_equal"]:
        failures.append("MoE routing counts differ from the reference")
    if len({r["fingerprint"] for r in per_rank}) != 1:
        failures.append("ranks disagree on loss, norm, full grads or updated weights")
    return failures


def parallel_step(rank, world_size, model_name, degrees, opts_kwargs, global_bs, seq_len, max_norm):
    """Launcher entry point for one layout. Every rank returns ``{"fingerprint": ...}``; rank 0's
    dict also holds the :func:`compare` report against the reference."""
    result = run_layout(world_size, model_name, degrees, opts_kwargs, global_bs, seq_len, max_norm)
    out = {"fingerprint": fingerprint(result)}
    if rank == 0:
        out.update(compare(result, reference_step(model_name, global_bs, seq_len, max_norm)))
    return out


def parallel_steps(rank, world_size, cases):
    """Several layouts in one launch (the ranks' imports dominate a launch's cost). ``cases``:
    ``(model_name, degrees, opts_kwargs, global_bs, seq_len, max_norm)`` tuples; returns one
    :func:`parallel_step` dict per case."""
    out = []
    for case in cases:
        try:
            out.append(parallel_step(rank, world_size, *case))
        except Exception as exc:
            raise RuntimeError(f"layout failed: {case}") from exc
    return out
