"""Memory-bound activation work of one training step: bytes the non-matmul ops move.

Matmuls and attention are priced by their FLOPs (:mod:`tools.planner.compute`); the ops between
them -- RMSNorm, RoPE, SwiGLU's gate, residual adds, GQA's K/V head repetition, MLA's
concatenations and V padding, MoE routing (gather into expert order, the float32 weighted
combine), the loss's float32 log-softmax -- do a few FLOPs per byte and run at the memory
bandwidth. Each is priced at its minimum traffic: every input read once and every output written
once (one fused kernel per op; eager code that splits an op into several kernels moves more, and
a compiler that fuses neighbouring ops moves less). Read off the forward code of
``models/common`` (RMSNorm, SwiGLU), ``models/llama3/model.py`` and ``models/deepseek_v3``
(MLA, ``moe.py``: ``index_select`` dispatch, ``routed_out.float() * weights`` combined with
``index_add`` into float32, cast back) and ``trainer/forward.py`` (``cross_entropy`` of the
float32 logits).

Per micro-batch, per rank (notation of :mod:`tools.planner.activations`: ``t`` tokens in
attention and the MLP, ``tn`` the sequence-parallel shard, ``a`` bytes per activation element):

* forward: the element counts below x ``a`` (float32 where the code computes in float32);
* backward: 2 x the forward (a unary op reads its input and the output gradient and writes the
  input gradient, 3 accesses for the forward's 2; a binary op 5 for 3);
* recomputation: activation checkpointing keeps the matmul and attention outputs (selective,
  per op) or only the block input (full) and recomputes every elementwise op of a checkpointed
  block: one more forward of them (selective AC's every-N-th-block option: the checkpointed
  blocks only);
* the loss (last stage, logits ``t x V/tp``): the float32 cast (``a + 4`` bytes per logit), the
  log-softmax (read and write float32: 8), and in backward its gradient (8) and the cast back
  (``4 + a``); not recomputed.

Not priced: the router's top-k and sort over ``tn x experts`` scores (a few bytes per token),
the embedding lookup and its gradient, bias/gain updates.
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
    (``k`` rows of ``dim``), the routed SwiGLU gate, the combine as the code does it (the routed
    output cast to float32, times the weights, ``index_add`` into a zeroed float32 buffer: read
    the source, read and write the destination row, cast back), the shared experts' gate and
    their add."""
    k, d = args.n_activated_experts, args.dim
    h = args.moe_inter_dim // etp
    hs = args.moe_inter_dim * args.n_shared_experts // tp
    dispatch = a * 2 * k * d
    gate = a * 3 * k * h
    combine = (a + 4) * k * d + 8 * k * d + 4 * d + 12 * k * d + (4 + a) * d
    shared = (a * 3 * hs + a * 3 * d) if args.n_shared_experts else 0
    return dispatch + gate + combine + shared


def layer_forward_bytes(args, layer: int, t: int, tn: int, tp: int, etp: int, a: int) -> int:
    """Forward bytes of one transformer layer's memory-bound ops for ``t`` tokens (``tn`` in the
    sequence-parallel regions)."""
    d = args.dim
    mla = hasattr(args, "kv_lora_rank")
    # two RMSNorms and two residual adds (read 2, write 1) on the residual stream
    out = a * tn * (2 * _norm(d) + 2 * 3 * d)
    out += a * t * (_mla_attention(args, tp) if mla else _dense_attention(args, tp))
    moe = args.has_experts and layer >= getattr(args, "n_dense_layers", 0)
    if moe:
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
        recomputed = ac == "full" or (ac == "selective" and (not selective_every or k % selective_every == 0))
        passes = 1 + BACKWARD_FACTOR + (1 if recomputed else 0)
        total += passes * layer_forward_bytes(args, i, t, tn, tp, etp, a)
    if head:
        total += (1 + BACKWARD_FACTOR) * a * tn * _norm(args.dim)
        total += t * loss_bytes_per_token(args.vocab_size // tp, a)
    return total
