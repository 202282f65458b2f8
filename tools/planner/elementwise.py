"""Memory-bound activation work of one training step: bytes the non-matmul ops move.

Matmuls and attention are priced by their FLOPs (:mod:`tools.planner.compute`); the ops between
them -- RMSNorm, RoPE, SwiGLU's gate, residual adds, GQA's K/V head repetition, MLA's
concatenations and V padding, MoE routing (gather into expert order, un-permute and weighted
combine), the loss's float32 log-softmax -- do a few FLOPs per byte and run at the memory
bandwidth. Each is priced at its minimum traffic: every input read once and every output written
once (one fused kernel per op; eager code that splits an op into several kernels moves more, and
a compiler that fuses neighbouring ops moves less). Read off the forward code of
``models/common`` (RMSNorm, SwiGLU, ``gqa.py``; ``moe.py``: ``index_select`` dispatch,
``combine_routed``: the routed output un-permuted by ``index_put_`` into ``[tokens, top_k,
dim]`` and reduced by one ``bmm`` with the weights cast to the compute dtype, all in the compute
dtype), ``models/deepseek_v3`` (MLA) and ``trainer/forward.py``
(``cross_entropy`` of the float32 logits). The combine's ``bmm`` is a matmul whose FLOPs
:mod:`tools.planner.compute` counts (the trainer's census sees it), but with ``top_k``
multiply-adds per output element it does about one FLOP per byte it moves, far below any GPU's
ridge point: its time is its traffic, priced here too.

Per micro-batch, per rank (notation of :mod:`tools.planner.activations`: ``t`` tokens in
attention and the MLP, ``tn`` the sequence-parallel shard, ``a`` bytes per activation element):

* forward: the element counts below x ``a`` (float32 where the code computes in float32);
* backward: 2 x the forward (a unary op reads its input and the output gradient and writes the
  input gradient, 3 accesses for the forward's 2; a binary op 5 for 3; the MoE combine's bmm
  exactly 2 x; the permutation copies of the MoE dispatch and un-permute move less, one
  scatter or gather of the gradient rows, and are priced at 2 x like the rest);
* recomputation: activation checkpointing keeps the matmul and attention outputs (selective,
  per op) or only the block input (full) and recomputes every elementwise op of a checkpointed
  block: one more forward of them (selective AC's every-N-th-block option: the checkpointed
  blocks only); the MoE combine's bmm, priced here as traffic, only where it reruns
  (:func:`_combine_bmm_recomputed`);
* the loss (last stage, logits ``t x V/tp``): the float32 cast (``a + 4`` bytes per logit), the
  log-softmax (read and write float32: 8), and in backward its gradient (8) and the cast back
  (``4 + a``); not recomputed.

Not priced: the router's top-k and sort over ``tn x experts`` scores (a few bytes per token),
the int64 index vectors the MoE dispatch and un-permute read (8 bytes per routed row), the
embedding lookup and its gradient, bias/gain updates.
"""

from __future__ import annotations

__all__ = ["BACKWARD_FACTOR", "elementwise_bytes", "loss_bytes_per_token"]

# backward traffic of an elementwise op relative to its forward (see the module docstring)
BACKWARD_FACTOR = 2


def _norm(d: int) -> int:
    """RMSNorm: read the input, write the output."""
    return 2 * d


def _dense_attention(args, tp: int) -> int:
    """GQA per token (in ``t``): RoPE on q and k (read + write), and K/V repeated to the query
    heads when there are fewer KV heads (a copy: read kv, write q width, for k and v)."""
    nh, nkv, hd = args.n_heads // tp, args.kv_heads // tp, args.head_dim
    qw, kvw = nh * hd, nkv * hd
    rep = 2 * (kvw + qw) if nh != nkv else 0
    return 2 * (qw + kvw) + rep


def _mla_attention(args, tp: int) -> int:
    """MLA per token (in ``t``): the KV latent norm (and the q latent norm when q is low-rank),
    RoPE on q's and k's rope parts, q and k concatenated to the full head dim, v padded to it and
    the attention output sliced back (read + write each)."""
    nh = args.n_heads // tp
    qk, r, rope, vd = args.qk_head_dim, args.kv_lora_rank, args.qk_rope_head_dim, args.v_head_dim
    out = _norm(r) + 2 * (nh * rope + rope) + 2 * (2 * nh * qk)
    if args.q_lora_rank:
        out += _norm(args.q_lora_rank)
    if vd < qk:
        out += 2 * (nh * vd + nh * qk)  # pad v, slice the output
    return out


def _moe(args, etp: int, tp: int, a: int) -> int:
    """Bytes per token (in ``tn``) of a MoE layer's memory-bound work: the dispatch gather
    (``k`` rows of ``dim``), the routed SwiGLU gate, the combine as ``combine_routed`` does it
    (in the compute dtype, no float32 copy: the float32 weights cast to the compute dtype, a
    no-op in float32; the ``index_put_`` un-permute reads and writes the ``k`` routed rows into
    a buffer ``new_empty`` leaves unwritten; the ``bmm`` reads the ``k`` rows and ``k`` weights
    and writes one row), the shared experts' gate and their add."""
    k, d = args.n_activated_experts, args.dim
    h = args.moe_inter_dim // etp
    hs = args.moe_inter_dim * args.n_shared_experts // tp
    dispatch = a * 2 * k * d
    gate = a * 3 * k * h
    weights_cast = (4 + a) * k if a != 4 else 0
    unpermute = a * 2 * k * d
    combine = _combine_bmm(args, a)
    shared = (a * 3 * hs + a * 3 * d) if args.n_shared_experts else 0
    return dispatch + gate + weights_cast + unpermute + combine + shared


def _combine_bmm(args, a: int) -> int:
    """Bytes per token (in ``tn``) of the MoE combine's ``bmm``: read the ``k`` un-permuted rows
    and the ``k`` weights, write one row. Its backward (two bmms: the weights' gradient reads the
    output gradient and the rows and writes ``k`` values, the rows' gradient reads the weights
    and the output gradient and writes ``k`` rows) moves exactly 2 x this."""
    k, d = args.n_activated_experts, args.dim
    return a * (k * d + k + d)


def _moe_layer(args, layer: int) -> bool:
    return bool(args.has_experts) and layer >= getattr(args, "n_dense_layers", 0)


def _combine_bmm_recomputed(args, fully: bool) -> bool:
    """Whether AC's recomputation reruns the combine's bmm: never under selective AC's per-op
    policy (it saves every matmul output); in a fully checkpointed block only when a later op
    of the block saves a tensor (the shared experts, the sequence aux loss), else the
    recomputation stops as the bmm packs its operands, before its kernel runs
    (:mod:`tools.planner.compute`)."""
    return fully and (bool(getattr(args, "n_shared_experts", 0)) or getattr(args, "aux_loss_coeff", 0) > 0)


def layer_forward_bytes(args, layer: int, t: int, tn: int, tp: int, etp: int, a: int) -> int:
    """Forward bytes of one transformer layer's memory-bound ops for ``t`` tokens (``tn`` in the
    sequence-parallel regions)."""
    d = args.dim
    mla = hasattr(args, "kv_lora_rank")
    # two RMSNorms and two residual adds (read 2, write 1) on the residual stream
    out = a * tn * (2 * _norm(d) + 2 * 3 * d)
    out += a * t * (_mla_attention(args, tp) if mla else _dense_attention(args, tp))
    if _moe_layer(args, layer):
        out += tn * _moe(args, etp, tp, a)
    else:
        hidden = (args.ffn_hidden_dim if not mla else args.inter_dim) // tp
        out += a * t * 3 * hidden  # SwiGLU's silu(x w1) * (x w3): read 2, write 1
    return out


def loss_bytes_per_token(vocab_local: int, a: int) -> int:
    """Forward + backward bytes per token of the loss over ``vocab_local`` logits."""
    return vocab_local * ((a + 4) + 8 + 8 + (4 + a))


def elementwise_bytes(
    args, layers, b: int, seq_len: int, *, tp: int = 1, cp: int = 1, etp: int = 1, sp: bool = True,
    act_bytes: int = 2, ac: str = "none", head: bool = True, selective_every: int | None = None,
) -> int:  # fmt: skip
    """Bytes the memory-bound ops of one micro-batch of ``b`` sequences move on one rank holding
    ``layers`` (and the head when ``head``): forward, backward and AC's recomputation."""
    t = b * (seq_len // cp)
    tn = t // tp if (sp and tp > 1) else t
    a = act_bytes
    total = 0
    for k, i in enumerate(layers):
        fully = ac == "full" or (ac == "selective" and bool(selective_every) and k % selective_every == 0)
        recomputed = fully or (ac == "selective" and not selective_every)
        forward = layer_forward_bytes(args, i, t, tn, tp, etp, a)
        total += (1 + BACKWARD_FACTOR) * forward
        if recomputed:
            total += forward
            if _moe_layer(args, i) and not _combine_bmm_recomputed(args, fully):
                total -= tn * _combine_bmm(args, a)
    if head:
        # DeepSeek-V3's MTP depths: each adds three norms (enorm, hnorm, shared_head.norm) and
        # one more pass of the loss over its logits (its block is one of ``layers``)
        depth = getattr(args, "mtp_layers", 0)
        total += (1 + BACKWARD_FACTOR) * a * tn * _norm(args.dim) * (1 + 3 * depth)
        total += (1 + depth) * t * loss_bytes_per_token(args.vocab_size // tp, a)
    return total
