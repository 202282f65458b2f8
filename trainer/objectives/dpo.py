"""The preference losses on (chosen, rejected) pairs, as TRL 1.16's ``DPOTrainer`` defines them.

The batch contract (``training.dataset = "preference"``): rows ``2k`` and ``2k + 1`` of every
micro-batch are the CHOSEN and REJECTED completion of one pair, with labels (targets) on the
completion tokens only (-100 elsewhere). A row's sequence log-probability is

    logp(y | x) = sum over completion tokens t of log_softmax(logits_t)[label_t]

(``trl/trainer/dpo_trainer.py`` ``_compute_loss``: ``per_token_logps.sum(dim=1)``), computed here
as minus the per-token cross-entropy: under tensor parallelism with loss parallelism torch's
loss-parallel cross-entropy on the vocabulary-sharded logits (no gather of the logits); with
the chunked loss (``training.loss_chunk_tokens``) the head's own per-token cross-entropy; under
context parallelism each cp rank holds part of every row, so the per-row partial sums (and
completion-token counts) are all-reduced over the cp mesh before the pair loss; under pipeline
parallelism this runs on the last stage as the schedule's loss.

With ``d_c = logp_policy(chosen) - logp_ref(chosen)`` and ``d_r`` the same for the rejected
completion, the per-pair losses (TRL 1.16, ``f_divergence_type = "reverse_kl"``):

* ``sigmoid`` (DPO): ``-logsigmoid(beta * (d_c - d_r))``; with ``label_smoothing = e`` the
  conservative DPO of TRL before 1.0: ``-(1 - e) logsigmoid(beta d) - e logsigmoid(-beta d)``.
* ``ipo``: ``(d_c / n_c - d_r / n_r - 1 / (2 beta)) ** 2`` with ``n`` the completion-token count
  (clamped at 1): TRL 1.16 normalizes the log-ratios by the completion length.
* ``simpo`` (reference-free, Meng et al. 2024): ``-logsigmoid(beta * (logp_c / n_c - logp_r / n_r)
  - gamma)``.

The loss follows the trainer's convention (docs/design.md section 5): :class:`PreferenceLoss`
returns the SUM of the micro-batch's pair losses and the caller divides it by the number of
pairs in the GLOBAL batch (every batch rank and micro-batch), so the parts add up to TRL's
``per_sequence_loss.mean()`` over the whole batch. The metrics carry TRL's names and meanings:
``rewards/chosen = beta * d_c`` (SimPO: ``beta * logp_c / n_c``), ``rewards/rejected``,
``rewards/accuracies`` (chosen reward > rejected), ``rewards/margins``, ``logps/chosen``,
``logps/rejected`` (the policy's summed log-probs), each the mean over the global batch's pairs.
"""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

__all__ = ["METRIC_NAMES", "PreferenceLoss", "pair_losses", "row_logps"]

IGNORE_INDEX = -100
METRIC_NAMES = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A loss-parallel result (a DTensor replicated over tp) as this rank's plain tensor; the
    gradient flows back to it as the replicated gradient."""
    return t.to_local() if isinstance(t, DTensor) else t


def row_logps(
    logits: torch.Tensor, labels: torch.Tensor, cp_group: dist.ProcessGroup | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logp [rows], n [rows])``: each row's summed log-probability of its targets and its
    target count, float32. ``logits``: ``[rows, s, vocab]`` (a vocabulary-sharded DTensor under
    loss parallelism: call inside ``loss_parallel()``), or the chunked loss's ``[rows, s]``
    per-token cross-entropy. ``cp_group``: the rows are sequence-sharded over it; the partial
    sums are all-reduced (the backward sums the gradient over it too, so each cp rank's share
    of the loss is ``1 / cp`` of the pair loss: see :class:`PreferenceLoss`)."""
    rows, s = labels.shape[:2]
    if logits.dim() == 2:
        token_ce = logits
    else:
        token_ce = F.cross_entropy(
            logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="none", ignore_index=IGNORE_INDEX
        )
        token_ce = _local(token_ce).view(rows, s)
    logp = -token_ce.float().sum(dim=1)
    n = (labels != IGNORE_INDEX).sum(dim=1).to(logp.dtype)
    if cp_group is not None:
        both = dist_fn.all_reduce(torch.stack([logp, n]), group=cp_group)
        logp, n = both[0], both[1].detach()
    return logp, n


def pair_losses(
    logp: torch.Tensor,
    n: torch.Tensor,
    ref_logp: torch.Tensor | None,
    *,
    loss_type: str,
    beta: float,
    label_smoothing: float = 0.0,
    gamma: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(losses [pairs], metrics [pairs, 6])`` of interleaved rows (chosen ``2k``, rejected
    ``2k + 1``) with the policy's ``logp``, target counts ``n`` and the reference's ``ref_logp``
    (None for SimPO); the metrics in :data:`METRIC_NAMES` order, detached."""
    if logp.numel() % 2:
        raise ValueError(f"a preference micro-batch holds (chosen, rejected) pairs: got {logp.numel()} rows")
    pc, pr = logp[0::2], logp[1::2]
    nc, nr = n[0::2].clamp(min=1.0), n[1::2].clamp(min=1.0)
    if loss_type == "simpo":
        delta = pc / nc - pr / nr
        losses = -F.logsigmoid(beta * delta - gamma)
        rc, rr = beta * (pc / nc).detach(), beta * (pr / nr).detach()
    else:
        dc, dr = pc - ref_logp[0::2], pr - ref_logp[1::2]
        if loss_type == "sigmoid":
            z = beta * (dc - dr)
            losses = -F.logsigmoid(z)
            if label_smoothing:
                losses = (1 - label_smoothing) * losses - label_smoothing * F.logsigmoid(-z)
        elif loss_type == "ipo":
            losses = (dc / nc - dr / nr - 1 / (2 * beta)) ** 2
        else:
            raise ValueError(f"unknown preference loss_type {loss_type!r}")
        rc, rr = beta * dc.detach(), beta * dr.detach()
    metrics = torch.stack([rc, rr, (rc > rr).to(rc.dtype), rc - rr, pc.detach(), pr.detach()], dim=1)
    return losses, metrics


class PreferenceLoss:
    """The trainer's ``loss_fn(logits, labels)`` for ``training.objective = "dpo"``, on the plain
    model and as the pipeline's last-stage loss alike.

    Two modes. ``collecting`` (the reference pass, under ``no_grad``): each call appends the
    micro-batch's reference row log-probs to a queue and returns 0. Otherwise (the policy pass)
    each call takes the oldest queued reference (the same micro-batch: both passes run the same
    micro-batches in the same order) and returns the SUM of the pair losses divided by ``cp``:
    every cp rank computes the whole pair loss from the all-reduced sums, and the all-reduce's
    backward sums the ``cp`` ranks' gradients, so the ``1 / cp`` makes both the gradient and
    the loss summed over the loss mesh (which spans cp) count each pair once. The metric sums
    (also ``/ cp``) accumulate until :meth:`take_metrics`."""

    def __init__(self, dpo, cp_group: dist.ProcessGroup | None, cp: int, reference_free: bool) -> None:
        self.opts, self.cp_group, self.cp = dpo, cp_group, cp
        self.reference_free = reference_free
        self.collecting = False
        self.refs: deque[torch.Tensor] = deque()
        self.metric_sum: torch.Tensor | None = None

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logp, n = row_logps(logits, labels, self.cp_group)
        if self.collecting:
            self.refs.append(logp.detach())
            return logp.new_zeros(())
        ref = None
        if not self.reference_free:
            if not self.refs:
                raise RuntimeError("preference loss: no reference log-probs queued for this micro-batch")
            ref = self.refs.popleft()
        o = self.opts
        losses, metrics = pair_losses(
            logp, n, ref, loss_type=o.loss_type, beta=o.beta, label_smoothing=o.label_smoothing, gamma=o.gamma
        )
        part = metrics.sum(dim=0) / self.cp
        self.metric_sum = part if self.metric_sum is None else self.metric_sum + part
        return losses.sum() / self.cp

    def take_metrics(self, device: torch.device) -> torch.Tensor:
        """The metric sums since the last call (zeros on a pp rank without the last stage), a
        float32 vector on ``device``, and reset."""
        total, self.metric_sum = self.metric_sum, None
        self.refs.clear()
        if total is None:
            return torch.zeros(len(METRIC_NAMES), dtype=torch.float32, device=device)
        return total.to(device)
