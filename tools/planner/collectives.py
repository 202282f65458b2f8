"""The collectives one rank issues in one training step, predicted from the layout.

Record convention (what :func:`predict_collectives` returns and what a recorder must match):

* one record per distinct ``(kind, mesh, bytes)``: ``{"kind", "mesh", "count", "bytes"}``;
* ``kind``: ``all_gather`` | ``reduce_scatter`` | ``all_reduce`` | ``all_to_all`` | ``send_recv``;
* ``mesh``: the ``ParallelDims`` name of the process group the call runs on: ``fsdp`` /
  ``efsdp`` (FSDP2's shard dimension for dense / expert parameters), ``dp_replicate`` (HSDP's
  gradient all-reduce), ``tp``, ``cp``, ``ep``, ``etp``, ``pp``, ``loss``;
* ``bytes``: the buffer ONE call carries on this rank: all-gather its OUTPUT (the gathered
  buffer), reduce-scatter its INPUT (the full buffer before scattering), all-reduce the
  tensor, all-to-all the input this rank sends, send/recv one message; ``count``: calls per
  optimizer step;
* only groups with more than one rank (a size-1 axis has a placeholder group and moves no
  data; a recorder should drop them).

Checked exactly against a recorded training step (``tests/distributed/test_planner_comm.py``,
every rank, 4 gloo ranks, gradient accumulation 2 unless noted): the CPU proof matrix (fp32, no
AC, sequence and loss parallel on, 1F1B) and layouts that turn on, alone or a few together, bf16
parameters with fp32 gradient reduction (FSDP2 over 2 ranks, gradients accumulated over 2
micro-batches and over one; the size-1 FSDP mesh of a pipeline stage, where FSDP2 only casts;
HSDP), a bf16 reduce dtype (with bf16 and with fp32 parameters), full AC (FSDP, TP with and
without sequence parallel, CP, MLA, MoE experts replicated over TP, EP, EP x ETP), selective AC
(the per-op policy: FSDP, TP, MLA, EP x ETP; every N-th block: TP), ``fsdp_reshard_after_forward``
``never`` and, pipelined, ``always``, TP without sequence parallel and without loss parallel, TP
and CP inside pipeline stages, every schedule :data:`tools.planner.estimate.SCHEDULES` lists
(1F1B; GPipe, also with one micro-batch; Interleaved1F1B, LoopedBFS and InterleavedZeroBubble
with two stages per rank; ZBVZeroBubble), CP without TP, MoE experts replicated over TP (no EP),
and on 8 ranks HSDP x FSDP x TP, routed experts split over etp and sharded over efsdp = 2, and
pp=4 x tp=2.

What is checked: FSDP2's all-gathers (one per FSDP group per unshard, parameters cast to the
compute dtype, dim 0 padded to the shard count; full AC's recomputation re-gathers nothing) and
reduce-scatters (gradients in the reduce dtype, padded; sizes from
:mod:`tools.planner.inventory`), HSDP's all-reduce of the reduce-scattered shard, the loss
all-reduce over ``loss``, the pipeline loss sum and grad-norm sum over ``pp`` and the
stage-boundary send/recv (under sequence parallel each tp rank sends its own sequence shard,
``[b, s / (cp * tp), dim]``, to the same tp rank of the next stage, so stage boundaries issue no
tp collective; without it the cp-local sequence; none between two stages of one rank: the turn
of ZBVZeroBubble's V), FSDP2's re-gathers of a group resharded after forward (without pp once
more per micro-batch; with pp ``m + 1`` gathers per pipeline step instead of one, the stage
keeping its parameters unsharded from each backward to the next forward), TP/SP's activation
collectives (forward: all-gather of the attention and MLP inputs, reduce-scatter of their
outputs; backward: all-gather of the output gradients and, for the input gradient, one
reduce-scatter per module whose weights are all TP-split (its input stays a DTensor, so the
projections' Partial gradients are summed first) or one all-reduce per column-wise projection of
a module that takes its input as a local tensor (MLA)); without sequence parallel the
all-reduces of the attention and MLP outputs and input gradients, of the embedding's output and
of the head's input gradient; full AC's re-run of the forward ones but the block's last output
reduction (torch's checkpoint stops recomputing once the last saved tensor is back), in every
block under full AC and in every N-th block of a stage under selective AC's integer option;
MLA's rope-key gradient all-reduce, loss parallel's three all-reduces per forward or, without
it, the all-gather of the vocab-sharded logits, the all-reduce of the Partial gradients of
tp-replicated weights (SP norms, the router gate) once per gradient sync, in the compute dtype
or, once FSDP2 moved it into its reduce-dtype accumulator, the reduce dtype (without pp:
accumulated over micro-batches; with pp: always with whole backwards, one micro-batch included;
with a split backward only in the stages where one of torch's input halves runs after one of
their weight halves), CP's K/V all-gather and backward reduce-scatter, the grad-norm all-reduces
(see below), the MoE load counts over ``loss`` and ``tp``, EP's count exchange and ETP's count
all-gather (functional collectives: re-issued by full AC's recomputation, read back from storage
by selective AC's), and the NUMBER of EP/ETP token all-to-alls. Their bytes depend on routing:
the records assume balanced routing, which the test checks summed over the world (every row sent
is received), not per rank.

Grad-norm reductions: ``trainer/grad_clip.py`` sums the squares of the gradients sharded over
the same groups (compared by ranks, whatever mesh object they carry) and all-reduces each such
sum once per group: one 4-byte all-reduce per distinct (groups, group) pair.

Modelled, not yet checked: HSDP's all-reduce in a bf16 reduce dtype (bf16 reduce-scatters and
HSDP with bf16 parameters are checked), ``always`` without pp (it issues what ``default`` does:
both reshard every group but the last block and the head when the shard mesh has more than one
rank), more micro-batches than pp ranks under the split-backward schedules (the orders differ;
the rule reads torch's), and more than 8 ranks. ``fsdp_reshard_after_forward = "always"`` with a
split-backward schedule is refused by ``trainer.plan.plan_job`` (it dropped weight gradients).
The every-N-th-block option (:attr:`LayoutChoice.selective_ac_option`) is carried from a
trainer config by ``estimate.choice_from_plan`` and modelled here and in the memory and compute
estimates; the search enumerates only the per-op policy (its ``--toml`` says so).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import lru_cache

__all__ = ["LayoutChoice", "predict_collectives"]

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class LayoutChoice:
    """Everything besides the degrees that changes what a step runs."""

    global_batch: int
    local_batch: int  # sequences per micro-batch per rank (training.local_batch_size)
    seq_len: int
    schedule: str | None = None  # pp > 1
    n_microbatches: int | None = None  # pipeline micro-batches per local batch
    ac: str = "none"
    reshard: str = "default"  # fsdp_reshard_after_forward
    param_dtype: str = "bfloat16"
    reduce_dtype: str = "float32"
    sequence_parallel: bool = True
    loss_parallel: bool = True
    # activation_checkpoint.selective_ac_option under ``ac == "selective"``: "op" (the per-op
    # policy) or an integer N (every N-th block of a stage fully checkpointed)
    selective_ac_option: str = "op"

    @property
    def mixed(self) -> bool:
        return self.param_dtype != "float32" or self.reduce_dtype != "float32"


def grad_accum_steps(choice: LayoutChoice, degrees) -> int:
    return choice.global_batch // (degrees.dp_replicate * degrees.dp_shard * choice.local_batch)


def stage_layers(params_args, degrees, choice: LayoutChoice, rank: int, layout):
    """[(layers, has_embed, has_head)] of the pipeline stages ``rank`` runs."""
    n_layers = params_args.n_layers
    if degrees.pp == 1:
        return [(range(n_layers), True, True)], None
    return _stages(n_layers, degrees.pp, choice.schedule, choice.n_microbatches, choice.local_batch,
                   layout.coordinate("pp", rank))  # fmt: skip


@lru_cache(maxsize=65536)
def _stages(n_layers: int, pp: int, schedule: str, m: int, local_batch: int, pp_rank: int):
    from models.parallel.pipeline.plan import plan_stages

    plan = plan_stages(n_layers, pp, schedule, m, local_batch)
    stages = []
    for s in plan.rank_stages[pp_rank]:
        lo, hi = plan.layer_ranges[s]
        stages.append((range(lo, hi), s == 0, s == plan.num_stages - 1))
    return stages, plan


def _fully_checkpointed(choice: LayoutChoice, layers) -> list[int]:
    """The layers of one stage (``layers``, in order) whose forward the backward runs again with
    every op (models/parallel/activation_checkpoint.py): all of them under full AC, every N-th
    block of the stage's model chunk (counting from its first block) under selective AC with an
    integer option, none otherwise (selective AC's per-op policy saves every collective's
    output, and no recomputation happens without AC)."""
    if choice.ac == "full":
        return list(layers)
    every = selective_every(choice)
    if every:
        return [layer for k, layer in enumerate(layers) if k % every == 0]
    return []


def selective_every(choice: LayoutChoice) -> int | None:
    """N of selective AC's every-N-th-block option, None for any other AC choice."""
    option = str(choice.selective_ac_option)
    return int(option) if choice.ac == "selective" and option.isdigit() and int(option) > 0 else None


@lru_cache(maxsize=1024)
def _split_backward_casts(schedule: str, pp: int, stages_per_rank: int, m: int) -> dict[int, bool] | None:
    """For a schedule that splits each backward into an input half (I) and a weight half (W):
    stage -> whether FSDP2 moves the stage's gradients into its reduce-dtype accumulator before
    the step's reduction, i.e. whether one of the stage's I actions runs after one of its W
    actions (see :func:`predict_collectives`). None for a schedule of whole backwards. The
    order is torch's own, computed from stand-in stages (building it reads only the stage
    counts and ranks): the compute actions of ``pipeline_order``, without the communication
    torch's constructor then inserts (``_prepare_schedule_with_comms``, seconds per schedule at
    pp 8 x 128 micro-batches, most of a search's time), which leaves each rank's compute order
    as it is (:func:`_schedule_order` with ``comms``; tests/unit/test_planner.py compares both)."""
    from torch.distributed.pipelining.schedules import _ComputationType

    from models.parallel.pipeline.plan import schedule_facts

    name, facts = schedule_facts(schedule)
    if not facts.split_backward:
        return None
    orders = _schedule_order(name, pp, stages_per_rank, m)
    inp, weight = _ComputationType.BACKWARD_INPUT, _ComputationType.BACKWARD_WEIGHT
    out: dict[int, bool] = {}
    for actions in orders.values():
        seen_weight: set[int] = set()
        for a in actions:
            if a is None:
                continue
            if a.computation_type == weight:
                seen_weight.add(a.stage_index)
            elif a.computation_type == inp:
                out[a.stage_index] = out.get(a.stage_index, False) or a.stage_index in seen_weight
    return out or None


def _schedule_order(name: str, pp: int, stages_per_rank: int, m: int, comms: bool = False) -> dict:
    """rank -> the actions torch's schedule ``name`` runs on that pp rank (None = idle), built
    from stand-in stages; ``comms``: as its runtime executes them, with the communication and
    FSDP unshard/reshard actions torch inserts (slow), else the compute actions only."""
    from types import SimpleNamespace

    from models.parallel.pipeline.schedule import SCHEDULES

    cls = SCHEDULES[name].cls
    if not comms:
        cls = type(f"_ComputeOrder{cls.__name__}", (cls,), {"_prepare_schedule_with_comms": _no_comms})
    n = pp * stages_per_rank
    stand_ins = [SimpleNamespace(num_stages=n, group_size=pp, group_rank=0, stage_index=i, submod=None)
                 for i in range(stages_per_rank)]  # fmt: skip
    built = cls(stand_ins, m)
    if comms:
        return getattr(built, "pipeline_order_with_comms", None) or built.pipeline_order
    return built.pipeline_order


def _no_comms(self, *args, **kwargs) -> None:
    """Stands in for torch's ``_prepare_schedule_with_comms``: keep the compute order only."""


@lru_cache(maxsize=256)
def _fsdp_reshard(policy: str, pp: bool, size: int) -> bool:
    from models.parallel.fsdp import reshard_policy

    return reshard_policy(policy, pp, size)


def predict_collectives(
    model: str, flavor: str, degrees, choice: LayoutChoice, rank: int = 0, layout=None, **overrides
):
    """Collectives ``rank`` issues in one optimizer step (see the module docstring), as a list
    of records sorted by mesh, kind and bytes."""
    from .inventory import cached_layout, fsdp_meshes, model_inventory, stage_summary

    _, args = model_inventory(model, flavor, **overrides)
    layout = layout or cached_layout(degrees)
    d = degrees
    pb, rb = _BYTES[choice.param_dtype], _BYTES[choice.reduce_dtype]
    a = pb  # activations are in the compute dtype
    accum = grad_accum_steps(choice, d)
    stages, plan = stage_layers(args, d, choice, rank, layout)
    pp = d.pp > 1
    m = choice.n_microbatches if pp else 1
    mb = choice.local_batch // m  # sequences per forward
    forwards = accum * m  # forward passes per stage per step
    syncs = accum if pp else 1  # gradient reductions per FSDP group per step
    rec: Counter = Counter()
    has_moe = args.has_experts
    dense_size, expert_size, separate = fsdp_meshes(d, has_moe, choice.mixed)

    key = tuple(sorted(overrides.items()))
    stage_ids = plan.rank_stages[layout.coordinate("pp", rank)] if plan is not None else (0,)
    for stage_id, (layers, embed, head) in zip(stage_ids, stages):
        groups = stage_summary(model, flavor, key, d, rank, choice.mixed, layers, embed, head)
        last_block = f"layers.{max(layers)}" if len(layers) else None
        ckpt = _fully_checkpointed(choice, layers)  # their forward collectives run twice
        for g in groups:
            if g.name is None:
                continue
            if g.size > 1:
                flag = g.name not in ("head", last_block) and _fsdp_reshard(choice.reshard, pp, g.size)
                # without pipelining: gathered for forward, again for backward when resharded
                # after forward. Pipelined, the stage keeps its parameters unsharded after each
                # micro-batch's backward until the step's reduction (torch's stage): a group
                # resharded after forward is gathered by every forward that follows a forward
                # or starts the step, and by every backward that follows a forward; each stage
                # runs m forwards and m backwards from a forward to a backward, so m + 1 times
                # in any order (once without resharding; a split-backward schedule with
                # resharding is refused by trainer.plan.plan_job: it dropped weight gradients)
                gathers = accum * ((m + 1) if flag else 1) if pp else accum * (2 if flag else 1)
                rec[("all_gather", g.mesh, g.unsharded * pb)] += gathers
                rec[("reduce_scatter", g.mesh, g.unsharded * rb)] += syncs
            if d.dp_replicate > 1:
                rec[("all_reduce", "dp_replicate", g.shard * rb)] += syncs

        if d.tp > 1:
            s_local = choice.seq_len // d.cp
            t = mb * s_local
            full = a * t * args.dim
            n, r = len(layers), len(ckpt)
            if choice.sequence_parallel:
                # forward: AG attn input, AG mlp/shared-expert input, RS of both outputs;
                # backward: AG (of the outputs' RS); full AC re-runs the forward ones but the
                # last: torch's non-reentrant checkpoint stops recomputing once the last tensor
                # saved for backward is back (the feed-forward's output projection input), so
                # the block's final output reduction is not re-issued. The
                # backward of an input all-gather depends on how the module takes its input
                # (models/parallel/tensor_parallel.py _input_stays_dtensor): a module whose
                # every weight is TP-split keeps it a Replicate DTensor, its projections'
                # Partial input gradients are summed and reduce-scattered once; a module with
                # replicated weights (MLA) takes it as a local tensor, so every column-wise
                # projection's input gradient is all-reduced on its own
                rec[("all_gather", "tp", full)] += forwards * (4 * n + 2 * r)
                rec[("reduce_scatter", "tp", full)] += forwards * (2 * n + r)
                for i in layers:
                    for stays_dtensor, widths in _colwise_modules(model, flavor, key, i):
                        if stays_dtensor:
                            rec[("reduce_scatter", "tp", full)] += forwards
                        else:
                            for width in widths:
                                rec[("all_reduce", "tp", a * t * width)] += forwards
                    # MLA's rope key: computed by replicated weights, its gradient all-reduced
                    # (attention.tp_grad_syncs, models/parallel/tensor_parallel.py)
                    if hasattr(args, "qk_rope_head_dim"):
                        rec[("all_reduce", "tp", a * t * args.qk_rope_head_dim)] += forwards
                if embed:  # Rowwise embedding: RS forward, AG backward
                    rec[("reduce_scatter", "tp", full)] += forwards
                    rec[("all_gather", "tp", full)] += forwards
                if head:  # Colwise output on sequence-sharded input: AG forward, RS backward
                    rec[("all_gather", "tp", full)] += forwards
                    rec[("reduce_scatter", "tp", full)] += forwards
                # pipeline stage boundaries carry each tp rank's own sequence shard (sent to
                # the same tp rank of the next stage): no tp collective there
            else:
                # forward: all-reduce of the attention and MLP outputs (full AC re-runs the
                # attention's, not the block's last, as above); backward: of their input
                # gradients, once per module whose input stays a DTensor, else once per
                # column-wise projection (as above)
                rec[("all_reduce", "tp", full)] += forwards * (2 * n + r)
                for i in layers:
                    for stays_dtensor, widths in _colwise_modules(model, flavor, key, i):
                        if stays_dtensor:
                            rec[("all_reduce", "tp", full)] += forwards
                        else:
                            for width in widths:
                                rec[("all_reduce", "tp", a * t * width)] += forwards
                if embed:  # Rowwise embedding: its Partial output all-reduced forward
                    rec[("all_reduce", "tp", full)] += forwards
                if head:  # Colwise output on a replicated input: its input gradient all-reduced
                    rec[("all_reduce", "tp", full)] += forwards
            if head and not choice.loss_parallel:
                # the vocab-sharded logits all-gathered forward (backward takes a local chunk)
                rec[("all_gather", "tp", a * t * args.vocab_size)] += forwards
            if head and choice.loss_parallel:
                # loss parallel: max, sum-exp and target-logit all-reduces over [tokens] fp32
                rec[("all_reduce", "tp", 4 * t)] += forwards * 3
            # replicated weights fed sequence-sharded tokens (SP norms, the MoE router gate):
            # their Partial gradients are all-reduced once per gradient sync (FSDP2's
            # post-backward redistributes them before reducing; without FSDP finalize_grads
            # does, once per step), in the dtype the gradient is held in then: the reduce dtype
            # once FSDP2 moved it into its accumulator (a backward with gradient sync off found
            # it: without pipelining every micro-batch's but the last; pipelined, torch's stage
            # turns sync off for every backward and reduces at the end of the step, so any m;
            # a zero-bubble stage's input half finds only what an earlier weight half of the
            # stage left, so only where one of its I actions follows one of its W actions, and
            # the weight halves otherwise sum the micro-batches in the compute dtype)
            gb = pb
            if choice.mixed and rb != pb:
                if not pp:
                    gb = rb if accum > 1 else pb
                else:
                    casts = _split_backward_casts(plan.schedule, d.pp, plan.stages_per_rank, m)
                    gb = rb if casts is None or casts[stage_id] else pb
            partial_syncs = syncs if dense_size is not None else 1
            for numel in _tp_partial_grads(model, flavor, key, layers, head, choice.sequence_parallel):
                rec[("all_reduce", "tp", gb * numel)] += partial_syncs

        if d.cp > 1:
            s_local = choice.seq_len // d.cp
            t = mb * s_local
            kv = _kv_bytes_per_token(args, d.tp) * a * t * d.cp  # gathered packed K and V
            n = len(layers)
            rec[("all_gather", "cp", kv)] += forwards * (n + len(ckpt))
            rec[("reduce_scatter", "cp", kv)] += forwards * n

        moe_layers = [i for i in layers if args.has_experts and i >= getattr(args, "n_dense_layers", 0)]
        tn = mb * (choice.seq_len // d.cp) // (d.tp if choice.sequence_parallel and d.tp > 1 else 1)
        # the int64 routing-count exchanges are functional collectives (models/parallel/
        # expert_parallel.py): a fully checkpointed block (full AC, selective AC's every N-th)
        # re-issues them in the recomputation, selective AC's op policy saves their outputs
        # (models/parallel/activation_checkpoint.py)
        n, r = len(moe_layers), len(set(moe_layers) & set(ckpt))
        if moe_layers and d.ep > 1:
            rows = tn * args.n_activated_experts * a * args.dim  # balanced routing assumed
            rec[("all_to_all", "ep", 8 * args.n_routed_experts)] += forwards * (n + r)
            # dispatch + combine forward, their backward all-to-alls
            rec[("all_to_all", "ep", rows)] += forwards * (4 * n + 2 * r)
        if moe_layers and d.etp > 1:
            # the received counts gathered over etp (int64 [etp * n_routed_experts])
            rec[("all_gather", "etp", 8 * d.etp * args.n_routed_experts)] += forwards * (n + r)
            # the rows repeated to / gathered back from the etp peers, forward and backward
            # (sizes depend on routing; ``etp`` x the rows this rank received over ep)
            etp_rows = d.etp * tn * args.n_activated_experts * a * args.dim
            rec[("all_to_all", "etp", etp_rows)] += forwards * (4 * n + 2 * r)

        if pp and plan is not None:
            # the activations between stages: this tp rank's sequence shard under SP (sent to
            # the same tp rank of the next stage), the cp-local sequence otherwise
            boundary_shards = d.tp if choice.sequence_parallel and d.tp > 1 else 1
            t = mb * (choice.seq_len // d.cp) // boundary_shards
            msg = a * t * args.dim
            # a neighbouring stage on this rank (ZBVZeroBubble's V turn) gets it in memory
            if not embed and stage_id - 1 not in stage_ids:
                rec[("send_recv", "pp", msg)] += forwards * 2  # recv activation, send its grad
            if not head and stage_id + 1 not in stage_ids:
                rec[("send_recv", "pp", msg)] += forwards * 2  # send activation, recv grad

    # once per step
    loss_size = d.dp_replicate * d.dp_shard * d.cp
    if loss_size > 1:
        rec[("all_reduce", "loss", 4)] += 1
    if pp:
        rec[("all_reduce", "pp", 4)] += 2  # grad-norm squares, loss sum over stages
    for mesh in _grad_norm_all_reduces(model, flavor, key, d, stages, dense_size, expert_size, separate, layout, rank):
        rec[("all_reduce", mesh, 4)] += 1
    if has_moe:
        n_moe = sum(1 for layers, _, _ in stages for i in layers if i >= getattr(args, "n_dense_layers", 0))
        if n_moe:
            counts = 4 * n_moe * args.n_routed_experts
            for mesh, size in (("loss", loss_size), ("tp", d.tp)):
                if size > 1:
                    rec[("all_reduce", mesh, counts)] += 1
    return [
        {"kind": k, "mesh": mesh, "count": c, "bytes": int(b)}
        for (k, mesh, b), c in sorted(rec.items(), key=lambda kv: (kv[0][1], kv[0][0], kv[0][2]))
        if c
    ]


def _params(model, flavor, key):
    from .inventory import model_inventory

    return model_inventory(model, flavor, **dict(key))[0]


@lru_cache(maxsize=4096)
def _colwise_modules(model, flavor, key, layer: int) -> tuple[tuple[bool, tuple[int, ...]], ...]:
    """The TP-split modules of transformer layer ``layer`` (attention, dense or shared-expert
    feed-forward): whether its input stays a DTensor (every weight of the module TP-split:
    tensor_parallel._input_stays_dtensor) and the input width of each column-wise projection."""
    params = [p for p in _params(model, flavor, key) if p.layer == layer and not p.expert]
    out = []
    for prefix in sorted({p.fqn.rsplit(".", 2)[0] for p in params if p.tp_dim == 0}):
        inside = [p for p in params if p.fqn.startswith(prefix + ".")]
        widths = tuple(p.shape[1] for p in inside if p.tp_dim == 0)
        out.append((all(p.tp_dim is not None for p in inside), widths))
    return tuple(out)


def _replicated_on_tp(p, sp: bool) -> bool:
    """Weights models/parallel/tensor_parallel.py makes Replicate DTensors on tp: the norms
    under sequence parallel (SequenceParallel), the MoE router gate."""
    if p.tp_dim is not None or p.expert:
        return False
    name = p.fqn.rsplit(".", 1)[0]
    norm = name == "norm" or name.endswith(".attention_norm") or name.endswith(".ffn_norm")
    return (sp and norm) or name.endswith(".moe.router.gate")


@lru_cache(maxsize=4096)
def _tp_partial_grads(model, flavor, key, layers, head: bool, sp: bool) -> tuple[int, ...]:
    """Element counts of this stage's tp-replicated weights (their gradients come out Partial)."""
    keep = set(layers)
    return tuple(
        p.numel
        for p in _params(model, flavor, key)
        if _replicated_on_tp(p, sp) and ((p.layer in keep) if p.layer is not None else (head and p.group == "head"))
    )


def _grad_norm_all_reduces(model, flavor, key, d, stages, dense_size, expert_size, separate, layout, rank):
    """The grad-norm all-reduces, as ``trainer/grad_clip.py`` issues them: each gradient's sum
    of squares is partial over the groups of the mesh dimensions it is sharded on (size > 1);
    gradients with the same groups (compared by ranks) share one float32 all-reduce per
    group. Dense weights: FSDP's shard group, plus tp for TP-split weights (norms and the
    router gate are Replicate on tp); routed experts in their own FSDP group: efsdp, ep, and
    etp for the etp-split weights; otherwise in the dense FSDP group."""
    layers = tuple(sorted({i for layers, _, _ in stages for i in layers}))
    embed = any(e for _, e, _ in stages)
    head = any(h for _, _, h in stages)
    name_sets = _grad_norm_name_sets(
        model,
        flavor,
        key,
        layers,
        embed,
        head,
        separate,
        (dense_size or 1) > 1,
        (expert_size or 1) > 1,
        d.tp > 1,
        d.ep > 1,
        d.etp > 1,
    )
    if len(name_sets) < 2:  # nothing to merge
        return [name for names in name_sets for name in names]
    keys: dict = {}  # ranks of each group -> the mesh names, in first-seen order
    for names in name_sets:
        keys.setdefault(tuple(_group_ranks(d, n, rank, layout) for n in names), names)
    return [name for names in keys.values() for name in names]


_GROUP_RANKS: dict = {}


def _group_ranks(degrees, name: str, rank: int, layout) -> tuple[int, ...]:
    """``layout.group(name, rank)`` as a tuple, memoized per (degrees, name, rank)."""
    k = (degrees, name, rank)
    if k not in _GROUP_RANKS:
        if len(_GROUP_RANKS) > 65536:
            _GROUP_RANKS.clear()
        _GROUP_RANKS[k] = tuple(layout.group(name, rank))
    return _GROUP_RANKS[k]


@lru_cache(maxsize=4096)
def _grad_norm_name_sets(model, flavor, key, layers, embed, head, separate, fsdp, efsdp, tp, ep, etp):
    """The distinct tuples of mesh names the gradients of this rank's parameters are sharded
    over (size > 1), in parameter order."""
    from .inventory import _ETP_DIM

    keep = set(layers)
    out: dict = {}
    for p in _params(model, flavor, key):
        if p.layer is not None and p.layer not in keep:
            continue
        if p.layer is None and not ((p.group == "tok_embeddings" and embed) or (p.group == "head" and head)):
            continue
        if p.expert and separate:
            names = [n for n, on in (("efsdp", efsdp), ("ep", ep)) if on]
            if etp and _ETP_DIM.get(p.fqn.rsplit(".", 1)[-1]) is not None:
                names.append("etp")
        else:
            names = ["fsdp"] if fsdp else []
            if tp and p.tp_dim is not None and not p.expert:
                names.append("tp")
        out.setdefault(tuple(names), None)
    return tuple(out)


def _kv_bytes_per_token(args, tp: int) -> int:
    """Elements of K plus V per token after head repetition (what the CP core gathers)."""
    if hasattr(args, "kv_lora_rank"):
        return 2 * (args.n_heads // tp) * args.qk_head_dim  # v padded to the q/k head dim
    return 2 * (args.n_heads // tp) * args.head_dim
