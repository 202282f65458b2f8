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
and CP inside pipeline stages, every schedule :data:`tools.planner.search.SCHEDULES` lists
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

Grad-norm reductions: ``trainer/optim/grad_clip.py`` sums the squares of the gradients sharded over
the same groups (compared by ranks, whatever mesh object they carry) and all-reduces each such
sum once per group: one 4-byte all-reduce per distinct (groups, group) pair.

LoRA (``choice.lora``, checked on llama3 tp=2 x fsdp=2 and deepseek_v3 fsdp=2 x tp=2 x ep=2 x
etp=2 with expert adapters): FSDP gathers base and adapters and reduces the adapters only; the
frozen embedding's output gets no gradient (no backward all-gather under SP) and neither does
layer 0's attention input on that stage (its input-gradient reduction is not issued: priced as
if that attention is adapted, the default targets); the frozen norms and router gate have no
gradient to all-reduce over tp, while the adapter factors replicated over tp beside a TP-split
base (the column-wise base's ``A``, the row-wise base's ``B``) get Partial gradients, all-reduced
like theirs; expert adapters under etp: the factor replicated over etp (w1/w3's ``A``, w2's
``B``, ``[E/ep, r, dim]``) has its gradient all-reduced over etp in every backward, in the
compute dtype.

Float8 (``choice.float8``): with FSDP float8 all-gather (tensorwise) a dense group's all-gather
carries its converted linears' weights at 1 byte per element and the rest in the compute dtype,
routed experts' weights included, float8 experts or not (:mod:`tools.planner.float8`); the amax
all-reduces of the float8 scales are not modelled.

Modelled, not yet checked: HSDP's all-reduce in a bf16 reduce dtype (bf16 reduce-scatters and
HSDP with bf16 parameters are checked), ``always`` without pp (it issues what ``default`` does:
both reshard every group but the last block and the head when the shard mesh has more than one
rank), more micro-batches than pp ranks under the split-backward schedules (the orders differ;
the rule reads torch's), and more than 8 ranks. ``fsdp_reshard_after_forward = "always"`` with a
split-backward schedule is refused by ``trainer.plan.plan_job`` (it dropped weight gradients).
The every-N-th-block option (:attr:`LayoutChoice.selective_ac_option`) is carried from a
trainer config by ``from_config.choice_from_plan`` and modelled here and in the memory and compute
estimates; the search enumerates only the per-op policy (its ``--toml`` says so).
"""

from __future__ import annotations

from collections import Counter
from functools import lru_cache

from .choice import DTYPE_BYTES, LayoutChoice, fully_checkpointed, grad_accum_steps, stage_layers
from .collective_template import _CONST, _GB, _T, _TN, CollectiveTemplate
from .float8 import float8_all_gather, float8_gathered_numel
from .param_groups import grad_norm_all_reduces, tp_colwise_modules, tp_partial_adapter_grads, tp_partial_grads

__all__ = ["CollectiveTemplate", "collective_template", "predict_collectives", "template_key"]


@lru_cache(maxsize=256)
def _fsdp_reshard(policy: str, pp: bool, size: int) -> bool:
    from models.parallel.fsdp import reshard_policy

    return reshard_policy(policy, pp, size)


def predict_collectives(
    model: str, flavor: str, degrees, choice: LayoutChoice, rank: int = 0, layout=None, **overrides
):
    """Collectives ``rank`` issues in one optimizer step (see the module docstring), as a list
    of records sorted by mesh, kind and bytes (:func:`collective_template`'s records of the
    choice's batch split)."""
    d = degrees
    tmpl = collective_template(model, flavor, d, choice, rank, tuple(sorted(overrides.items())), layout)
    m = choice.n_microbatches if d.pp > 1 else 1
    return [
        {"kind": kind, "mesh": mesh, "count": c, "bytes": int(b)}
        for (mesh, kind, b), c in tmpl.records(grad_accum_steps(choice, d), m, choice.local_batch // m)
    ]


def template_key(model: str, flavor: str, key: tuple, degrees, choice: LayoutChoice, rank: int) -> tuple:
    """What :func:`collective_template` depends on: everything but the batch split (global
    and local batch, micro-batches)."""
    c = choice
    return (
        model, flavor, key, degrees, rank, c.schedule, c.ac, c.selective_ac_option, c.reshard, c.seq_len,
        c.param_dtype, c.reduce_dtype, c.sequence_parallel, c.loss_parallel, c.float8, c.lora,
    )  # fmt: skip


_TEMPLATES: dict = {}


def collective_template(
    model: str, flavor: str, degrees, choice: LayoutChoice, rank: int, key: tuple, layout=None, tkey=None
) -> CollectiveTemplate:
    """The collectives of ``rank`` under ``choice``'s schedule, AC and reshard choices, for any
    batch split (cached by :func:`template_key`, ``tkey`` when the caller has it; ``key``: the
    model overrides, sorted)."""
    tkey = tkey or template_key(model, flavor, key, degrees, choice, rank)
    hit = _TEMPLATES.get(tkey)
    if hit is None:
        from .inventory import cached_layout

        if len(_TEMPLATES) >= 65536:
            _TEMPLATES.clear()
        hit = _TEMPLATES[tkey] = _build_template(
            model, flavor, degrees, choice, rank, layout or cached_layout(degrees), key
        )
    return hit


def _build_template(model: str, flavor: str, d, choice: LayoutChoice, rank: int, layout, key: tuple):
    from .inventory import fsdp_meshes, model_inventory

    _, args = model_inventory(model, flavor, **dict(key))
    pb, rb = DTYPE_BYTES[choice.param_dtype], DTYPE_BYTES[choice.reduce_dtype]
    a = pb  # activations are in the compute dtype
    # (the batch split does not change the stages: plan_stages' layer ranges and rank stages
    # depend on the schedule alone)
    stages, plan = stage_layers(args, d, choice, rank, layout)
    pp = d.pp > 1
    terms: dict = {}

    def add(kind, mesh, b, typ=_CONST, sid=0, *, fwd=0, sync=0, flag=0, gather=0, step=0):
        """``rec[(kind, mesh, bytes)] += count``, the count per forward, gradient sync,
        resharded gather, other gather and step"""
        c = terms.setdefault((kind, mesh, typ, b, sid), [0, 0, 0, 0, 0])
        c[0] += fwd
        c[1] += sync
        c[2] += flag
        c[3] += gather
        c[4] += step

    has_moe = args.has_experts
    dense_size, expert_size, separate = fsdp_meshes(d, has_moe, choice.mixed)
    # the dtype of the TP-replicated weights' Partial gradients (below)
    gb_rule = ("casts" if pp else "accum") if choice.mixed and rb != pb and d.tp > 1 else ""
    pp_rank = layout.coordinate("pp", rank)
    stage_ids = plan.rank_stages[pp_rank] if plan is not None else (0,)
    for stage_id, (layers, embed, head) in zip(stage_ids, stages):
        # DeepSeek-V3's MTP depths on this stage (with the head): each embeds like the first
        # stage, and the head (its input all-gather, the loss) runs on 1 + D times the tokens
        mtp = sum(1 for i in layers if i >= args.n_layers)
        ckpt = fully_checkpointed(choice, layers)  # their forward collectives run twice
        # FSDP's collectives of the stage's groups, summed per (kind, mesh, bytes) (cached: no
        # batch split or AC choice changes them): resharded groups gather ``per_flag`` times
        # per step, the others ``per_gather`` (CollectiveTemplate.records)
        for (kind, mesh, b), n_flag, n_plain, n_sync in _stage_fsdp(
            model, flavor, key, d, rank, choice.mixed, layers, embed, head, choice.reshard, pp, pb, rb, choice.float8,
            choice.lora,
        ):  # fmt: skip
            add(kind, mesh, b, flag=n_flag, gather=n_plain, sync=n_sync)

        if d.tp > 1:
            # LoRA: the frozen embedding's stage computes no input gradient of layer 0's
            # attention projections that read the block's input (as tools/planner/compute.py)
            lora_on = choice.lora is not None
            frozen_entry = lora_on and embed
            full = a * args.dim  # bytes per token of the micro-batch's CP-local tokens (x t)
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
                add("all_gather", "tp", full, _T, fwd=4 * n + 2 * r)
                add("reduce_scatter", "tp", full, _T, fwd=2 * n + r)
                stays, widths = _tp_input_grads(model, flavor, key, layers, frozen_entry)
                add("reduce_scatter", "tp", full, _T, fwd=stays)
                for width, count in widths:
                    add("all_reduce", "tp", a * width, _T, fwd=count)
                # MLA's rope key: computed by replicated weights, its gradient all-reduced
                # (attention.tp_grad_syncs, models/parallel/tensor_parallel.py)
                if hasattr(args, "qk_rope_head_dim"):
                    add("all_reduce", "tp", a * args.qk_rope_head_dim, _T, fwd=len(layers))
                if embed or mtp:  # Rowwise embedding (and MTP's copies): RS forward, AG backward
                    add("reduce_scatter", "tp", full, _T, fwd=int(embed) + mtp)
                    # (a frozen embedding's output needs no gradient: LoRA)
                    add("all_gather", "tp", full, _T, fwd=0 if lora_on else int(embed) + mtp)
                if head and not mtp:  # Colwise output on sequence-sharded input: AG forward, RS backward
                    add("all_gather", "tp", full, _T, fwd=1)
                    add("reduce_scatter", "tp", full, _T, fwd=1)
                elif head:
                    # MTP: the main and each depth's normed states, sequence-sharded DTensors,
                    # are concatenated along the sequence (DeepSeekV3.forward): DTensor gathers
                    # each one (forward), and the head's replicated input gets its Partial
                    # gradient all-reduced (backward; the gathers' backward is a local slice)
                    add("all_gather", "tp", full, _T, fwd=1 + mtp)
                    add("all_reduce", "tp", full * (1 + mtp), _T, fwd=1)
                # pipeline stage boundaries carry each tp rank's own sequence shard (sent to
                # the same tp rank of the next stage): no tp collective there
            else:
                # forward: all-reduce of the attention and MLP outputs (full AC re-runs the
                # attention's, not the block's last, as above); backward: of their input
                # gradients, once per module whose input stays a DTensor, else once per
                # column-wise projection (as above)
                add("all_reduce", "tp", full, _T, fwd=2 * n + r)
                stays, widths = _tp_input_grads(model, flavor, key, layers, frozen_entry)
                add("all_reduce", "tp", full, _T, fwd=stays)
                for width, count in widths:
                    add("all_reduce", "tp", a * width, _T, fwd=count)
                if embed or mtp:  # Rowwise embedding (and MTP's copies): Partial output all-reduced forward
                    add("all_reduce", "tp", full, _T, fwd=int(embed) + mtp)
                if head:  # Colwise output on a replicated input: its input gradient all-reduced
                    add("all_reduce", "tp", full * (1 + mtp), _T, fwd=1)
            if head and not choice.loss_parallel:
                # the vocab-sharded logits all-gathered forward (backward takes a local chunk)
                add("all_gather", "tp", a * (1 + mtp) * args.vocab_size, _T, fwd=1)
            if head and choice.loss_parallel:
                # loss parallel: max, sum-exp and target-logit all-reduces over [tokens] fp32,
                # per cross entropy (the main one and each MTP depth's, trainer/mtp.py)
                add("all_reduce", "tp", 4, _T, fwd=3 * (1 + mtp))
            # replicated weights fed sequence-sharded tokens (SP norms, the MoE router gate):
            # their Partial gradients are all-reduced once per gradient sync (FSDP2's
            # post-backward redistributes them before reducing; without FSDP finalize_grads
            # does, once per step), in the dtype the gradient is held in then: the reduce dtype
            # once FSDP2 moved it into its accumulator (a backward with gradient sync off found
            # it: without pipelining every micro-batch's but the last, so with accumulation
            # (gb_rule "accum"); pipelined, torch's stage turns sync off for every backward and
            # reduces at the end of the step, so any m; a zero-bubble stage's input half finds
            # only what an earlier weight half of the stage left, so only where one of its I
            # actions follows one of its W actions (gb_rule "casts": rank_split_backward_casts
            # of the micro-batch count), and the weight halves otherwise sum the micro-batches
            # in the compute dtype)
            partial = (
                tp_partial_adapter_grads(model, flavor, key, tuple(layers), choice.lora)
                if lora_on
                else tp_partial_grads(model, flavor, key, layers, head, choice.sequence_parallel)
            )
            per = {"sync": 1} if dense_size is not None else {"step": 1}
            for numel in partial:
                if gb_rule:
                    add("all_reduce", "tp", numel, _GB, stage_id if gb_rule == "casts" else 0, **per)
                else:
                    add("all_reduce", "tp", pb * numel, **per)

        if d.cp > 1:
            # gathered packed K and V (x t)
            kv = _kv_bytes_per_token(args, d.tp) * a * d.cp
            n = len(layers)
            add("all_gather", "cp", kv, _T, fwd=n + len(ckpt))
            add("reduce_scatter", "cp", kv, _T, fwd=n)
            if args.needs_documents:
                # block-causal masking / document positions: every stage module gathers the
                # micro-batch's int64 token ids over cp once per forward (its document ids are
                # defined on the whole row; models/parallel/context_parallel.SequenceGather),
                # outside the blocks, so no checkpoint re-issues it
                add("all_gather", "cp", 8 * d.cp, _T, fwd=1)

        moe_layers = [i for i in layers if i >= getattr(args, "n_dense_layers", 0)] if has_moe else []
        # (the routed tokens: x tn, the sequence-parallel shard of the CP-local tokens)
        # the int64 routing-count exchanges are functional collectives (models/parallel/
        # expert_parallel.py): a fully checkpointed block (full AC, selective AC's every N-th)
        # re-issues them in the recomputation, selective AC's op policy saves their outputs
        # (models/parallel/activation_checkpoint.py)
        n, r = len(moe_layers), len(set(moe_layers) & set(ckpt)) if moe_layers else 0
        if moe_layers and d.ep > 1:
            rows = args.n_activated_experts * a * args.dim  # balanced routing assumed
            add("all_to_all", "ep", 8 * args.n_routed_experts, fwd=n + r)
            # dispatch + combine forward, their backward all-to-alls
            add("all_to_all", "ep", rows, _TN, fwd=4 * n + 2 * r)
        if moe_layers and d.etp > 1:
            # the received counts gathered over etp (int64 [etp * n_routed_experts])
            add("all_gather", "etp", 8 * d.etp * args.n_routed_experts, fwd=n + r)
            # the rows repeated to / gathered back from the etp peers, forward and backward
            # (sizes depend on routing; ``etp`` x the rows this rank received over ep)
            etp_rows = d.etp * args.n_activated_experts * a * args.dim
            add("all_to_all", "etp", etp_rows, _TN, fwd=4 * n + 2 * r)
            if choice.lora is not None and choice.lora.experts:
                # LoRA expert adapters: the factor replicated over etp (w1/w3's A, w2's B) gets
                # its partial gradient all-reduced over etp by each backward, in the compute dtype
                # FSDP gathered it in (models/parallel/lora_experts.py)
                from .lora import etp_replicated_factors

                for numel in etp_replicated_factors(model, flavor, key, d, rank, tuple(moe_layers), choice.lora):
                    add("all_reduce", "etp", pb * numel, fwd=1)

        if pp and plan is not None:
            # the activations between stages: this tp rank's sequence shard under SP (sent to
            # the same tp rank of the next stage), the cp-local sequence otherwise (x tn)
            msg = a * args.dim
            # a neighbouring stage on this rank (ZBVZeroBubble's V turn) gets it in memory
            if not embed and stage_id - 1 not in stage_ids:
                add("send_recv", "pp", msg, _TN, fwd=2)  # recv activation, send its grad
            if not head and stage_id + 1 not in stage_ids:
                add("send_recv", "pp", msg, _TN, fwd=2)  # send activation, recv grad

    # once per step
    loss_size = d.dp_replicate * d.dp_shard * d.cp
    # DeepSeek-V3's MTP depths under pp: the first stage's embedding gradient and the last
    # stage's copies' summed gradient are all-reduced over the embedding group (pp = 2,
    # models/parallel/pipeline/tied.py), this rank's local fp32 shard, once per step; a rank
    # holding both ends (a V schedule) sums them locally
    if pp and getattr(args, "mtp_layers", 0):
        holds_embed = any(e for _, e, _ in stages)
        holds_copies = any(i >= args.n_layers for layers, _, _ in stages for i in layers)
        if holds_embed != holds_copies:
            from .inventory import rank_shards

            params, _ = model_inventory(model, flavor, **dict(key))
            emb = [s for s in rank_shards(params, d, layout, rank, choice.mixed, (), True, False)
                   if s.info.group == "tok_embeddings"]  # fmt: skip
            add("all_reduce", "pp", 4 * emb[0].local_numel, step=1)
    # (with MTP depths the loss travels with the MTP loss: two float32, trainer/trainer.py)
    loss_bytes = 8 if getattr(args, "mtp_layers", 0) else 4
    if loss_size > 1:
        add("all_reduce", "loss", loss_bytes, step=1)
    # the grad norm's sums of squares are float64 (trainer/optim/grad_clip.py), the loss float32
    if pp:
        add("all_reduce", "pp", 8, step=1)  # grad-norm squares over stages
        add("all_reduce", "pp", loss_bytes, step=1)  # loss sum over stages
    for mesh in _grad_norm(model, flavor, key, d, tuple(stages), dense_size, expert_size, separate, rank):
        add("all_reduce", mesh, 8, step=1)
    if has_moe:
        n_moe = sum(1 for layers, _, _ in stages for i in layers if i >= getattr(args, "n_dense_layers", 0))
        if n_moe:
            counts = 4 * n_moe * args.n_routed_experts
            for mesh, size in (("loss", loss_size), ("tp", d.tp)):
                if size > 1:
                    add("all_reduce", mesh, counts, step=1)
    weights: dict = {}
    for (_kind, _mesh, typ, b, sid), c in terms.items():
        w = weights.setdefault((typ, sid), [0, 0, 0, 0, 0])
        for i in range(5):
            w[i] += b * c[i]
    return CollectiveTemplate(
        tuple((*k, *c) for k, c in terms.items()), pp, choice.seq_len // d.cp,
        d.tp if choice.sequence_parallel and d.tp > 1 else 1, pb, rb, gb_rule,
        plan.schedule if plan is not None else None, d.pp, plan.stages_per_rank if plan is not None else 1, pp_rank,
        tuple((*k, *w) for k, w in weights.items()),
    )  # fmt: skip


@lru_cache(maxsize=65536)
def _grad_norm(model, flavor, key, d, stages: tuple, dense_size, expert_size, separate, rank: int) -> list:
    """:func:`grad_norm_all_reduces` (cached: no batch split or AC choice changes it)."""
    from .inventory import cached_layout

    return grad_norm_all_reduces(
        model, flavor, key, d, list(stages), dense_size, expert_size, separate, cached_layout(d), rank
    )


@lru_cache(maxsize=65536)
def _tp_input_grads(model, flavor, key, layers, frozen_entry: bool) -> tuple[int, tuple]:
    """The TP input-gradient reductions of ``layers``' blocks per forward: (modules whose input
    stays a DTensor: one reduction of the block's full activation each; ((width, count), ...)
    of the column-wise projections of the others, each all-reduced on its own)."""
    stays = 0
    widths: Counter = Counter()
    for i in layers:
        for stays_dtensor, module_widths in tp_colwise_modules(model, flavor, key, i, frozen_entry and i == 0):
            if stays_dtensor:
                stays += 1
            else:
                widths.update(module_widths)
    return stays, tuple(sorted(widths.items()))


@lru_cache(maxsize=65536)
def _stage_fsdp(
    model, flavor, key, d, rank: int, mixed: bool, layers, embed: bool, head: bool, reshard: str, pp: bool, pb: int,
    rb: int, float8, lora_opts,
) -> tuple:  # fmt: skip
    """FSDP's all-gathers, reduce-scatters and HSDP all-reduces of one stage's groups, summed
    per record: ((kind, mesh, bytes), groups resharded after forward, other gathering groups,
    reductions per gradient sync), for :func:`predict_collectives` to scale by its gathers and
    syncs per step."""
    from .inventory import block_group, fsdp_meshes, model_inventory, stage_summary

    _, args = model_inventory(model, flavor, **dict(key))
    dense_size, _, _ = fsdp_meshes(d, args.has_experts, mixed)
    groups = stage_summary(model, flavor, key, d, rank, mixed, layers, embed, head)
    last_block = block_group(args, max(layers)) if len(layers) else None
    out: dict = {}

    def add(k, flag: int, plain: int, sync: int) -> None:
        counts = out.setdefault(k, [0, 0, 0])
        counts[0] += flag
        counts[1] += plain
        counts[2] += sync

    # FSDP float8 all-gather: the converted linears' weights gathered at 1 byte per element
    f8_gathered = {}
    if float8_all_gather(float8) and (dense_size or 1) > 1:
        f8_gathered = float8_gathered_numel(
            model, flavor, key, d, rank, mixed, layers, embed, head, tuple(float8.filter_fqns)
        )
    # LoRA: the adapters are gathered with their group; only they are reduced (frozen base)
    lora = None
    if lora_opts is not None:
        from .lora import adapter_group_summary

        lora = adapter_group_summary(model, flavor, key, d, rank, mixed, layers, embed, head, lora_opts)
    for g in groups:
        if g.name is None:
            continue
        gathered, reduced, replicated = g.unsharded, g.unsharded, g.shard
        if lora is not None:
            extra, shard = lora.get(g.name, (0, 0))
            gathered, reduced, replicated = g.unsharded + extra, extra, shard
        if g.size > 1:
            flag = g.name not in ("head", last_block) and _fsdp_reshard(reshard, pp, g.size)
            # without pipelining: gathered for forward, again for backward when resharded
            # after forward. Pipelined, the stage keeps its parameters unsharded after each
            # micro-batch's backward until the step's reduction (torch's stage): a group
            # resharded after forward is gathered by every forward that follows a forward
            # or starts the step, and by every backward that follows a forward; each stage
            # runs m forwards and m backwards from a forward to a backward, so m + 1 times
            # in any order (once without resharding; a split-backward schedule with
            # resharding is refused by trainer.plan.plan_job: it dropped weight gradients)
            add(
                ("all_gather", g.mesh, gathered * pb - f8_gathered.get(g.name, 0) * (pb - 1)),
                int(flag),
                int(not flag),
                0,
            )
            if reduced:
                add(("reduce_scatter", g.mesh, reduced * rb), 0, 0, 1)
        if d.dp_replicate > 1 and replicated:
            add(("all_reduce", "dp_replicate", replicated * rb), 0, 0, 1)
    return tuple((k, *counts) for k, counts in out.items())


def _kv_bytes_per_token(args, tp: int) -> int:
    """Elements of K plus V per token after head repetition (what the CP core gathers)."""
    if hasattr(args, "kv_lora_rank"):
        return 2 * (args.n_heads // tp) * args.qk_head_dim  # v padded to the q/k head dim
    return 2 * (args.n_heads // tp) * args.head_dim
