"""Activation memory per micro-batch, derived from what the model code saves for backward.

Every term below is a tensor autograd (or activation checkpointing) keeps alive from the end
of the forward to the backward, read off the forward code of ``models/common`` (RMSNorm,
SwiGLU, ``gqa.py``: GQA attention and RoPE, ``moe.py``: MoE), ``models/deepseek_v3`` (MLA)
and torch's derivative formulas; checked term by term against
:func:`tools.planner.measure.measure_activations` on CPU (exact for the debug models in float32
and bfloat16, ``tests/unit/test_planner.py``). Notation, per rank and micro-batch: ``b``
sequences of ``s = seq_len / cp`` local tokens, ``T = b*s``; ``Tn = T / tp`` tokens where
sequence parallelism shards them (norms, residual stream, MoE routing), ``T`` inside attention
and the MLP; ``a`` bytes per activation element (the FSDP compute dtype); 4 = float32.

* RMSNorm keeps its float32 input (``x.float()``; in float32 the input itself), the float32
  ``rsqrt`` (``4 Tn``) and the normalized tensor before the gain (``a Tn D``); the residual
  stream itself is kept only through these.
* GQA attention: the projections' input (``a T D``, the norm output or, under TP, its
  all-gathered copy), rotated q, k and v after head repetition (rotation multiplies by
  constant RoPE rows, which saves no copy of q/k), the SDPA output and its float32
  log-sum-exp (``4 b heads s``). Under CP the gathered K and V hold the whole sequence.
* MLA: q and k after the rope concatenation, v padded to the q/k head dim (for the fused
  kernel), the padded SDPA output and the sliced copy for ``wo``, plus the KV latent norm.
* SwiGLU: ``w1`` output, its SiLU, ``w3`` output and their product (``4 a T F``).
* MoE: router scores (float32 sigmoid/softmax), top-k indices, weights, the sort order and
  token index (int64), the gathered expert input (``a Tk D``), the experts' SwiGLU on the
  routed rows (``4 a Tk H``, ``Tk = Tn * top_k`` rows, balanced routing over ep assumed; no
  padding mask: MoE states ``has_padding=False``), what the combine's batched matmul keeps
  (``combine_routed``: the un-permuted routed output ``[Tn, top_k, D]``, ``a Tk D``, and the
  weights cast to the compute dtype, ``a Tk``; the ``index_put_`` un-permute keeps only the
  sort order), and the shared experts' SwiGLU. Selective AC also saves the combine's
  ``bmm`` output (``a Tn D``).
* Full AC keeps only each block's input (``a Tn D``); the backward recomputes one block at a
  time, so the peak adds one block's no-AC activations (reported as ``recompute``).
* Selective AC (``op``) keeps each block's input and the outputs of every matmul, grouped
  matmul, SDPA and collective (``models/parallel/activation_checkpoint.py``: ``_SAVE_OPS``);
  with an integer option N every N-th block holds what full AC holds and the others what no AC
  holds.
* Outside the blocks: the final norm and its output, the logits (``a T V/tp``, kept by the
  train step) and the float32 log-softmax of the loss (``4 T V/tp``). Transient, when the
  loss's backward starts: its two float32 gradients (the NLL's and the log-softmax's,
  ``8 T V/tp``, ``loss_grads``, one micro-batch's at a time); the logits alone stay until the
  backward returns (``logits``, what the trainer's forward holds). DeepSeek-V3's MTP depths
  are blocks like the others (on the stage with the head) plus, each, three norms and
  ``eh_proj``'s ``[Tn, 2D]`` input; the head then runs on ``(1 + D) T`` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ActivationEstimate", "activation_bytes"]


@dataclass(frozen=True)
class ActivationEstimate:
    layers: int  # bytes held by this rank's transformer layers
    head: int  # final norm, logits and loss buffers (last stage only)
    recompute: int  # transient peak of recomputing one block in backward (full AC)
    logits: int = 0  # the logits (compute dtype), part of ``head``, held until the backward returns
    loss_grads: int = 0  # the plain loss backward's two float32 [T, V/tp] gradients (transient)

    @property
    def held(self) -> int:
        return self.layers + self.head


def _norm(tn: int, d: int, a: int) -> int:
    return 4 * tn * d + 4 * tn + a * tn * d


def _gqa(args, t: int, b: int, s: int, tp: int, cp: int, a: int, ac: str) -> int:
    nh, nkv, hd = args.n_heads // tp, args.kv_heads // tp, args.head_dim
    qw, kvw = nh * hd, nkv * hd
    if ac == "selective":  # q, k, v, o projections + SDPA output and lse
        return a * t * (qw + 2 * kvw) + a * t * qw + 4 * b * nh * s + a * t * args.dim
    rep_w = qw if nh != nkv else kvw
    kv = 2 * a * t * rep_w * cp  # CP: K/V gathered over the whole sequence
    held = a * t * args.dim + a * t * qw + kv + a * t * qw + 4 * b * nh * s
    if getattr(args, "qk_norm", False):  # Qwen3: RMSNorm per q and k head before RoPE
        # its float32 input, rsqrt per head and normalized output (input dtype), for q and k
        held += 4 * t * (qw + kvw) + 4 * t * (nh + nkv) + a * t * (qw + kvw)
    return held


def _mla(args, t: int, b: int, s: int, tp: int, cp: int, a: int, ac: str) -> int:
    nh = args.n_heads // tp
    qk, r, rope, vd, nope = (
        args.qk_head_dim,
        args.kv_lora_rank,
        args.qk_rope_head_dim,
        args.v_head_dim,
        args.qk_nope_head_dim,
    )
    q_lora = args.q_lora_rank
    if ac == "selective":
        out = a * t * (r + rope) + a * t * nh * (nope + vd) + a * t * nh * qk + 4 * b * nh * s + a * t * args.dim
        out += a * t * nh * qk if q_lora == 0 else a * t * q_lora + a * t * nh * qk
        return out
    held = a * t * args.dim  # projections' input
    if q_lora:
        held += 4 * t * q_lora + 4 * t + 2 * a * t * q_lora  # q latent norm (float32 input, rsqrt, ...)
    held += a * t * nh * qk  # q after the rope concatenation
    held += 4 * t * (r + rope) if a == 4 else 4 * t * r  # kv latent norm's float32 input
    held += 4 * t + 2 * a * t * r  # kv norm rsqrt, normalized latent, norm output
    held += a * t * nh * qk * cp  # k (gathered under CP)
    held += (a * t * nh * qk if vd < qk else a * t * nh * (nope + vd)) * cp  # v (padded)
    held += 4 * b * nh * s + a * t * nh * qk  # lse, SDPA output (padded)
    held += a * t * nh * vd if vd < qk else 0  # the sliced copy fed to wo
    return held


def _swiglu(t: int, hidden: int, a: int, ac: str, dim: int) -> int:
    if ac == "selective":  # w1, w3, w2 outputs
        return 2 * a * t * hidden + a * t * dim
    return 4 * a * t * hidden


def _moe(args, tn: int, tp: int, etp: int, a: int, ac: str) -> int:
    k, e, d = args.n_activated_experts, args.n_routed_experts, args.dim
    h = args.moe_inter_dim // etp
    hs = args.moe_inter_dim * args.n_shared_experts // tp
    tk = tn * k
    shared = _swiglu(tn, hs, a, ac, d) if args.n_shared_experts else 0
    if ac == "selective":  # gate, grouped GEMMs, the combine's bmm, shared experts' matmuls
        return a * tn * e + 2 * a * tk * h + a * tk * d + a * tn * d + shared
    # float32 scores, int64 top-k, float32 gathered weights, their float32 sum (route_norm),
    # int64 sort order and token index, int32 group offsets
    routing = 4 * tn * e + 8 * tk + 4 * tk + 4 * tn + 8 * tk + 8 * tk + 4 * e
    # gathered input, routed SwiGLU, the bmm's un-permuted operand and its compute-dtype weights
    experts = a * tk * d + 4 * a * tk * h + a * tk * d + a * tk
    return routing + experts + shared


def layer_bytes(args, layer: int, b: int, seq_len: int, tp: int, cp: int, etp: int, sp: bool, a: int, ac: str) -> int:
    """Bytes one transformer layer holds for backward (see the module docstring)."""
    s = seq_len // cp
    t = b * s
    tn = t // tp if (sp and tp > 1) else t
    d = args.dim
    if ac == "full":
        return a * tn * d
    mla = hasattr(args, "kv_lora_rank")
    attn = (_mla if mla else _gqa)(args, t, b, s, tp, cp, a, ac)
    moe = args.has_experts and layer >= getattr(args, "n_dense_layers", 0)
    gathered = tp > 1 and sp  # all-gathered copies of the norm outputs
    if ac == "selective":
        held = a * tn * d + attn  # block input + matmul/SDPA outputs
        if moe:
            held += _moe(args, tn, tp, etp, a, ac)
        else:
            hidden = (args.ffn_hidden_dim if not mla else args.inter_dim) // tp
            held += _swiglu(t, hidden, a, ac, d)
        if gathered:  # collective outputs are saved too: 2 all-gathers, 2 reduce-scatters
            held += 2 * a * t * d + 2 * a * tn * d
        return held
    held = 2 * _norm(tn, d, a) + attn
    if moe:
        held += a * tn * d + _moe(args, tn, tp, etp, a, ac)  # + the router/shared input
    else:
        hidden = (args.ffn_hidden_dim if not mla else args.inter_dim) // tp
        held += a * t * d + _swiglu(t, hidden, a, ac, d)
    return held


def head_bytes(args, b: int, seq_len: int, tp: int, cp: int, sp: bool, a: int) -> int:
    """The final norm, the head's input, the logits and the loss's log-softmax; with
    DeepSeek-V3's MTP depths (``mtp_layers`` = D, their blocks counted as layers) also what each
    depth holds outside its decoder block (:func:`_mtp_extra`), and the head runs on the main
    and every depth's states: ``(1 + D) x`` its input, logits and log-softmax."""
    t = b * (seq_len // cp)
    tn = t // tp if (sp and tp > 1) else t
    v = args.vocab_size // tp
    passes = 1 + getattr(args, "mtp_layers", 0)
    return _norm(tn, args.dim, a) + passes * (a * t * args.dim + a * t * v + 4 * t * v)


def _mtp_extra(tn: int, d: int, a: int, ac: str, shares_input: bool) -> int:
    """What one MTP depth (``models/deepseek_v3/mtp.py``) holds beyond :func:`layer_bytes` of
    its block. Its input ``h`` (the previous depth's output) is also the input of the previous
    final norm (``norm`` / ``shared_head.norm``), which in float32 keeps that very tensor when it
    runs outside a checkpoint (``shares_input``: the main ``norm``, or a previous depth without
    AC): the ``4 Tn D`` that both count is one storage (measured), so it is taken off once. Without AC:
    ``enorm``, ``hnorm`` and ``shared_head.norm`` (three RMSNorms) and ``eh_proj``'s input, the
    concatenation ``[Tn, 2D]``. Under AC the whole depth is one checkpointed block: full AC
    keeps only its input (in ``layer_bytes``); selective AC also saves ``eh_proj``'s output
    (a matmul, ``a Tn D``)."""
    shared = 4 * tn * d if a == 4 and shares_input else 0
    if ac == "full":
        return -shared
    if ac == "selective":
        return a * tn * d - shared
    return 3 * _norm(tn, d, a) + a * tn * 2 * d - shared


def activation_bytes(
    args, layers, b: int, seq_len: int, *, tp: int = 1, cp: int = 1, etp: int = 1, sp: bool = True,
    act_bytes: int = 2, ac: str = "none", head: bool = True, selective_every: int | None = None,
) -> ActivationEstimate:  # fmt: skip
    """Activations of one micro-batch of ``b`` sequences on one rank holding ``layers`` (and
    the head when ``head``). ``selective_every`` N with ``ac == "selective"``: selective AC's
    integer option, every N-th of ``layers`` (from the first) fully checkpointed, the others
    not checkpointed at all."""
    # layers of one kind (dense / MoE) and AC mode hold the same bytes: compute one of each
    first_moe = getattr(args, "n_dense_layers", 0) if args.has_experts else None
    kinds: dict[tuple[bool, str], list[int]] = {}
    for k, i in enumerate(layers):
        mode = ac
        if ac == "selective" and selective_every:
            mode = "full" if k % selective_every == 0 else "none"
        kinds.setdefault((first_moe is not None and i >= first_moe, mode), []).append(i)
    total = recompute = 0
    # DeepSeek-V3's MTP depths: blocks n_layers .. n_layers + D - 1 (with the head, stage_layers)
    # plus what each holds outside its block
    tn = b * (seq_len // cp) // (tp if (sp and tp > 1) else 1)
    previous = "none"  # the main final norm runs outside any checkpoint
    for k, i in enumerate(layers):
        if i >= args.n_layers:
            mode = ac
            if ac == "selective" and selective_every:
                mode = "full" if k % selective_every == 0 else "none"
            total += _mtp_extra(tn, args.dim, act_bytes, mode, previous == "none")
            previous = mode
    for (_, mode), members in kinds.items():
        total += len(members) * layer_bytes(args, members[0], b, seq_len, tp, cp, etp, sp, act_bytes, mode)
        if mode == "full":
            recompute = max(recompute, layer_bytes(args, members[0], b, seq_len, tp, cp, etp, sp, act_bytes, "none"))
    if not head:
        return ActivationEstimate(total, 0, recompute)
    rows = b * (seq_len // cp) * (1 + getattr(args, "mtp_layers", 0))
    v = args.vocab_size // tp
    h = head_bytes(args, b, seq_len, tp, cp, sp, act_bytes)
    return ActivationEstimate(total, h, recompute, act_bytes * rows * v, 8 * rows * v)
