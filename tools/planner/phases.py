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
offload keeps two blocks' worth of the activations; bf16 state halves the optimizer state.
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


def _phases(p: MemoryParts) -> dict[str, dict[str, float]]:
    acc = "unsharded_grads" if p.accumulated_unsharded else "grads"
    loss = {"params": p.params, "grads": 0.0, "optimizer": p.optimizer, "gathered_params": p.gathered_loss,
            "unsharded_grads": 0.0, "activations": p.layers + p.head, "loss_grads": p.loss_grads}  # fmt: skip
    loss[acc] += p.accumulated
    start = {"params": p.params, "grads": p.head_grads, "optimizer": p.optimizer,
             "gathered_params": p.gathered_start, "unsharded_grads": p.unsharded_start,
             "activations": p.layers + p.recompute + p.logits_kept, "loss_grads": 0.0}  # fmt: skip
    if p.accumulated_unsharded:
        start["unsharded_grads"] += p.accumulated
    else:  # the gradients themselves accumulate: the head's are among them
        start["grads"] = max(p.head_grads, p.accumulated)
    end = {"params": p.params, "grads": p.grads, "optimizer": p.optimizer, "gathered_params": p.gathered_end,
           "unsharded_grads": p.unsharded_end, "activations": p.logits_kept, "loss_grads": 0.0}  # fmt: skip
    backward = start if sum(start.values()) >= sum(end.values()) else end
    opt = {"params": p.params, "grads": p.grads, "optimizer": p.optimizer, "gathered_params": 0.0,
           "unsharded_grads": 0.0, "activations": 0.0, "loss_grads": 0.0}  # fmt: skip
    return {"loss": loss, "backward": backward, "optimizer": opt}


def peak(p: MemoryParts) -> dict[str, float]:
    """The terms of the peak phase (:data:`TERMS`, bytes), their ``total`` (the rank's peak),
    each phase's total (``phase_loss``, ``phase_backward``, ``phase_optimizer``) and the peak
    phase's index in :data:`PHASES` (``peak_phase``; the first on a tie)."""
    phases = _phases(p)
    totals = {name: sum(terms.values()) for name, terms in phases.items()}
    top = max(PHASES, key=lambda name: totals[name])
    mem = dict(phases[top])
    mem["total"] = totals[top]
    for name in PHASES:
        mem[f"phase_{name}"] = totals[name]
    mem["peak_phase"] = float(PHASES.index(top))
    return mem


def peak_phase_name(mem: dict) -> str:
    """The name of ``mem``'s (:func:`peak`) peak phase."""
    return PHASES[int(mem["peak_phase"])]
