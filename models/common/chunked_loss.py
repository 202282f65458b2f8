"""The output head and the cross-entropy a chunk of tokens at a time (``training.loss_chunk_tokens``).

Plain, the head turns the ``[tokens, dim]`` hidden states into ``[tokens, vocab]`` logits and
the loss casts them to float32: with a 151,936-token vocabulary that is 0.6 MB per token, and
autograd keeps the logits (or their softmax) until the backward, which makes a gradient of the
same size. The model's ``output`` head stays an ``nn.Linear`` (same class, parameter, name and
plain forward); :func:`enable_chunked_head` lets it take ``labels``, and then it returns each
token's cross-entropy
(``[bs, n]`` float32, 0 at ignored targets) computed ``chunk_tokens`` rows at a time by
:class:`_ChunkedHeadCE`, which keeps only the hidden states, the labels and one float32
log-sum-exp per token for the backward. The backward recomputes each chunk's logits (one more
head matmul per chunk: 4 instead of 3 for the head; the measured cost is in docs/memory.md) and
turns them into that chunk's gradient wrt the hidden states and the head weight, so at most one
chunk's ``[chunk, vocab]`` logits and gradient are alive at once, forward or backward. The
weight gradient accumulates over the chunks in float32.

The per-token losses go to the trainer's loss function, which sums them (and MTP splits them
into the main and the depths' parts, ``trainer/mtp.py``): ignored targets, assistant-only masks
and the global valid-token divisor are applied exactly where they are for the plain logits.

Under tensor parallelism the head weight is vocabulary-sharded (``Shard(0)`` on the tp mesh)
and its input replicated over tp: each rank computes the logits of its vocabulary slice, and
the log-sum-exp and the target's logit are all-reduced over tp (a max, then two sums, per
chunk), exactly the arithmetic of loss parallelism without a vocab-sized collective. The
gradient wrt the hidden states is then a partial sum over tp (``Partial`` placement): DTensor
reduces it (reduce-scatter onto the sequence shard under sequence parallelism).
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

__all__ = ["IGNORE_INDEX", "chunked_head_losses", "chunked_loss_saving_bytes", "enable_chunked_head"]

IGNORE_INDEX = -100  # F.cross_entropy's default and trainer/data/packing.py's


def _reduce(t: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(t, op=op, group=group)
    return t


def _chunk_stats(
    logits: torch.Tensor, labels: torch.Tensor, vocab_start: int, group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Of one chunk's float32 logits ``[c, v_local]`` (vocabulary rows ``vocab_start ..``;
    overwritten: the buffer is reused for the exponentials):
    ``(lse [c], loss [c], local_target [c], in_slice [c])``: the log-sum-exp over the whole
    vocabulary, each token's cross-entropy (0 where the target is ignored), the target's index
    in this slice and whether it lies there."""
    valid = labels != IGNORE_INDEX
    local_target = labels - vocab_start
    in_slice = valid & (local_target >= 0) & (local_target < logits.size(1))
    local_target = torch.where(in_slice, local_target, torch.zeros_like(local_target))
    m = _reduce(logits.max(dim=1).values, dist.ReduceOp.MAX, group)
    shifted = logits.sub_(m[:, None])  # in place: the chunk's logits are a temporary of the caller
    target = shifted.gather(1, local_target[:, None]).squeeze(1) * in_slice
    sumexp = _reduce(shifted.exp_().sum(dim=1), dist.ReduceOp.SUM, group)
    target = _reduce(target, dist.ReduceOp.SUM, group)
    log_sumexp = sumexp.log()
    loss = torch.where(valid, log_sumexp - target, torch.zeros_like(target))
    return m + log_sumexp, loss, local_target, in_slice


def _chunks(n: int, chunk: int):
    """``(start, end)`` of each chunk of ``n`` rows, the last one partial."""
    for s in range(0, n, chunk):
        yield s, min(s + chunk, n)


class _ChunkedHeadCE(torch.autograd.Function):
    """``(h [N, dim], weight [v_local, dim], labels [N])`` -> per-token cross-entropy ``[N]``
    float32; see the module docstring."""

    @staticmethod
    def forward(ctx, h, weight, labels, chunk, vocab_start, group):  # type: ignore[override]
        n = h.size(0)
        losses = torch.zeros(n, dtype=torch.float32, device=h.device)
        lse = torch.zeros(n, dtype=torch.float32, device=h.device)
        for s, e in _chunks(n, chunk):
            logits = F.linear(h[s:e], weight).float()
            lse[s:e], losses[s:e], _, _ = _chunk_stats(logits, labels[s:e], vocab_start, group)
            del logits
        ctx.save_for_backward(h, weight, labels, lse)
        ctx.chunk, ctx.vocab_start = chunk, vocab_start
        return losses

    @staticmethod
    def backward(ctx, grad_losses):  # type: ignore[override]
        h, weight, labels, lse = ctx.saved_tensors
        chunk, vocab_start = ctx.chunk, ctx.vocab_start
        n = h.size(0)
        grad_h = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        # float32 accumulation over the chunks (the plain head's one matmul accumulates in float32 too)
        grad_w = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if ctx.needs_input_grad[1] else None
        )
        g_all = grad_losses.float() * (labels != IGNORE_INDEX)
        for s, e in _chunks(n, chunk):
            logits = F.linear(h[s:e], weight).float()
            # d loss_i / d logit_ij = softmax_ij - [j == target_i], times the token's incoming gradient
            grad = logits.sub_(lse[s:e, None]).exp_()  # in place: one [chunk, vocab] float32 buffer
            del logits  # (the same buffer: the name alone would keep it past the loop's next matmul)
            target = labels[s:e] - vocab_start
            in_slice = (labels[s:e] != IGNORE_INDEX) & (target >= 0) & (target < weight.size(0))
            rows = in_slice.nonzero().squeeze(1)
            grad[rows, target[rows]] -= 1.0
            grad.mul_(g_all[s:e, None])
            grad = grad.to(weight.dtype)
            if grad_h is not None:
                grad_h[s:e] = grad @ weight
            if grad_w is not None:
                if weight.dtype == torch.float32:
                    grad_w.addmm_(grad.t(), h[s:e])
                else:
                    grad_w += (grad.t() @ h[s:e]).float()
            del grad
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None


def _vocab_start(weight: DTensor) -> int:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(weight.shape, weight.device_mesh, weight.placements)
    return int(offset[0])


def chunked_head_losses(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int) -> torch.Tensor:
    """Each token's cross-entropy ``[bs, n]`` (float32, 0 where ``labels`` is ignored) of the
    head ``weight`` ``[vocab, dim]`` on ``h`` ``[bs, n, dim]``, ``chunk`` tokens at a time.
    ``labels``: ``[bs, n]`` targets, or ``[bs, n / (1 + D), 1 + D]`` (DeepSeek-V3 MTP: ``h`` holds
    the main and each depth's states concatenated along the sequence, ``trainer/mtp.py``).
    Under tensor parallelism ``weight`` is a vocabulary-sharded DTensor (``Shard(0)``) and ``h``
    a DTensor replicated over the same mesh; the losses come back as a DTensor replicated over
    it, which the head's TP output hook hands on as the local tensor (models/parallel/tensor_parallel.py)."""
    if chunk < 1:
        raise ValueError(f"loss chunk must be a positive number of tokens, got {chunk}")
    bs, n = h.shape[0], h.shape[1]
    if labels.dim() == 3:
        labels = labels.transpose(1, 2).reshape(bs, -1)
    if tuple(labels.shape) != (bs, n):
        raise ValueError(f"chunked loss: labels {tuple(labels.shape)} do not match the hidden states {tuple(h.shape)}")
    group, vocab_start, mesh = None, 0, None
    if isinstance(weight, DTensor):
        mesh = weight.device_mesh
        if mesh.ndim != 1 or tuple(weight.placements) != (Shard(0),):
            raise ValueError(
                f"chunked loss: the head weight is sharded {weight.placements} over {mesh}; it supports the "
                "vocabulary-sharded head of tensor parallelism (Shard(0) on the tp mesh); set "
                "training.loss_chunk_tokens = 0"
            )
        if not isinstance(h, DTensor):
            h = DTensor.from_local(h, mesh, (Replicate(),), run_check=False)
        h = h.redistribute(mesh, (Replicate(),))
        # this rank's vocabulary slice contributes a partial sum of the gradient wrt h
        h = h.to_local(grad_placements=(Partial(),))
        group, vocab_start = mesh.get_group(), _vocab_start(weight)
        weight = weight.to_local()
    flat = _ChunkedHeadCE.apply(h.reshape(bs * n, h.shape[-1]), weight, labels.reshape(-1), chunk, vocab_start, group)
    if mesh is not None:  # every tp rank holds the whole losses: the head's output layout (Replicate)
        return DTensor.from_local(flat.view(bs, n), mesh, (Replicate(),), run_check=False)
    return flat.view(bs, n)


def _head_forward(
    self: nn.Linear, h: torch.Tensor, labels: torch.Tensor | None = None, chunk_tokens: int = 0
) -> torch.Tensor:
    if labels is None:
        return F.linear(h, self.weight, self.bias)
    return chunked_head_losses(h, self.weight, labels, chunk_tokens)


def enable_chunked_head(head: nn.Linear) -> nn.Linear:
    """Give the model's output head ``head`` (an ``nn.Linear(dim, vocab, bias=False)``, which stays
    exactly that class: the float8 and LoRA converters, checkpoints and the TP plan see the plain
    linear) a forward that also takes the chunked loss: ``head(h)`` is the plain linear (the
    logits), ``head(h, labels=..., chunk_tokens=c)`` the per-token cross-entropy of
    :func:`chunked_head_losses`. Called through the module, so that FSDP gathers (and TP shards)
    the weight exactly as for the logits."""
    head.forward = types.MethodType(_head_forward, head)
    return head


def chunked_loss_saving_bytes(
    tokens: int, vocab: int, dim: int, chunk_tokens: int, *, tp: int = 1, compute_bytes: int = 4
) -> int:
    """Peak bytes the chunked loss saves on one rank against the plain head + loss, for the
    planner. ``tokens``: the rows one forward/backward of the head sees on this rank (a
    micro-batch's local tokens, times ``1 + D`` with D MTP depths); ``vocab / tp`` the rank's
    vocabulary slice (rounded up); ``dim`` the model width; ``compute_bytes`` the head's compute
    dtype (4 float32, 2 bf16). 0 when ``chunk_tokens`` is 0 (off).

    What is alive at each path's peak, measured with ``tools/tensor_census.py`` (docs/memory.md):
    plain, four ``[tokens, vocab / tp]`` tensors (the logits in the compute dtype, which the
    trainer's forward holds until its backward returns; the float32 log-softmax autograd saved;
    the NLL's float32 gradient; the log-softmax's float32 gradient: ``12 + compute_bytes`` bytes
    per element) and the head weight's gradient; chunked, one chunk's float32 logits buffer
    (reused for the softmax gradient; below float32 also its cast), the float32 accumulator of
    the weight gradient and the weight gradient itself. Exact in float32 (to the census's byte
    on the bench's shapes), within 5% in bf16."""
    if chunk_tokens <= 0:
        return 0
    v = -(-vocab // tp)
    low = compute_bytes if compute_bytes != 4 else 0
    plain = tokens * v * (12 + compute_bytes) + v * dim * compute_bytes
    chunked = min(chunk_tokens, tokens) * v * (4 + low) + v * dim * (4 + compute_bytes)
    return max(plain - chunked, 0)
