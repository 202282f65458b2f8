"""Tied input/output embeddings across pipeline stages (Megatron's embedding group).

Without pipelining a tied model holds one Parameter for ``tok_embeddings.weight`` and
``output.weight`` (models/common/decoder.py). A pipeline puts the embedding on the first stage
and the head on the last, so each of the two stages keeps a copy: the last stage's
``output.weight`` is drawn as the embedding is (``Decoder.init_weights``), and after each step's
backward (all micro-batches and gradient-accumulation steps) the two copies' gradients are summed
over :meth:`ParallelDims.embedding_mesh`, so both hold the gradient of the one tied parameter and
the same optimizer update keeps them bitwise equal. The gradient norm counts the weight once
(:func:`tied_copies` lists the copies to leave out of it). Where one rank holds both ends (the
V-shaped schedule) the two copies are summed locally.

Checkpoints hold the tied weight ONCE, under ``tok_embeddings.weight`` (model and optimizer
state): :func:`checkpoint_key` / :func:`checkpoint_optim_key` name the head's copy (or, on a whole
model, its alias) by the embedding's name, so a step checkpoint of any layout (pp or not) has
the same keys and resumes onto any other; the copy on the last stage is loaded from it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = [
    "EMBEDDING_KEY",
    "HEAD_KEY",
    "checkpoint_key",
    "checkpoint_optim_key",
    "head_only",
    "sync_tied_embedding_grads",
    "tied_copies",
]

EMBEDDING_KEY, HEAD_KEY = "tok_embeddings.weight", "output.weight"
_OPTIM_PREFIXES = ("state.", "param_groups.")


def _tied(part: nn.Module) -> bool:
    return bool(getattr(getattr(part, "args", None), "tie_word_embeddings", False))


def head_only(part: nn.Module) -> bool:
    """A tied model's last pipeline stage: it holds the head's copy, not the embedding."""
    return _tied(part) and getattr(part, "output", None) is not None and getattr(part, "tok_embeddings", None) is None


def checkpoint_key(part: nn.Module, fqn: str) -> str:
    """The checkpoint name of ``part``'s state-dict entry ``fqn``: a tied model's head is stored
    as the embedding it equals (one tensor in the checkpoint)."""
    return EMBEDDING_KEY if fqn == HEAD_KEY and _tied(part) else fqn


def checkpoint_optim_key(part: nn.Module, key: str) -> str:
    """:func:`checkpoint_key` for a flat optimizer state key (``state.<fqn>.exp_avg``,
    ``param_groups.<fqn>.lr``)."""
    if _tied(part):
        for prefix in _OPTIM_PREFIXES:
            if key.startswith(prefix + HEAD_KEY + "."):
                return prefix + EMBEDDING_KEY + key[len(prefix + HEAD_KEY) :]
    return key


def _ends(model_parts: Sequence[nn.Module]) -> tuple[nn.Parameter | None, nn.Parameter | None]:
    """This rank's embedding weight and its last-stage copy (None where it holds neither end,
    and for a whole model, whose one Parameter needs nothing)."""
    emb = head = None
    for part in model_parts:
        if not _tied(part):
            continue
        if part.tok_embeddings is not None and part.output is not None:
            return None, None  # a whole model: one Parameter for both uses
        if part.tok_embeddings is not None:
            emb = part.tok_embeddings.weight
        if part.output is not None:
            head = part.output.weight
    return emb, head


def tied_copies(model_parts: Sequence[nn.Module]) -> list[nn.Parameter]:
    """The last stage's copies of a tied weight on this rank: clipped with the rest, left out of
    the gradient norm (their twin on the first stage counts)."""
    _, head = _ends(model_parts)
    return [head] if head is not None else []


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


@torch.no_grad()
def sync_tied_embedding_grads(model_parts: Sequence[nn.Module], pd) -> None:
    """Sum the gradients of the two copies of a tied weight (once per optimizer step, after the
    last backward, before clipping). Collective over the embedding group on the ranks holding
    one end each; a no-op without pipelining or without tied embeddings."""
    emb, head = _ends(model_parts)
    if emb is None and head is None:
        return
    for p in (emb, head):
        if p is None:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        elif isinstance(p, DTensor) and p.grad.placements != p.placements:
            # the TP embedding's gradient comes back replicated: take this rank's rows (a local
            # slice), so both ends hold the same shard of the same rows
            p.grad = p.grad.redistribute(p.device_mesh, p.placements)
    if emb is not None and head is not None:
        total = emb.grad + head.grad
        emb.grad, head.grad = total, total.clone()
        return
    mesh = pd.embedding_mesh()
    grad = (emb if emb is not None else head).grad
    # both ends are sharded alike (the same FSDP/TP layout at the same other coordinates), so
    # the local shards are the same rows of the full gradient
    dist.all_reduce(_local(grad), group=mesh.get_group())
