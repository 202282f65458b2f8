"""The shared mixture of experts (DeepSeek-V3's design): grouped token-choice routing, dropless
dispatch, the combine, auxiliary-loss-free balancing and the optional sequence-wise balance loss.

Every MoE model builds this one module as its blocks' ``moe`` (DeepSeek-V3 after its dense
layers, Qwen3-MoE in every layer) and configures it through the routing fields its args supply
by name (:class:`MoEArgs`; Qwen3's are properties). The experts themselves
(``GroupedExperts``, the contract expert parallelism wraps) are ``models/common/experts.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

from models.common.experts import GroupedExperts
from models.common.feed_forward import FeedForward

__all__ = ["MoE", "MoEArgs", "TokenChoiceRouter", "combine_routed"]


class MoEArgs(Protocol):
    """What :class:`MoE` reads from a model's args, by name (fields or properties)."""

    dim: int
    moe_inter_dim: int
    n_routed_experts: int
    n_activated_experts: int
    n_shared_experts: int
    n_expert_groups: int
    n_limited_groups: int
    score_func: str
    route_norm: bool
    route_scale: float
    load_balance_coeff: float | None
    aux_loss_coeff: float


def _identity(counts: torch.Tensor) -> torch.Tensor:
    return counts


class _Chained:
    """Two count reductions applied one after the other (sums over two groups of ranks)."""

    def __init__(self, first: Callable[[torch.Tensor], torch.Tensor], second: Callable[[torch.Tensor], torch.Tensor]):
        self.first, self.second = first, second

    def __call__(self, counts: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(counts))

    def __repr__(self) -> str:
        return f"{self.first!r} then {self.second!r}"


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

    def __init__(self, args: MoEArgs, use_grouped_mm: bool | None = None) -> None:
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
        # every applier that splits a sequence's tokens over ranks adds its all-reduce
        # (add_aux_count_reduction: context parallelism over cp, sequence-parallel TP over tp,
        # where each tp rank routes its own tokens), so f_i is computed over whole sequences.
        self.reduce_aux_counts: Callable[[torch.Tensor], torch.Tensor] = _identity
        # The divisor of the aux loss (the step's global sequence count), set by the trainer
        # before a forward; read as a constant (torch.compile guards on it).
        self.aux_loss_sequences: int = 1
        self.register_buffer("aux_loss_total", torch.zeros((), dtype=torch.float32), persistent=False)

    def add_aux_count_reduction(self, reduce: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Sum the aux loss's per-sequence counts over one more group of ranks that hold parts
        of the same sequences (after any reduction added before)."""
        prev = self.reduce_aux_counts
        self.reduce_aux_counts = reduce if prev is _identity else _Chained(prev, reduce)

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
        exactly the whole-sequence loss (the same over the tp group under sequence parallelism,
        where each tp rank routes a slice of every sequence)."""
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
