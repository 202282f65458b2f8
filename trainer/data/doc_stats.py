"""The startup line that says what block-causal masking does to the training data: the mean
document length and documents per window of the first step's batch (this rank's micro-batches,
as the loader packed them; ``models/common/documents.document_stats`` counts a document cut by
a window edge as one document of that window, which is what the mask sees).

Computed from micro-batches the loop already holds, so it reads no extra data and leaves the
data order and the loader's checkpointed state untouched."""

from __future__ import annotations

import torch

from models.common.documents import document_stats


def document_stats_line(
    microbatches: list[tuple[torch.Tensor, torch.Tensor]], eos_id: int | None, attn_mask_type: str
) -> str:
    """``data: mean document length 183.2 tokens, 2.8 documents per 512-token window
    (attn_mask_type=block_causal)`` for the inputs of ``microbatches``."""
    if eos_id is None:
        return f"data: the tokenizer has no EOS token, so documents are unknown (attn_mask_type={attn_mask_type})"
    tokens = torch.cat([inputs for inputs, _labels in microbatches]).cpu()
    mean_len, docs = document_stats(tokens, eos_id)
    return (
        f"data: mean document length {mean_len:.1f} tokens, {docs:.1f} documents per {tokens.size(1)}-token "
        f"window (attn_mask_type={attn_mask_type}; first step's batch, {tokens.size(0)} windows)"
    )
