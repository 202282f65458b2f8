"""Document structure of packed rows: which document each token belongs to, and where it sits
inside that document.

Pre-training packs documents into each ``seq_len`` window, each document followed by the EOS
token (``trainer/data/packing.py``). A document ends at each EOS of the row, and the EOS belongs
to the document it ends; the tokens before the row's first EOS are document 0 (usually the tail
of a document that began in an earlier window). Everything here is pure tensor math on token
ids, computed once per micro-batch by the decoder shell (``models/common/decoder.py``) and handed
to every layer: the attention cores turn the document ids into their mask
(``models/common/attention.py``), RoPE reads the in-document positions when
``document_positions`` is on.

Under context parallelism a rank holds two load-balanced chunks of each row; document ids are
defined on the *global* row, so the shell gathers the row's token ids over the cp group first
(``models/parallel/context_parallel.py``) and indexes the result at this rank's global positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models.common.args import ATTN_MASK_TYPES, ATTN_TYPES, check_attention_args

__all__ = [
    "ATTN_MASK_TYPES",
    "ATTN_TYPES",
    "Documents",
    "check_attention_args",
    "document_ids",
    "document_stats",
    "positions_in_document",
]


def document_ids(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """``[bs, s]`` int64: the index of the document each token belongs to within its row (the
    number of EOS tokens strictly before it; an EOS belongs to the document it ends)."""
    if tokens.dim() != 2 or tokens.is_floating_point():
        raise ValueError(f"document_ids expects integer token ids [bs, s], got {tuple(tokens.shape)} {tokens.dtype}")
    is_eos = (tokens == eos_id).to(torch.int64)
    return is_eos.cumsum(1) - is_eos


def positions_in_document(doc_ids: torch.Tensor) -> torch.Tensor:
    """``[bs, s]`` int64: each token's offset from the first token of its document."""
    s = doc_ids.size(1)
    idx = torch.arange(s, device=doc_ids.device).expand_as(doc_ids)
    starts_here = torch.ones_like(doc_ids, dtype=torch.bool)
    starts_here[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    start = torch.where(starts_here, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return idx - start


@dataclass(frozen=True)
class Documents:
    """The document structure of one micro-batch as this rank's attention needs it.

    ``ids``: ``[bs, S]`` document index of every token of the *global* row (all cp ranks'
    tokens, in sequence order): keys are gathered in global order. ``q_positions``: ``[s_local]``
    global positions of this rank's tokens (its queries), in local order."""

    ids: torch.Tensor
    q_positions: torch.Tensor

    @property
    def q_ids(self) -> torch.Tensor:
        """``[bs, s_local]`` document index of this rank's tokens."""
        return self.ids.index_select(1, self.q_positions)


def document_stats(tokens: torch.Tensor, eos_id: int) -> tuple[float, float]:
    """(mean document length in tokens, documents per row) of a ``[bs, s]`` batch of packed
    rows, counting a document cut by a row edge as one document of the row (what masking sees)."""
    ids = document_ids(tokens, eos_id)
    docs_per_row = (ids[:, -1] + 1).to(torch.float64)
    mean_docs = float(docs_per_row.mean())
    return tokens.size(1) / mean_docs, mean_docs
