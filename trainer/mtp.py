"""Multi-token prediction in the trainer: the shifted inputs and targets of every MTP depth, and
the loss that adds the depths' cross-entropies to the main one (the model side is
``models/deepseek_v3/mtp.py``).

Depth ``k`` at position ``i`` embeds token ``t_{i+k}`` and predicts ``t_{i+k+1}``. Both come
from the row itself, shifted by ``k``: the inputs ``inputs[:, i + k]`` (token id 0 past the row's
end), the targets ``labels[:, i + k]`` (IGNORE past the end). :func:`mtp_batch` builds them on the
whole row, BEFORE the context-parallel shard (``trainer/forward.py``), so a cp rank's chunks
carry the right future tokens and no shift crosses a chunk boundary. With block-causal
attention (``eos_id`` given) a depth-``k`` target is also IGNORE where it would leave the
position's document: where one of ``t_i .. t_{i+k}`` is an EOS (the EOS belongs to the document
it ends), so every kept target is predicted from tokens of its own document only. The positions
that lose their target form the tail of each document, which no kept position attends to, so
the filler inputs there change nothing else.

The loss (:class:`MTPLoss`) keeps the convention of docs/design.md section 5: it returns the SUM
``CE_main + (lambda / D) * sum_k CE_k`` of token cross-entropies, which the caller divides by
the step's global token count (the main loss's), as the DeepSeek-V3 report divides each depth's
loss by the same T. The depths' part is also accumulated (detached) so the step can report it
as ``mtp_loss`` = ``sum_k CE_k / (D * global tokens)``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from trainer.data.packing import IGNORE_INDEX

__all__ = ["MTPLoss", "mtp_batch"]


def mtp_batch(
    inputs: torch.Tensor, labels: torch.Tensor, depth: int, eos_id: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mtp_tokens [bs, s, D], targets [bs, s, 1 + D])`` of a ``[bs, s]`` row batch: column
    ``k - 1`` of ``mtp_tokens`` is what depth ``k`` embeds, column 0 of ``targets`` the main
    labels and column ``k`` depth ``k``'s targets (see the module docstring)."""
    if inputs.shape != labels.shape or inputs.dim() != 2:
        raise ValueError(
            f"mtp_batch expects [bs, s] inputs and labels, got {tuple(inputs.shape)}, {tuple(labels.shape)}"
        )
    bs, s = inputs.shape
    if not 1 <= depth < s:
        raise ValueError(f"mtp_layers={depth} must be at least 1 and below the sequence length {s}")
    tokens = torch.zeros(bs, s, depth, dtype=inputs.dtype, device=inputs.device)
    targets = torch.full((bs, s, 1 + depth), IGNORE_INDEX, dtype=labels.dtype, device=labels.device)
    targets[..., 0] = labels
    if eos_id is not None:
        # eos_before[j] = EOS tokens among t_0 .. t_{j-1}; t_i .. t_{i+k} hold none iff
        # eos_before[i + k + 1] == eos_before[i]
        is_eos = (inputs == eos_id).to(torch.int64)
        eos_before = torch.cat([torch.zeros_like(is_eos[:, :1]), is_eos.cumsum(1)], dim=1)
    for k in range(1, depth + 1):
        tokens[:, : s - k, k - 1] = inputs[:, k:]
        kept = labels[:, k:]
        if eos_id is not None:
            same_doc = eos_before[:, k + 1 : s + 1] == eos_before[:, : s - k]
            kept = torch.where(same_doc, kept, torch.full_like(kept, IGNORE_INDEX))
        targets[:, : s - k, k] = kept
    return tokens, targets


class MTPLoss:
    """``loss_fn(logits, targets)`` for a model with ``depth`` MTP depths: ``logits``
    ``[bs, (1 + D) * s, vocab]`` (the main and each depth's, concatenated along the sequence),
    ``targets`` ``[bs, s, 1 + D]`` (:func:`mtp_batch`). Returns the SUM ``CE_main + weight / D *
    sum_k CE_k`` (``loss_fn`` gives each CE as a token sum). Plain ``[bs, s]`` targets (and
    ``[bs, s, vocab]`` logits) are the main loss alone. ``weight = 0`` (validation) skips the
    depths' cross-entropies.

    ``mtp_sum``: the depths' cross-entropy sum ``sum_k CE_k`` since the last :meth:`take`
    (detached, float32), for the metrics."""

    def __init__(
        self, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], depth: int, weight: float
    ) -> None:
        if depth < 1:
            raise ValueError(f"MTPLoss needs at least one MTP depth, got {depth}")
        self.loss_fn, self.depth, self.weight = loss_fn, depth, float(weight)
        self.mtp_sum: torch.Tensor | None = None

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if targets.dim() == 2:
            return self.loss_fn(logits, targets)
        s = targets.size(1)
        if targets.size(2) != 1 + self.depth or logits.size(1) != (1 + self.depth) * s:
            raise ValueError(
                f"MTP loss: targets {tuple(targets.shape)} and logits {tuple(logits.shape[:2])} do not hold the "
                f"main prediction and {self.depth} MTP depth(s) of {s} positions"
            )
        main = self.loss_fn(logits[:, :s], targets[..., 0])
        if self.weight == 0:
            return main
        mtp = sum(self.loss_fn(logits[:, k * s : (k + 1) * s], targets[..., k]) for k in range(1, self.depth + 1))
        part = mtp.detach().float()
        self.mtp_sum = part if self.mtp_sum is None else self.mtp_sum + part
        return main + (self.weight / self.depth) * mtp

    def take(self, device: torch.device) -> torch.Tensor:
        """``mtp_sum`` (zero if nothing was accumulated: a pp rank without the last stage) as a
        plain float32 scalar on ``device``, and reset."""
        total = self.mtp_sum
        self.mtp_sum = None
        if total is None:
            return torch.zeros((), dtype=torch.float32, device=device)
        full = total.full_tensor() if hasattr(total, "full_tensor") else total
        return full.to(device)
