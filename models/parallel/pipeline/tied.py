"""Copies of the token embedding that must stay one parameter (Megatron's embedding group).

Two features keep a copy of ``tok_embeddings.weight`` away from the embedding:

* tied input/output embeddings under pipeline parallelism: without pipelining a tied model holds
  one Parameter for ``tok_embeddings.weight`` and ``output.weight`` (models/common/decoder.py); a
  pipeline puts the embedding on the first stage and the head on the last, so the last stage's
  ``output.weight`` is a copy, drawn as the embedding is (``Decoder.init_weights``);
* DeepSeek-V3's multi-token prediction: every MTP depth embeds tokens with the model's embedding,
  and holds a copy of it (``mtp.{k}.embed_tokens.weight``, the published checkpoint's layout) on
  every layout, drawn as the embedding is (models/deepseek_v3/model.py); under a pipeline the
  copies sit on the last stage.

After each step's backward (all micro-batches and gradient-accumulation steps) the gradients of
the embedding and of all its copies are summed, so every copy holds the gradient of the one
shared parameter and the same optimizer update keeps them bitwise equal: locally where one rank
holds the embedding and its copies (a whole model, the V-shaped schedule's rank 0), else over
:meth:`ParallelDims.embedding_mesh` between the rank holding the first stage and the one holding
the copies (pp = 2). The gradient norm counts the weight once (:func:`tied_copies` lists the
copies to leave out of it).

Checkpoints hold the tied weight ONCE, under ``tok_embeddings.weight`` (model and optimizer
state): :func:`checkpoint_key` / :func:`checkpoint_optim_key` name the head's copy (or, on a whole
model, its alias) by the embedding's name, so a step checkpoint of any layout (pp or not) has
the same keys and resumes onto any other; the copy on the last stage is loaded from it. (The MTP
depths' copies keep their own names, the published checkpoint's layout.)
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


def _ends(model_parts: Sequence[nn.Module]) -> tuple[nn.Parameter | None, list[nn.Parameter]]:
    """This rank's embedding weight (None where it holds no first stage) and the copies of it
    this rank holds (the tied head copy of a last stage, the MTP depths' copies)."""
    emb, copies = None, []
    for part in model_parts:
        if part.tok_embeddings is not None:
            emb = part.tok_embeddings.weight
        if _tied(part) and part.tok_embeddings is None and part.output is not None:
            copies.append(part.output.weight)
        embedding_copies = getattr(part, "embedding_copies", None)
        if embedding_copies is not None:
            copies.extend(embedding_copies())
    return emb, copies


def tied_copies(model_parts: Sequence[nn.Module]) -> list[nn.Parameter]:
    """The copies of the embedding on this rank: clipped with the rest, left out of the gradient
    norm (the embedding itself, on the first stage, counts)."""
    return _ends(model_parts)[1]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


@torch.no_grad()
def sync_tied_embedding_grads(model_parts: Sequence[nn.Module], pd) -> None:
    """Sum the gradients of the embedding and its copies (once per optimizer step, after the last
    backward, before clipping). Collective over the embedding group on the ranks holding only the
    embedding or only copies (pp = 2); local where one rank holds both; a no-op without copies."""
    emb, copies = _ends(model_parts)
    if emb is not None and not copies:
        # the first stage's embedding: its copies may be on the other end of the pipeline
        if pd.pp < 2 or not any(_tied(p) or getattr(p.args, "mtp_layers", 0) for p in model_parts):
            return
    if emb is None and not copies:
        return
    params = ([emb] if emb is not None else []) + copies
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        elif isinstance(p, DTensor) and p.grad.placements != p.placements:
            # the TP embedding's gradient comes back replicated: take this rank's rows (a local
            # slice), so both ends hold the same shard of the same rows
            p.grad = p.grad.redistribute(p.device_mesh, p.placements)
    total = params[0].grad
    for p in params[1:]:
        total = total + p.grad
    if not (emb is not None and copies):
        # one end of the pipeline: both ends are sharded alike (the same FSDP/TP layout at the
        # same other coordinates), so the local shards are the same rows of the full gradient
        dist.all_reduce(_local(total), group=pd.embedding_mesh().get_group())
    for i, p in enumerate(params):
        p.grad = total if i == 0 else total.clone()
