"""DeepSeek-V3 mixture of experts: grouped token-choice routing, dropless dispatch, grouped
expert compute, auxiliary-loss-free balancing and the optional sequence-wise balance loss.

``GroupedExperts.forward(x, num_tokens_per_expert)`` is the contract expert parallelism wraps:
it receives tokens already sorted by (local) expert and only ever computes on local tensors, so
the EP wrapper can all-to-all tokens in front of it and the weights can be DTensor shards.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from models.common.feed_forward import FeedForward
from models.common.float8_grouped import float8_experts_forward
from models.deepseek_v3.args import DeepSeekV3Args
from parallel_dims.torch_compat import per_rank_autograd


def _local(w: torch.Tensor) -> torch.Tensor:
    return w.to_local() if isinstance(w, DTensor) else w


def _identity(counts: torch.Tensor) -> torch.Tensor:
    return counts


# Routing counts and recomputation. ``MoE.forward`` adds each call's routing counts to its
# ``tokens_per_expert`` buffer, and activation checkpointing (which wraps the whole block) re-runs
# that forward during backward:
# * eager ``torch.utils.checkpoint`` (full or selective): the Python forward runs again inside
#   the backward pass, and the counts used to be added a second time;
# * under ``torch.compile`` dynamo traces the checkpointed block into one subgraph
#   (``tag_activation_checkpoint``) whose inputs include every buffer it reads, the accumulator
#   among them. The ``eager`` backend runs that subgraph through ``torch.utils.checkpoint``,
#   which (torch 2.13) saves the inputs as version-checked saved tensors and replays the whole
#   subgraph in backward: the in-place add had bumped the saved buffer's version, so backward
#   failed with "one of the variables needed for gradient computation has been modified by an
#   inplace operation" (and the replay would have counted again). The default backend passed:
#   AOTAutograd moves the buffer mutation to the end of the forward graph. In float32 the
#   experts' loop breaks the graph at its ``.tolist()``, so the block ran under eager
#   checkpointing and double counted without an error.
# The fix has two parts. The counts pass through :func:`_counts_outside_backward`, a custom op,
# opaque to tracing, so it decides at run time under every mode and backend: it returns zeros
# when it runs inside a backward pass, which is where every recomputation runs (eager
# checkpointing's unpack hook, the eager backend's replay, a reentrant checkpoint's backward).
# And the add keeps the buffer's version counter: the buffer feeds no computation autograd
# records (only the trainer reads it, between steps), so no saved value goes stale through it.
@torch.library.custom_op("meshtrain::moe_counts_outside_backward", mutates_args=(), schema="(Tensor counts) -> Tensor")
def _counts_outside_backward(counts: torch.Tensor) -> torch.Tensor:
    """A copy of ``counts``; zeros when called inside a backward pass (a recomputation)."""
    if torch._C._current_graph_task_id() != -1:
        return torch.zeros_like(counts)
    return counts.clone()


@_counts_outside_backward.register_fake
def _(counts: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(counts)


# What ``torch._grouped_mm`` accepts (ATen ``_grouped_mm_validate_inputs``: float32, bfloat16,
# float16; float64 is rejected). Inputs and output share one dtype.
_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def grouped_mm_by_default(device: torch.device, dtype: torch.dtype, dim: int, hidden_dim: int) -> bool:
    """The automatic (``use_grouped_mm=None``) choice of :class:`GroupedExperts`: True where
    ``torch._grouped_mm`` is a real grouped kernel with no host sync for expert GEMMs of this
    compute ``dtype`` and local shape (``hidden_dim`` is the local, possibly ETP-sliced, one).

    * ``torch._grouped_mm`` exists and accepts ``dtype`` (float32, bfloat16, float16);
    * every row stride is 16-byte aligned: ``dim`` and ``hidden_dim`` times the element size
      are multiples of 16 (the op rejects other strides);
    * CPU: any of those dtypes. ATen runs its per-group ``mm`` fallback there, which reads the
      offsets in C++ (no device to sync with). Equal to the loop up to rounding (the per-group
      GEMMs may sum in another order than the loop's ``mm``, depending on the CPU); fwd+bwd
      about as fast as the O(E) loop up to 64 experts (loop/grouped time 0.86-1.14) and
      faster at 128 (1.22-1.26), 6-23x faster than the old O(E^2) loop at 64-128 experts
      (``benchmarks/moe.py``: 4096 rows, dim 256, hidden 128, float32, one thread);
    * CUDA: bfloat16 on compute capability 9.x/10.x only, the CUTLASS kernel ("fast path, no
      d2h sync needed" in ``_grouped_mm_cuda``; it also needs 16-byte-aligned base pointers,
      which freshly allocated tensors have). Everything else on CUDA (float32, float16, other
      GPUs, ROCm) goes to the same ATen fallback, which copies the offsets to the host in
      every call (``offs.cpu()``): 3 syncs per layer forward and 6 backward, against the
      loop's one per layer, for the same per-expert ``mm`` kernels. There the loop is the
      default; ``use_grouped_mm=True`` still forces the fallback;
    * under ``torch.compile`` only bfloat16: the op's meta kernel, which tracing runs,
      rejects other dtypes (torch 2.13), so float32 compiles the loop (a graph break at its
      ``.tolist()``) instead of failing;
    * any other device: the loop."""
    if not hasattr(torch, "_grouped_mm") or dtype not in _GROUPED_MM_DTYPES:
        return False
    row_bytes = dtype.itemsize
    if (dim * row_bytes) % 16 != 0 or (hidden_dim * row_bytes) % 16 != 0:
        return False
    if dtype != torch.bfloat16 and torch.compiler.is_compiling():
        return False  # the op's meta kernel (what compile traces with) accepts only bf16
    if device.type == "cpu":
        return True
    if device.type == "cuda" and torch.version.hip is None:
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device)[0] in (9, 10)
    return False


def expert_compute_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the expert GEMMs run in, and the dtype of the experts' output.

    ``torch._grouped_mm`` is not covered by autocast, so :class:`GroupedExperts` applies the
    autocast rule itself: when autocast is enabled for ``x``'s device type, the autocast dtype
    (weights in float64 are not autocast-eligible and keep theirs). Otherwise the weights'
    dtype: FSDP2 mixed precision hands the module bf16 weights while the routed tokens may be
    float32, and the module computes in its parameters' precision."""
    device_type = x.device.type
    # (a fixed list rather than torch.amp.is_autocast_available, which torch 2.11's compiler
    # cannot trace)
    if (
        device_type in _AUTOCAST_DEVICE_TYPES
        and torch.is_autocast_enabled(device_type)
        and weight.dtype != torch.float64
    ):
        return torch.get_autocast_dtype(device_type)
    return weight.dtype


_AUTOCAST_DEVICE_TYPES = ("cpu", "cuda")


class _ZeroGradPastTotal(torch.autograd.Function):
    """Identity whose backward zeroes the gradient rows of padding (rows past the counts'
    sum). ``torch._grouped_mm`` leaves output rows past the last offset uninitialised, in the
    forward and in its input-gradient GEMM, so those rows must be masked on both sides. Only
    applied where the caller may pass padding rows (``GroupedExperts.forward``'s
    ``has_padding``, True unless the caller states otherwise; MoE states otherwise, and the
    EP wrapper passes the caller's statement on: it rejects inputs with rows past the counts'
    sum, so it adds none)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(valid)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (valid,) = ctx.saved_tensors
        return torch.where(valid, grad, 0), None


class GroupedExperts(nn.Module):
    """``E`` SwiGLU experts stored as stacked weights ``w1``/``w3`` [E, hidden, dim] and ``w2``
    [E, dim, hidden], so EP and FSDP can shard them along the expert dimension as one tensor.

    Two implementations, with the same results up to rounding: their GEMM calls differ, so the
    order of a dot product's additions may too (float32, bfloat16 and float16 agree within a
    per-element rounding-error bound, zeros of padding and empty experts exactly;
    ``tests/unit/test_moe_kernels.py``):

    * grouped GEMM: three ``torch._grouped_mm`` calls over all local experts. Group offsets
      are a device-side cumsum of the counts, the count check is a device-side
      ``torch._assert_async`` and padding rows (where the caller may have any) are masked on
      device, so this path never syncs with the host and, in bfloat16, compiles into one
      graph. What a failed check looks like on a GPU: nothing at this line. The kernel's
      assert fires on the device and CUDA's "device-side assert triggered" error reaches
      Python only at the next synchronizing call (often the step's loss ``.item()``), maybe
      without this message;
      the CUDA context is then unusable (every later CUDA call in the process fails, only a
      restart recovers), and the other ranks wait in their next collective until the NCCL
      watchdog's timeout ends them. (On CPU it raises RuntimeError here, with the message.)
      Only a caller passing inconsistent counts can trigger it: the MoE's own counts always
      satisfy it.
    * loop: one ``mm`` chain per expert over ``torch.split`` of the tokens. It needs the group
      sizes on the host: exactly one ``.tolist()`` per call, which also validates the counts
      (ValueError). The stacked weights are ``unbind``-ed once, so the backward stacks the E
      per-expert gradients once: O(E) work. (Indexing ``w1[e]`` per expert made autograd
      build a full [E, hidden, dim] zero gradient per expert: O(E^2).)

    ``use_grouped_mm``: None picks the grouped GEMM where :func:`grouped_mm_by_default` says
    it is a sync-free kernel for the compute dtype and shapes (CPU float32/bfloat16/float16
    with 16-byte-aligned rows; CUDA bfloat16 on sm90/sm100) and the loop elsewhere; True
    forces the grouped GEMM, False the loop.

    Compute dtype (:func:`expert_compute_dtype`): the autocast dtype when autocast is on,
    else the weights' dtype; tokens and weights are cast to it before the GEMMs, and the
    output has it.

    In both paths experts that receive no token still produce a (zero) gradient for their
    weights, so data-parallel gradient reductions see the same parameter set on every rank."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, use_grouped_mm: bool | None = None) -> None:
        super().__init__()
        if dim <= 0 or hidden_dim <= 0 or num_experts <= 0:
            raise ValueError(
                "GroupedExperts needs positive dim, hidden_dim and num_experts, got "
                f"{dim}, {hidden_dim}, {num_experts}."
            )
        self.num_experts = num_experts
        self.use_grouped_mm = use_grouped_mm
        # float8 GEMMs (model.converters = ["float8_experts"], set by the converter before any
        # parallelism): None (off), or whether they are emulated (float8.emulate)
        self.float8_emulate: bool | None = None
        # Provisional values so a model used without init_weights is still finite; the real
        # (layout-independent) init comes from the model's init_weights.
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim).normal_(0.0, 0.02))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim).normal_(0.0, 0.02))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim).normal_(0.0, 0.02))

    def forward(
        self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor, *, has_padding: bool = True
    ) -> torch.Tensor:
        """``x`` [T, dim] sorted by expert; ``num_tokens_per_expert`` [E_local] (integer, on
        any device). Rows past the sum of the counts (padding) produce zero rows and get zero
        gradients. ``has_padding=False`` states that the counts sum to exactly T: the grouped
        path then skips the padding mask (two elementwise passes over [T, dim] in forward and
        one in backward) and checks the statement on device instead. Returns [T, dim] in the
        compute dtype."""
        w1, w2, w3 = _local(self.w1), _local(self.w2), _local(self.w3)
        e_local = w1.shape[0]
        if num_tokens_per_expert.dim() != 1 or num_tokens_per_expert.shape[0] != e_local:
            raise ValueError(
                f"num_tokens_per_expert has shape {tuple(num_tokens_per_expert.shape)} but this "
                f"rank holds {e_local} experts; pass one count per local expert."
            )
        if num_tokens_per_expert.is_floating_point() or num_tokens_per_expert.is_complex():
            raise ValueError(f"num_tokens_per_expert must be integer, got {num_tokens_per_expert.dtype}.")
        if x.dim() != 2:
            raise ValueError(f"GroupedExperts expects x of shape [T, dim], got {tuple(x.shape)}.")
        dtype = expert_compute_dtype(x, w1)
        x, w1, w2, w3 = (t.to(dtype) for t in (x, w1, w2, w3))
        if self.float8_emulate is not None:  # per simulated rank under local_tensor: it reads the sizes
            return per_rank_autograd(
                float8_experts_forward, (x, w1, w2, w3), num_tokens_per_expert, self.float8_emulate
            )
        if self.use_grouped_mm is None:
            grouped = grouped_mm_by_default(x.device, dtype, w1.shape[2], w1.shape[1])
        else:
            grouped = self.use_grouped_mm
        if grouped:
            return self._grouped_mm_forward(x, w1, w2, w3, num_tokens_per_expert, has_padding)
        # The loop path's one host sync; the sizes also let us validate the counts.
        sizes = num_tokens_per_expert.tolist()
        total = sum(sizes)
        if total > x.shape[0] or min(sizes) < 0:
            raise ValueError(
                f"num_tokens_per_expert sums to {total} (min {min(sizes)}) but x has "
                f"{x.shape[0]} rows; counts must be non-negative and cover at most the rows given."
            )
        if not has_padding and total != x.shape[0]:
            raise ValueError(
                f"has_padding=False but num_tokens_per_expert sums to {total} while x has {x.shape[0]} "
                "rows; pass has_padding=True for inputs with padding rows."
            )
        return self._loop_forward(x, w1, w2, w3, sizes)

    @classmethod
    def _grouped_mm_forward(
        cls,
        x: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        w3: torch.Tensor,
        counts: torch.Tensor,
        has_padding: bool = True,
    ) -> torch.Tensor:
        rows = x.shape[0]
        counts = counts.to(device=x.device)
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        total = offsets[-1]
        # Checked on device, no host sync: on CPU a violation raises RuntimeError here, on
        # CUDA it is a device-side assert that stops the stream before a GEMM reads past x.
        if has_padding:
            torch._assert_async(
                (counts.min() >= 0) & (total <= rows),
                "GroupedExperts: num_tokens_per_expert must be non-negative and sum to at most the number of rows of x",
            )
        else:
            torch._assert_async(
                (counts.min() >= 0) & (total == rows),
                "GroupedExperts: has_padding=False but num_tokens_per_expert is negative or does not sum to the "
                "number of rows of x; pass has_padding=True for inputs with padding rows",
            )
        if rows == 0:
            # No tokens at all (e.g. an EP rank that received none); the counts are zero by
            # the check above, so the loop over E empty groups needs no host read and gives
            # every weight its zero gradient (torch._grouped_mm rejects empty inputs).
            return cls._loop_forward(x, w1, w2, w3, [0] * w1.shape[0])
        if not has_padding:
            h = F.silu(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offsets))
            h = h * torch._grouped_mm(x, w3.transpose(-2, -1), offs=offsets)
            return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offsets)
        valid = (torch.arange(rows, device=x.device) < total).unsqueeze(-1)
        x = _ZeroGradPastTotal.apply(x, valid)
        h = F.silu(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offsets))
        h = h * torch._grouped_mm(x, w3.transpose(-2, -1), offs=offsets)
        out = torch._grouped_mm(h, w2.transpose(-2, -1), offs=offsets)
        # Zero the uninitialised padding rows. The backward of where() is a fresh dense
        # gradient, which _grouped_mm's CPU backward needs (it rejects the stride-0 gradient
        # of out.sum()).
        return torch.where(valid, out, 0)

    @staticmethod
    def _loop_forward(
        x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, sizes: list[int]
    ) -> torch.Tensor:
        rows, total = x.shape[0], sum(sizes)
        pieces = torch.split(x, sizes + [rows - total] if total < rows else sizes)
        # unbind once: its backward stacks the E per-expert gradients into one [E, ...]
        # tensor. Experts with zero tokens still run (on empty inputs), so every weight gets
        # a (zero) gradient.
        outs = [
            (F.silu(x_e @ a.transpose(0, 1)) * (x_e @ c.transpose(0, 1))) @ b.transpose(0, 1)
            for x_e, a, b, c in zip(pieces, w1.unbind(0), w2.unbind(0), w3.unbind(0))
        ]
        if total < rows:
            outs.append(x.new_zeros(rows - total, w2.shape[1]))
        return torch.cat(outs)

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden={self.w1.shape[1]}, dim={self.w1.shape[2]}, "
            f"use_grouped_mm={self.use_grouped_mm}"
            + ("" if self.float8_emulate is None else f", float8={'emulated' if self.float8_emulate else 'rowwise'}")
        )


def combine_routed(routed_out: torch.Tensor, weights: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """The MoE combine: token ``t``'s output is ``sum_j weights[t, j] * y(t, j)``, where
    ``y(t, j)`` is the experts' output for the pair (token ``t``, its ``j``-th pick).

    ``routed_out`` [T*k, dim]: the experts' output in expert-sorted order, row ``i`` belonging
    to flat pair ``order[i]`` (= ``t*k + j``); ``weights`` [T, k] (float32). Returns [T, dim] in
    ``routed_out``'s dtype.

    * Un-permute by writing row ``i`` to row ``order[i]`` (an ``index_put_`` without
      accumulation: ``order`` is a permutation, so every destination is written once, no
      atomics; its backward is a gather, also without atomics, and it saves only ``order``,
      where ``index_copy`` would also keep the routed output alive for its backward). The
      [T, k, dim] result is in the experts' dtype: no float32 copy of the [T*k, dim] routed
      output is made.
    * Reduce the k contributions of each token with one batched matmul, [T, 1, k] @
      [T, k, dim]. Its kernels accumulate in float32 for bfloat16/float16 inputs (CPU and
      cuBLAS) and round once at the end; the weights are cast to the experts' dtype for it
      (in bfloat16 that rounds each weight to 8 significant bits, as an autocast matmul
      would). The weights' gradient is the matching bmm in backward.

    Deterministic on every device (same inputs, same bits), unlike the ``index_add`` it
    replaces, whose CUDA kernel adds a token's k rows with atomics in no fixed order."""
    t, k = weights.shape
    unsorted = routed_out.new_empty(routed_out.shape)
    unsorted[order] = routed_out
    combined = torch.bmm(weights.to(routed_out.dtype).unsqueeze(1), unsorted.view(t, k, routed_out.shape[-1]))
    return combined.squeeze(1)


class _AuxLossGrad(torch.autograd.Function):
    """Identity on the MoE output whose backward also gives the sequence-wise aux loss its
    gradient: ``1 / sequences`` (what ``loss + aux_sum / sequences`` gave it). So the aux loss
    trains the router without being added to the loss and without the forward storing it on
    the module (a side effect that torch.compile refuses inside a checkpointed block)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux_sum: torch.Tensor, sequences: int) -> torch.Tensor:
        ctx.sequences = sequences
        ctx.aux_dtype = aux_sum.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad_aux = None
        if ctx.needs_input_grad[1]:
            grad_aux = torch.ones((), dtype=ctx.aux_dtype, device=grad.device) / ctx.sequences
        return grad, grad_aux, None


class TokenChoiceRouter(nn.Module):
    """Scores experts per token and picks top-k, optionally restricted to the best groups.

    The load-balancing bias only steers *which* experts are picked; the combine weights are the
    unbiased scores of the picked experts, so balancing never rescales expert outputs (the
    DeepSeek-V3 auxiliary-loss-free scheme)."""

    def __init__(
        self,
        dim: int,
        num_experts: int,
        top_k: int,
        num_groups: int = 1,
        num_limited_groups: int = 1,
        score_func: str = "sigmoid",
        route_norm: bool = True,
        route_scale: float = 1.0,
    ) -> None:
        super().__init__()
        if score_func not in ("sigmoid", "softmax"):
            raise ValueError(f"score_func must be 'sigmoid' or 'softmax', got {score_func!r}.")
        if num_experts % num_groups != 0 or not 1 <= num_limited_groups <= num_groups:
            raise ValueError(
                f"Router needs num_experts ({num_experts}) divisible by num_groups ({num_groups}) "
                f"and 1 <= num_limited_groups ({num_limited_groups}) <= num_groups."
            )
        if not 1 <= top_k <= num_limited_groups * (num_experts // num_groups):
            raise ValueError(
                f"top_k={top_k} must be between 1 and the number of experts in the kept groups "
                f"({num_limited_groups * (num_experts // num_groups)})."
            )
        self.num_experts = num_experts
        self.top_k = top_k
        self.num_groups = num_groups
        self.num_limited_groups = num_limited_groups
        self.score_func = score_func
        self.route_norm = route_norm
        self.route_scale = route_scale
        self.gate = nn.Linear(dim, num_experts, bias=False)

    def forward(
        self, x: torch.Tensor, expert_bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x`` [T, dim] -> (weights [T, k] float32, experts [T, k] int64, scores [T, E]
        float32). Scores are in float32: top-k over bf16 scores ties far too often."""
        scores = self.gate(x).float()
        scores = torch.sigmoid(scores) if self.score_func == "sigmoid" else scores.softmax(dim=-1)
        with torch.no_grad():
            choice = scores if expert_bias is None else scores + expert_bias.float()
            if self.num_limited_groups < self.num_groups:
                choice = self._mask_groups(choice)
            selected = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, selected)
        if self.route_norm:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.route_scale, selected, scores

    def _mask_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """Keep only the ``num_limited_groups`` best groups per token (limits how many EP ranks
        / nodes one token is sent to). A group's score is the sum of its two best experts for
        sigmoid scores (robust to one outlier) and its best expert for softmax."""
        t = choice.shape[0]
        grouped = choice.view(t, self.num_groups, -1)
        if self.score_func == "sigmoid":
            group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
        else:
            group_scores = grouped.amax(dim=-1)
        keep = group_scores.topk(self.num_limited_groups, dim=-1).indices
        dropped = torch.ones_like(group_scores, dtype=torch.bool).scatter_(1, keep, False)
        return grouped.masked_fill(dropped.unsqueeze(-1), float("-inf")).view(t, -1)


class MoE(nn.Module):
    """Routed experts plus optional always-on shared experts.

    Buffers: ``expert_bias`` (persistent; the balancing state, part of the checkpoint) and
    ``tokens_per_expert`` (non-persistent accumulator of this rank's routing counts since the
    last :meth:`update_expert_bias`; zero at every optimizer-step boundary, which is where
    checkpoints are taken). Each forward counts its tokens once: a forward that activation
    checkpointing recomputes in backward (eager, or under ``torch.compile`` with any backend)
    adds nothing, so the counts equal those of the same steps without checkpointing.

    Sequence-wise aux loss (``aux_loss_coeff > 0``): each forward computes ``aux_sum``, the
    coefficient-weighted loss summed over this rank's sequences, and attaches it to the output
    (:class:`_AuxLossGrad`): the backward through the output gives ``aux_sum`` the gradient
    ``1 / aux_loss_sequences``, exactly as adding ``aux_sum / aux_loss_sequences`` to the loss
    did. ``aux_loss_sequences`` (default 1) is the step's global sequence count; the trainer
    sets it before each forward (``trainer/forward.py``). A loss scale applied after the
    forward does not scale the aux gradient. For reporting, ``aux_loss_total`` (float32
    buffer, not persistent) accumulates the detached ``aux_sum`` of every forward (not of
    recomputations); the trainer zeroes it before a forward and adds ``aux_loss_total /
    aux_loss_sequences`` to the loss it reports."""

    def __init__(self, args: DeepSeekV3Args, use_grouped_mm: bool | None = None) -> None:
        super().__init__()
        self.num_experts = args.n_routed_experts
        self.top_k = args.n_activated_experts
        self.load_balance_coeff = args.load_balance_coeff
        self.aux_loss_coeff = float(args.aux_loss_coeff)
        self.router = TokenChoiceRouter(
            args.dim,
            args.n_routed_experts,
            args.n_activated_experts,
            args.n_expert_groups,
            args.n_limited_groups,
            args.score_func,
            args.route_norm,
            args.route_scale,
        )
        self.experts = GroupedExperts(args.dim, args.moe_inter_dim, args.n_routed_experts, use_grouped_mm)
        self.shared_experts: FeedForward | None = (
            FeedForward(args.dim, args.moe_inter_dim * args.n_shared_experts) if args.n_shared_experts > 0 else None
        )
        self.register_buffer("expert_bias", torch.zeros(args.n_routed_experts, dtype=torch.float32), persistent=True)
        self.register_buffer(
            "tokens_per_expert",
            torch.zeros(args.n_routed_experts, dtype=torch.float32),
            persistent=False,
        )
        # Applied to the per-sequence selection counts [bs, E] before the aux loss uses them;
        # context parallelism replaces it with an all-reduce over the CP group so f_i is
        # computed over whole sequences.
        self.reduce_aux_counts: Callable[[torch.Tensor], torch.Tensor] = _identity
        # The divisor of the aux loss (the step's global sequence count), set by the trainer
        # before a forward; read as a constant (torch.compile guards on it).
        self.aux_loss_sequences: int = 1
        self.register_buffer("aux_loss_total", torch.zeros((), dtype=torch.float32), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, s, dim = x.shape
        x_flat = x.reshape(bs * s, dim)
        weights, selected, scores = self.router(x_flat, self.expert_bias)

        flat_experts = selected.reshape(-1)
        # Counted with scatter_add_ rather than torch.bincount, whose CUDA kernel reads the
        # input's min and max on the host (two syncs per layer).
        num_tokens_per_expert = torch.zeros(
            self.num_experts, dtype=torch.int64, device=flat_experts.device
        ).scatter_add_(0, flat_experts, torch.ones_like(flat_experts))
        # Counted once per forward: not again when activation checkpointing recomputes this
        # forward in backward, and without bumping the buffer's version (see
        # _counts_outside_backward for why both matter under torch.compile).
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(self.tokens_per_expert):
            counts = _counts_outside_backward(num_tokens_per_expert)
            self.tokens_per_expert.add_(counts.to(self.tokens_per_expert.dtype))

        # Dropless dispatch: sort the (token, expert) pairs by expert; stable so tokens keep
        # their order inside an expert. The combine is deterministic on every device; the
        # dispatch's index_select has an atomic backward on CUDA (a token's k gradient rows
        # add up in no fixed order), reproducible there with ``training.deterministic``.
        order = torch.argsort(flat_experts, stable=True)
        token_index = order // self.top_k
        routed_out = self.experts(x_flat.index_select(0, token_index), num_tokens_per_expert, has_padding=False)
        out = combine_routed(routed_out, weights, order).to(x.dtype)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x_flat)

        if self.aux_loss_coeff > 0:
            aux_sum = self._sequence_aux_loss(scores, selected, bs, s)
            # reported value: once per forward, not again in a recomputation (the same
            # custom op as the routing counts above, for the same reasons)
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(self.aux_loss_total):
                self.aux_loss_total.add_(_counts_outside_backward(aux_sum.detach()).to(self.aux_loss_total.dtype))
            out = _AuxLossGrad.apply(out, aux_sum, self.aux_loss_sequences)
        return out.view(bs, s, dim)

    def _sequence_aux_loss(self, scores: torch.Tensor, selected: torch.Tensor, bs: int, s: int) -> torch.Tensor:
        """DeepSeek-V3 sequence-wise balance loss, summed over local sequences:
        ``coeff * sum_i f_i * P_i`` with ``f_i = E / (k T) * #tokens picking i`` and
        ``P_i = mean_t normalized score_{t,i}``.

        ``T`` is taken from the (possibly CP-reduced) counts, ``sum_i count_i = k T``, and
        ``P_i`` is this rank's share ``sum_{local t} / T``. So with ``reduce_aux_counts``
        all-reducing over the CP group, summing the per-rank losses over that group gives
        exactly the whole-sequence loss."""
        e, k = self.num_experts, self.top_k
        picks = selected.reshape(bs, s * k)
        counts = torch.zeros(bs, e, dtype=torch.float32, device=scores.device)
        counts.scatter_add_(1, picks, torch.ones_like(picks, dtype=torch.float32))
        counts = self.reduce_aux_counts(counts)
        tokens = counts.sum(dim=-1, keepdim=True) / k
        f = counts * (e / k) / tokens
        probs = scores / scores.sum(dim=-1, keepdim=True)
        p = probs.view(bs, s, e).sum(dim=1) / tokens
        return self.aux_loss_coeff * (f * p).sum()

    @torch.no_grad()
    def update_expert_bias(self, global_tokens_per_expert: torch.Tensor) -> None:
        """Auxiliary-loss-free balancing step (once per optimizer step, after the trainer has
        all-reduced ``tokens_per_expert`` across ranks): underloaded experts' bias goes up by
        ``load_balance_coeff``, overloaded ones' down. The update is re-centred to zero mean
        so the bias does not drift (selection only depends on bias differences). The local
        accumulator is then cleared. A no-op except for the clearing when balancing is off."""
        if tuple(global_tokens_per_expert.shape) != (self.num_experts,):
            raise ValueError(
                f"global_tokens_per_expert has shape {tuple(global_tokens_per_expert.shape)}, "
                f"expected ({self.num_experts},): one count per routed expert."
            )
        if self.load_balance_coeff is not None:
            load = global_tokens_per_expert.to(device=self.expert_bias.device, dtype=torch.float32)
            delta = self.load_balance_coeff * torch.sign(load.mean() - load)
            self.expert_bias.add_(delta - delta.mean())
        self.tokens_per_expert.zero_()

    @torch.no_grad()
    def reset_buffers(self) -> None:
        self.expert_bias.zero_()
        self.tokens_per_expert.zero_()
        self.aux_loss_total.zero_()
