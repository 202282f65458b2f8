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
from models.deepseek_v3.args import DeepSeekV3Args


def _local(w: torch.Tensor) -> torch.Tensor:
    return w.to_local() if isinstance(w, DTensor) else w


def _identity(counts: torch.Tensor) -> torch.Tensor:
    return counts


class _DenseGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous. ``torch._grouped_mm``'s
    CPU backward rejects stride-0 gradients such as the one ``out.sum().backward()`` produces."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: D401
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


class GroupedExperts(nn.Module):
    """``E`` SwiGLU experts stored as stacked weights ``w1``/``w3`` [E, hidden, dim] and ``w2``
    [E, dim, hidden], so EP and FSDP can shard them along the expert dimension as one tensor.

    ``use_grouped_mm``: None picks ``torch._grouped_mm`` where it was verified to work (CPU,
    float32/bfloat16, 16-byte-aligned rows; measured ~2x faster than the loop for the debug
    model's fwd+bwd) and the per-expert loop elsewhere. On CUDA it needs bf16, sm90 and token
    groups padded to a multiple of 8 rows, which this dispatch does not do, so there the loop is
    the default; True forces grouped_mm, False forces the loop."""

    def __init__(
        self, dim: int, hidden_dim: int, num_experts: int, use_grouped_mm: bool | None = None
    ) -> None:
        super().__init__()
        if dim <= 0 or hidden_dim <= 0 or num_experts <= 0:
            raise ValueError(
                "GroupedExperts needs positive dim, hidden_dim and num_experts, got "
                f"{dim}, {hidden_dim}, {num_experts}."
            )
        self.num_experts = num_experts
        self.use_grouped_mm = use_grouped_mm
        # Provisional values so a model used without init_weights is still finite; the real
        # (layout-independent) init comes from the model's init_weights.
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim).normal_(0.0, 0.02))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim).normal_(0.0, 0.02))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim).normal_(0.0, 0.02))

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """``x`` [T, dim] sorted by expert; ``num_tokens_per_expert`` [E_local]. Rows past the
        sum of the counts (padding an EP wrapper may add) produce zeros."""
        w1, w2, w3 = _local(self.w1), _local(self.w2), _local(self.w3)
        e_local = w1.shape[0]
        if num_tokens_per_expert.dim() != 1 or num_tokens_per_expert.shape[0] != e_local:
            raise ValueError(
                f"num_tokens_per_expert has shape {tuple(num_tokens_per_expert.shape)} but this "
                f"rank holds {e_local} experts; pass one count per local expert."
            )
        if x.dim() != 2:
            raise ValueError(f"GroupedExperts expects x of shape [T, dim], got {tuple(x.shape)}.")
        # One host sync for the whole layer; the loop needs the sizes and it lets us check them.
        sizes = [int(c) for c in num_tokens_per_expert.tolist()]
        total = sum(sizes)
        if total > x.shape[0] or min(sizes) < 0:
            raise ValueError(
                f"num_tokens_per_expert sums to {total} (min {min(sizes)}) but x has "
                f"{x.shape[0]} rows; counts must be non-negative and cover at most the rows given."
            )
        routed = x[:total] if total < x.shape[0] else x
        if self._grouped_mm_applies(routed, w1):
            offsets = torch.cumsum(
                num_tokens_per_expert.to(device=x.device), dim=0, dtype=torch.int32
            )
            out = _DenseGrad.apply(self._grouped_mm_forward(routed, w1, w2, w3, offsets))
        else:
            out = self._loop_forward(routed, w1, w2, w3, sizes)
        if total < x.shape[0]:
            out = torch.cat([out, out.new_zeros(x.shape[0] - total, out.shape[1])])
        return out

    def _grouped_mm_applies(self, x: torch.Tensor, w1: torch.Tensor) -> bool:
        if self.use_grouped_mm is False or not hasattr(torch, "_grouped_mm") or x.shape[0] == 0:
            return False
        if self.use_grouped_mm is True:
            return True
        if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
            return False
        if x.dtype != w1.dtype:
            return False
        row_bytes = x.element_size()
        return (w1.shape[1] * row_bytes) % 16 == 0 and (w1.shape[2] * row_bytes) % 16 == 0

    @staticmethod
    def _grouped_mm_forward(
        x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, offsets: torch.Tensor
    ) -> torch.Tensor:
        h = F.silu(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offsets))
        h = h * torch._grouped_mm(x, w3.transpose(-2, -1), offs=offsets)
        return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offsets)

    @staticmethod
    def _loop_forward(
        x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, sizes: list[int]
    ) -> torch.Tensor:
        # Experts with zero tokens still run (on empty inputs): every weight then gets a
        # (zero) gradient, so data-parallel gradient reductions see the same parameter set on
        # every rank even when a rank's experts received no tokens.
        outs = []
        for e, x_e in enumerate(torch.split(x, sizes)):
            h = F.silu(x_e @ w1[e].transpose(0, 1)) * (x_e @ w3[e].transpose(0, 1))
            outs.append(h @ w2[e].transpose(0, 1))
        return torch.cat(outs)

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden={self.w1.shape[1]}, dim={self.w1.shape[2]}, "
            f"use_grouped_mm={self.use_grouped_mm}"
        )


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
    checkpoints are taken). Under full activation checkpointing the forward is recomputed and
    counts are added twice, uniformly for all experts, which leaves the sign-based update
    unchanged."""

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
        self.experts = GroupedExperts(
            args.dim, args.moe_inter_dim, args.n_routed_experts, use_grouped_mm
        )
        self.shared_experts: FeedForward | None = (
            FeedForward(args.dim, args.moe_inter_dim * args.n_shared_experts)
            if args.n_shared_experts > 0
            else None
        )
        self.register_buffer(
            "expert_bias", torch.zeros(args.n_routed_experts, dtype=torch.float32), persistent=True
        )
        self.register_buffer(
            "tokens_per_expert",
            torch.zeros(args.n_routed_experts, dtype=torch.float32),
            persistent=False,
        )
        # Applied to the per-sequence selection counts [bs, E] before the aux loss uses them;
        # context parallelism replaces it with an all-reduce over the CP group so f_i is
        # computed over whole sequences.
        self.reduce_aux_counts: Callable[[torch.Tensor], torch.Tensor] = _identity
        # Coefficient-weighted aux loss summed over this rank's sequences, set by each forward
        # when aux_loss_coeff > 0 (None otherwise).
        self.aux_loss_sum: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, s, dim = x.shape
        x_flat = x.reshape(bs * s, dim)
        weights, selected, scores = self.router(x_flat, self.expert_bias)

        flat_experts = selected.reshape(-1)
        num_tokens_per_expert = torch.bincount(flat_experts, minlength=self.num_experts)
        with torch.no_grad():
            self.tokens_per_expert.add_(num_tokens_per_expert.to(self.tokens_per_expert.dtype))

        # Dropless dispatch: sort the (token, expert) pairs by expert; stable so tokens keep
        # their order inside an expert (deterministic results).
        order = torch.argsort(flat_experts, stable=True)
        token_index = order // self.top_k
        routed_out = self.experts(x_flat.index_select(0, token_index), num_tokens_per_expert)
        routed_weights = weights.reshape(-1).index_select(0, order).unsqueeze(-1)
        # Combine in float32: each token sums top_k contributions.
        combined = torch.zeros(bs * s, dim, dtype=torch.float32, device=x.device).index_add(
            0, token_index, routed_out.float() * routed_weights
        )
        out = combined.to(x.dtype)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x_flat)

        self.aux_loss_sum = (
            self._sequence_aux_loss(scores, selected, bs, s) if self.aux_loss_coeff > 0 else None
        )
        return out.view(bs, s, dim)

    def _sequence_aux_loss(
        self, scores: torch.Tensor, selected: torch.Tensor, bs: int, s: int
    ) -> torch.Tensor:
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
        self.aux_loss_sum = None


def moe_layers(model: nn.Module) -> list[MoE]:
    """All MoE modules of ``model`` in module order (only the layers a pipeline stage kept)."""
    return [m for m in model.modules() if isinstance(m, MoE)]
