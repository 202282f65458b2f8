"""One rank's memory as the peak over the phases of a training step (issue 53).

The bytes that exist at once differ through a step, so the rank's peak is the largest of the
phases' totals, each counting only what is alive then (read off ``Trainer.train_step``,
``trainer/forward.py``, FSDP2's reshard and reduce-scatter, the memory options' own code):

* ``loss``, the end of a micro-batch's forward and the start of its loss backward: the
  parameter shards and the optimizer state, the parameters still gathered (the head group and
  the last block, which FSDP keeps after the forward, models/parallel/fsdp.py; every group
  under pp, ``reshard = never`` or without sharding), every micro-batch's activations in flight,
  the head's buffers (logits and log-softmax) and, transient, the loss backward's two float32
  ``[tokens, vocab / tp]`` gradients. No parameter gradient exists yet on the first
  micro-batch (``zero_grad(set_to_none=True)`` after every step); with gradient accumulation or
  pipeline micro-batches the earlier micro-batches' gradients do (FSDP2 accumulates them
  unsharded while the reduce-scatter waits: ``set_requires_gradient_sync`` / the schedule's
  last backward).
* ``backward``, the blocks' backward: activations shrink block by block while the gradients
  grow, so (both linear in the blocks done) its peak is at one end. At the start the head's
  backward is done: its sharded gradient exists, the head is resharded, the last block and the
  prefetched one are gathered, two groups' unsharded gradients are in flight, the blocks'
  activations are all held (plus full AC's recomputation of one block) and the trainer still
  holds the logits. At the end every sharded gradient exists, the embeddings are gathered with
  their unsharded gradient (and the first block's in flight), the activations are gone but the
  logits.
* ``optimizer``, the optimizer step: parameters, gradients and optimizer state; nothing
  gathered, no activation. Its temporaries are not counted (fused AdamW, the GPU default, has
  none).

The options act on these parts (:mod:`tools.planner.fit`): CPU offload takes the parameter
shards, gradients and optimizer state off the device in every phase, so it lowers the peak
by what the peak phase holds of them; the chunked loss replaces the head's vocabulary buffers
and the loss gradients by one chunk's buffer and the weight-gradient accumulator; activation
offload keeps none of the blocks' activations at the loss backward and one block's in the
blocks' backward; bf16 state halves the optimizer state.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PHASES", "PHASE_WORDS", "TERMS", "MemoryParts", "peak", "peak_phase_name"]

TERMS = ("params", "grads", "optimizer", "gathered_params", "unsharded_grads", "activations", "loss_grads")
PHASES = ("loss", "backward", "optimizer")
PHASE_WORDS = {"loss": "loss backward", "backward": "blocks' backward", "optimizer": "optimizer step"}


@dataclass(slots=True)
class MemoryParts:
    """What one rank holds, by kind, for :func:`peak` to place in the phases (bytes)."""

    params: float
    grads: float  # every sharded gradient (the end of the backward, the optimizer step)
    optimizer: float
    head_grads: float  # the sharded gradients the head's backward made (the blocks' backward start)
    accumulated: float  # the earlier micro-batches' gradients (0 with one micro-batch per step)
    accumulated_unsharded: bool  # they are FSDP2's unsharded accumulators (else the gradients themselves)
    gathered_loss: float
    gathered_start: float
    gathered_end: float
    unsharded_start: float
    unsharded_end: float
    layers: float  # the blocks' activations of the micro-batches in flight
    head: float  # the head's buffers of the micro-batches held (logits, log-softmax, its input, norm)
    loss_grads: float  # transient at the loss backward's start: its gradients, or the chunked head's buffers
    recompute: float  # full AC: one block's activations recomputed in the backward
    logits_kept: float  # what the trainer holds from the forward until the backward returns
    # the blocks' activations on the device at the blocks' backward start when not ``layers``
    # (activation offload: the one block whose saved tensors were brought back)
    layers_backward: float | None = None


def peak(p: MemoryParts) -> dict[str, float]:
    """The terms of the peak phase (:data:`TERMS`, bytes), their ``total`` (the rank's peak),
    each phase's total (``phase_loss``, ``phase_backward``: the larger of its two ends,
    ``phase_optimizer``) and the peak phase's index in :data:`PHASES` (``peak_phase``; the
    first on a tie). Called for every layout the search prices: plain arithmetic."""
    acc = p.accumulated
    layers_back = p.layers if p.layers_backward is None else p.layers_backward
    if p.accumulated_unsharded:
        loss = (p.params, 0.0, p.optimizer, p.gathered_loss, 0.0 + acc, p.layers + p.head, p.loss_grads)
        start_grads, start_unsharded = p.head_grads, p.unsharded_start + acc
    else:  # the gradients themselves accumulate: the head's are among them
        loss = (p.params, 0.0 + acc, p.optimizer, p.gathered_loss, 0.0, p.layers + p.head, p.loss_grads)
        start_grads, start_unsharded = max(p.head_grads, acc), p.unsharded_start
    start = (p.params, start_grads, p.optimizer, p.gathered_start, start_unsharded,
             layers_back + p.recompute + p.logits_kept, 0.0)  # fmt: skip
    end = (p.params, p.grads, p.optimizer, p.gathered_end, p.unsharded_end, p.logits_kept, 0.0)
    opt = (p.params, p.grads, p.optimizer, 0.0, 0.0, 0.0, 0.0)
    t_loss, t_start, t_end, t_opt = sum(loss), sum(start), sum(end), sum(opt)
    backward, t_back = (start, t_start) if t_start >= t_end else (end, t_end)
    if t_loss >= t_back and t_loss >= t_opt:
        top, terms, total = 0, loss, t_loss
    elif t_back >= t_opt:
        top, terms, total = 1, backward, t_back
    else:
        top, terms, total = 2, opt, t_opt
    params, grads, optimizer, gathered, unsharded, activations, loss_grads = terms
    return {
        "params": params, "grads": grads, "optimizer": optimizer, "gathered_params": gathered,
        "unsharded_grads": unsharded, "activations": activations, "loss_grads": loss_grads, "total": total,
        "phase_loss": t_loss, "phase_backward": t_back, "phase_optimizer": t_opt, "peak_phase": float(top),
    }  # fmt: skip


def peak_phase_name(mem: dict) -> str:
    """The name of ``mem``'s (:func:`peak`) peak phase."""
    return PHASES[int(mem["peak_phase"])]
