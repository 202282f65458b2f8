"""The matmul FLOPs one rank computes in one training step, from the layout.

The trainer's FLOPs-per-token formula (``models/common/flops.py``: 6 x active non-embedding
parameters + 12 x layers x attention width x sequence length) counts the work of the whole
model; a rank of a parallel layout does its own share, and not always an even one: a pipeline
stage holds some of the layers (the last stage also the output projection), tensor parallelism
splits the sharded weights' matmuls but runs the weights it replicates (MLA's low-rank
projections) on the whole gathered sequence on every TP rank, full activation checkpointing runs
each block's forward twice. :func:`rank_matmul_flops` adds it up per weight of the rank's stages,
with the real shards of :mod:`tools.planner.inventory`:

* a weight TP splits (``tp_dim``), and any 2-D weight outside the MoE router: ``2 x tokens x
  local numel`` forward, where ``tokens`` is the rank's whole (CP-local) sequence: sequence
  parallel gathers it before every TP-split projection;
* the router gate (replicated under TP, reading the sequence-parallel shard): ``2 x tokens / tp
  x numel``;
* routed experts: each token's ``top_k`` rows through one expert's full weights, on the tokens
  of the rank's sequence shard (``tokens / tp``); expert and expert-tensor parallelism move rows
  between ranks without changing the sum, and under balanced routing every rank processes as many
  rows as it routes (the fake backend's all-to-all gives exactly that);
* the MoE combine (``models/common/moe.py``: ``combine_routed``): one batched matmul per
  MoE layer, ``[tokens / tp, 1, top_k] @ [tokens / tp, top_k, dim]``, ``2 x tokens / tp x
  top_k x dim`` forward, in the compute dtype (never float8);
* attention (scaled dot product, forward ``2 x b x heads x q_len x kv_len x (qk dim + v dim)``,
  the kernel's whole rectangle: causal masking is not discounted, as in the trainer's formula):
  the rank's heads (``n_heads / tp``); under CP its two load-balanced query chunks, each against
  the key prefix it can see (:func:`_pairs`); MLA's v is padded to the q/k head dim
  (``models/deepseek_v3``), so both dims are the q/k dim;
* the output projection on the last stage (vocabulary split by TP under loss parallel), run on
  the main and every MTP depth's states (DeepSeek-V3 ``mtp_layers`` = D: ``(1 + D) x tokens``);
* DeepSeek-V3's MTP depths: blocks like any other on the last stage (``stage_layers``), their
  embedding copies lookups (no FLOPs), their ``eh_proj`` (``tp_roles``: ``replicated_linear``) one
  whole weight on the rank's sequence shard (``tokens / tp`` under sequence parallelism);
* backward = 2 x forward for every matmul (input and weight gradients), and attention's backward
  2 x its forward; full AC adds one forward of every block (not of the head) except the block's
  last projection (the feed-forward's, or under MoE the shared experts', row-wise output
  projection): torch's non-reentrant checkpoint stops recomputing once every tensor the
  backward saved is back, and nothing saves that projection's output (it only feeds the
  residual add; with the MoE's sequence aux loss on, ``aux_loss_coeff > 0``, the aux loss's ops
  save tensors after the shared experts, so their last projection is recomputed too); the
  combine's bmm is recomputed only when something after it in the block saves a tensor (the
  shared experts, the aux loss; without them its saved operands are the block's last ones and
  the recomputation stops as it packs them, before the kernel runs); an MTP depth's block ends
  with ``shared_head.norm``, which saves its input, so full AC recomputes all of its forward; selective AC's
  per-op policy saves every matmul (the combine's bmm included) and attention output
  (``tests/unit/test_activation_checkpoint.py``), so it adds none; its every-N-th-block option
  fully checkpoints every N-th block of each stage chunk, which adds what full AC adds for
  those blocks.

Float8 (``choice.float8``, :mod:`tools.planner.float8`): the same FLOPs, and how many of them
run as float8 GEMMs (``forward_float8``, ``backward_float8``, ``recompute_float8``). The
converted linears (``Float8Options.linears``): their ``2 x tokens x local numel`` forward, its
recomputation, and 2 x that in the backward (the input-gradient half only under
``rowwise_with_gw_hp``). Full AC recomputes a converted last projection too: torchao's float8
linear is an autograd Function, whose saved tensors are packed when its forward has returned,
GEMM included, so the early stop comes after it (measured:
``tests/distributed/test_planner_compute.py``). The converted routed experts
(``Float8Options.moe_fqns``, decided at the layout's etp degree): their whole ``2 x tokens / tp
x top_k x expert numel`` forward, its recomputation (full AC recomputes the routed experts in
any dtype) and 2 x that in the backward, whatever the linears' recipe.

LoRA (``lora``, :func:`tools.planner.lora.stage_lora_weights`): the frozen base computes no
weight gradient, so its linears' (and the router's, the head's, the un-adapted routed experts')
backward is one forward instead of two, and the linears that read the frozen embedding (layer 0's
attention input projections on the first stage) compute no input gradient either; float8
GEMMs keep both halves (torchao's linear and the float8 grouped GEMM compute the weight gradient
whether it is needed or not). Each adapted linear adds ``2 x tokens x (A + B local numel)``
forward (its adapters sharded like its base under TP) and 2 x that backward (four GEMMs: the
weight and input gradients of A and B; not A's input gradient on the embedding readers). Expert
adapters keep the routed experts' weight gradients (the merged weight ``w + scale B A`` needs
one) and add the merge, ``2 x local experts x out x in x rank`` per weight and forward call,
2 x that backward. Full AC also recomputes an adapted last projection's base GEMM and its ``A``
(the adapter saves tensors after them), not its ``B`` (nothing saves B's output).

Checked against the FLOPs a rank really computes (``profiling.matmul_census_step`` of a
fake-backend run, local shards): ``tests/distributed/test_planner_compute.py``.
"""

from __future__ import annotations

from functools import lru_cache

from .choice import LayoutChoice, fully_checkpointed, grad_accum_steps, stage_layers
from .float8 import backward_float8_fraction, converted_expert_weights, converted_weights, float8_keys
from .inventory import cached_layout, model_inventory, rank_shards
from .lora import stage_lora_weights

__all__ = ["rank_matmul_flops"]


def _attention_dims(args) -> tuple[int, int]:
    """(heads, q/k head dim) of the model's attention (v padded to the q/k dim for MLA)."""
    if hasattr(args, "qk_nope_head_dim"):
        return args.n_heads, args.qk_nope_head_dim + args.qk_rope_head_dim
    # the args' own attention width (Qwen3's head_dim is not dim / n_heads)
    return args.n_heads, args.attention_dim // args.n_heads


def _pairs(choice: LayoutChoice, d) -> int:
    """(query, key) pairs the rank's attention kernels compute per step, summed over its
    sequences. Without CP, causal attention runs as one S x S kernel. Under CP
    (``models/parallel/context_parallel.py``) a rank holds head chunk ``r`` and tail chunk
    ``2cp-1-r`` of ``2cp`` chunks of length ``c`` and runs each against the key prefix it can
    see: ``c x (r+1)c + c x (2cp-r)c = (2cp+1) c^2`` pairs on every rank."""
    sequences = choice.local_batch * grad_accum_steps(choice, d)
    if d.cp == 1:
        return sequences * choice.seq_len * choice.seq_len
    c = choice.seq_len // (2 * d.cp)
    return sequences * (2 * d.cp + 1) * c * c


def rank_matmul_flops(
    model: str, flavor: str, degrees, choice: LayoutChoice, rank: int = 0, *, lora=None, **overrides
) -> dict:
    """``{"forward", "backward", "recompute", "total"}``: matmul + attention FLOPs ``rank``
    computes in one optimizer step (see the module docstring); ``forward_float8``,
    ``backward_float8``, ``recompute_float8``: the part of each that runs as float8 GEMMs (0
    without ``choice.float8``). ``lora``: a :class:`~models.parallel.lora.LoRAOptions` (a frozen
    base with adapters), None for a full fine-tune."""
    key = tuple(sorted(overrides.items()))
    return dict(_rank_flops(model, flavor, degrees, choice, rank, key, lora))


_STAGE_WEIGHTS: dict = {}


def _stage_weights(
    model, flavor, key: tuple, degrees, rank: int, layers: range, embed: bool, head: bool,
    f8: tuple | None = None, f8_experts: tuple | None = None,
) -> tuple:  # fmt: skip
    """:func:`_stage_weights_of`, cached on what it reads of the layout: the TP-, EP- and
    ETP-local shapes (:func:`tools.planner.inventory.rank_shards`' ``local_shape``) are fixed by
    those three degrees and the rank's coordinates on them, not by the data-parallel, CP or PP
    degrees (the search asks for the same stage under many of those)."""
    layout = cached_layout(degrees)
    d = degrees
    k = (model, flavor, key, d.tp, d.ep, d.etp, *(layout.coordinate(n, rank) for n in ("tp", "ep", "etp")),
         layers, embed, head, f8, f8_experts)  # fmt: skip
    hit = _STAGE_WEIGHTS.get(k)
    if hit is None:
        if len(_STAGE_WEIGHTS) >= 65536:
            _STAGE_WEIGHTS.clear()
        hit = _STAGE_WEIGHTS[k] = _stage_weights_of(model, flavor, key, degrees, rank, layers, embed, head, f8,
                                                    f8_experts)  # fmt: skip
    return hit


def _stage_weights_of(
    model, flavor, key: tuple, degrees, rank: int, layers: range, embed: bool, head: bool,
    f8: tuple | None = None, f8_experts: tuple | None = None,
) -> tuple:  # fmt: skip
    """Weight sums of one stage of ``rank`` (cached: they do not depend on batch, AC or dtype):
    (TP-local numel of the blocks' weights read by the whole sequence, router numel, routed
    expert numel per token (top_k experts), numel of the blocks' last projections, head
    numel, the float8-converted part of the first and of the fourth, the float8 routed
    expert numel per token, and the numel of the replicated linears read by the rank's
    sequence shard (MTP's ``eh_proj``, ``tp_roles``) with its float8-converted part); ``f8``: the linear converter's ``filter_fqns``, None when no linear
    converts; ``f8_experts``: the expert converter's ``moe_fqns``, None when no expert does."""
    params, args = model_inventory(model, flavor, **dict(key))
    top_k = getattr(args, "n_activated_experts", 0)
    converted = converted_weights(model, flavor, key, f8) if f8 is not None else frozenset()
    if f8_experts is not None:
        converted_experts = converted_expert_weights(model, flavor, key, f8_experts, degrees.etp)
    else:
        converted_experts = frozenset()
    # the MoE's sequence aux loss saves tensors after the shared experts, so full AC recomputes
    # their last projection too
    aux = getattr(args, "aux_loss_coeff", 0) > 0
    whole = router = experts = last = head_numel = whole8 = last8 = experts8 = replicated = replicated8 = 0
    for s in rank_shards(params, degrees, cached_layout(degrees), rank, False, layers, embed, head):
        info = s.info
        if len(info.shape) < 2 or info.group == "tok_embeddings" or info.role == "embedding":
            continue  # embedding lookups (the MTP depths' copies too): no matmul
        if info.role == "replicated_linear":  # MTP's eh_proj: the whole weight on the rank's sequence shard
            replicated += info.numel
            replicated8 += info.numel if info.fqn in converted else 0
        elif info.expert:
            per_token = top_k * (info.numel // info.shape[0])
            experts += per_token
            experts8 += per_token if info.fqn in converted_experts else 0
        elif info.tp_dim is None and ".router." in info.fqn:
            router += info.numel
        elif info.layer is None:
            head_numel += s.tp_local_numel
        else:
            whole += s.tp_local_numel
            # (an MTP depth's block norms its output after it, shared_head.norm, which saves
            # its input: its last projection is recomputed like the rest)
            is_last = (
                info.tp_dim == 1
                and info.group.startswith("layers.")
                and (".feed_forward." in info.fqn or (".shared_experts." in info.fqn and not aux))
            )
            if is_last:
                last += s.tp_local_numel
            if info.fqn in converted:
                whole8 += s.tp_local_numel
                last8 += s.tp_local_numel if is_last else 0
    return whole, router, experts, last, head_numel, whole8, last8, experts8, replicated, replicated8


@lru_cache(maxsize=65536)
def _rank_flops(model, flavor, degrees, choice: LayoutChoice, rank: int, key: tuple, lora=None) -> tuple:
    _, args = model_inventory(model, flavor, **dict(key))
    d = degrees
    stages, _ = stage_layers(args, d, choice, rank, cached_layout(d))
    # every micro-batch of the step: local_batch sequences per accumulation step, CP-local
    tokens = choice.local_batch * grad_accum_steps(choice, d) * choice.seq_len // d.cp
    moe_tokens = tokens // d.tp  # the sequence-parallel shard the router and experts read
    # MTP's eh_proj (a replicated weight on the blocks' layout): the sequence shard under SP
    shard_tokens = tokens // d.tp if choice.sequence_parallel else tokens
    # DeepSeek-V3's MTP depths: the output projection runs on the main and each depth's states
    head_passes = 1 + getattr(args, "mtp_layers", 0)
    heads, head_dim = _attention_dims(args)
    pairs = _pairs(choice, d)
    blocks = head = recompute = linear8 = expert8 = recompute8 = 0.0
    # LoRA: the adapters' and the expert merges' forward, and the backward the frozen base skips
    adapters = adapters_bwd = merges = skipped = 0.0
    forwards = grad_accum_steps(choice, d) * (choice.n_microbatches if d.pp > 1 else 1)
    f8, f8_experts = float8_keys(choice.float8)

    first_moe = getattr(args, "n_dense_layers", 0) if getattr(args, "has_experts", False) else None
    # the combine's [T, 1, top_k] @ [T, top_k, dim] bmm per MoE layer, per routed token
    combine = 2 * getattr(args, "n_activated_experts", 0) * args.dim
    # full AC recomputes it when a later op of the block saves a tensor (the shared experts',
    # the sequence aux loss's)
    combine_redone = bool(getattr(args, "n_shared_experts", 0)) or getattr(args, "aux_loss_coeff", 0) > 0

    def moe_layers(layers) -> int:
        return 0 if first_moe is None else sum(1 for i in layers if i >= first_moe)

    def block_flops(whole, router, experts, layers, replicated):
        # Q K^T and P V: b * heads/tp * (query, key) pairs * (qk + v dims)
        attention = len(layers) * 2 * pairs * (heads // d.tp) * 2 * head_dim
        return (
            2 * tokens * whole
            + 2 * moe_tokens * (router + experts)
            + 2 * shard_tokens * replicated
            + attention
            + moe_tokens * combine * moe_layers(layers)
        )

    for layers, embed, has_head in stages:
        stage = _stage_weights(model, flavor, key, d, rank, layers, embed, has_head, f8, f8_experts)
        whole, router, experts, last, head_numel, whole8, last8, experts8, replicated, replicated8 = stage
        blocks += block_flops(whole, router, experts, layers, replicated)
        linear8 += 2 * tokens * whole8 + 2 * shard_tokens * replicated8
        expert8 += 2 * moe_tokens * experts8
        head += 2 * tokens * head_numel * head_passes
        if lora is not None:
            lo = stage_lora_weights(model, flavor, key, d, rank, layers, embed, has_head, lora, f8)
            n_adapters, _, _, entry_base, entry_a, merge = lo
            adapters += 2 * tokens * n_adapters
            # 4 GEMMs per adapter in backward (A's and B's weight and input gradients), but no
            # input gradient of the A reading the embedding
            adapters_bwd += 4 * tokens * n_adapters - 2 * tokens * entry_a
            merges += 2 * forwards * merge
            # frozen weights: no weight-gradient GEMM (except float8's: torchao's and the float8
            # grouped GEMM's backward compute it anyway), nor the input gradient of the linears
            # reading the embedding; the routed experts compute theirs when adapted (the merged
            # weight needs a gradient)
            skipped += 2 * tokens * (whole - whole8 + head_numel + entry_base) + 2 * moe_tokens * router
            if not lora.experts:
                skipped += 2 * moe_tokens * (experts - experts8)
        # the fully checkpointed blocks run their forward again, but their last projection
        redo = fully_checkpointed(choice, layers)
        if redo:
            if len(redo) < len(layers):
                stage = _stage_weights(model, flavor, key, d, rank, tuple(redo), False, False, f8, f8_experts)
                whole, router, experts, last, _, whole8, last8, experts8, replicated, replicated8 = stage
            # a float8 last projection is recomputed: its saved tensors are packed only once its
            # autograd Function's forward, GEMM included, has returned
            recompute += block_flops(whole, router, experts, redo, replicated) - 2 * tokens * (last - last8)
            if lora is not None:
                # the adapter GEMMs after an adapted last projection save tensors, so its base GEMM
                # and A are recomputed; nothing saves B's output
                lo = stage_lora_weights(model, flavor, key, d, rank, tuple(redo), False, False, lora, f8)
                n_adapters, last_b, last_base, _, _, merge = lo
                recompute += 2 * tokens * (n_adapters - last_b + last_base) + 2 * forwards * merge
            if not combine_redone:  # (an MTP block's shared_head.norm saves after the combine)
                recompute -= moe_tokens * combine * moe_layers([i for i in redo if i < args.n_layers])
            recompute8 += 2 * tokens * whole8 + 2 * moe_tokens * experts8 + 2 * shard_tokens * replicated8
    forward = blocks + head
    backward = 2 * forward - skipped + adapters_bwd + 2 * merges
    forward += adapters + merges
    # a converted expert's backward is all float8; a linear's per the recipe
    backward8 = 2 * linear8 * (backward_float8_fraction(choice.float8) if f8 is not None else 0.0) + 2 * expert8
    return (("forward", forward), ("backward", backward), ("recompute", recompute),
            ("total", forward + backward + recompute), ("forward_float8", linear8 + expert8),
            ("backward_float8", backward8), ("recompute_float8", recompute8))  # fmt: skip
