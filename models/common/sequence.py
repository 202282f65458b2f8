"""Load-balanced sequence layout for context parallelism.

With causal attention, the tokens at the end of a sequence attend to far more keys than the
tokens at its start. Splitting the sequence into ``cp`` contiguous pieces would give the last
rank most of the work, so the sequence is cut into ``2 * cp`` chunks and rank ``r`` holds chunk
``r`` (from the head) and chunk ``2 * cp - 1 - r`` (from the tail). Every rank then does the same
amount of attention work.

Everything here is pure tensor indexing: the data loader, RoPE and the CP attention all agree on
where each local token sits in the global sequence by calling the same two functions.
"""

from __future__ import annotations

import torch


def _check(seq_len: int, cp_size: int) -> None:
    if seq_len % (2 * cp_size) != 0:
        raise ValueError(
            f"seq_len={seq_len} is not divisible by 2*cp={2 * cp_size}; context parallelism "
            f"splits each sequence into 2*cp load-balanced chunks. Pick a seq_len that is a "
            f"multiple of {2 * cp_size}."
        )


def load_balanced_positions(
    seq_len: int, cp_rank: int, cp_size: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Global positions (LongTensor of length ``seq_len // cp_size``) of the tokens that rank
    ``cp_rank`` holds, in local order: its head chunk, then its tail chunk."""
    if cp_size == 1:
        return torch.arange(seq_len, device=device)
    _check(seq_len, cp_size)
    chunk = seq_len // (2 * cp_size)
    head = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    tail_index = 2 * cp_size - 1 - cp_rank
    tail = torch.arange(tail_index * chunk, (tail_index + 1) * chunk, device=device)
    return torch.cat([head, tail])


def load_balanced_shard(x: torch.Tensor, dim: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """The part of ``x`` (full sequence along ``dim``) that rank ``cp_rank`` holds."""
    if cp_size == 1:
        return x
    positions = load_balanced_positions(x.size(dim), cp_rank, cp_size, device=x.device)
    return x.index_select(dim, positions)


def load_balanced_unshard(chunks: list[torch.Tensor], dim: int) -> torch.Tensor:
    """Inverse of :func:`load_balanced_shard`: ``chunks[r]`` is rank r's local part; returns the
    full sequence along ``dim`` in global order."""
    cp_size = len(chunks)
    if cp_size == 1:
        return chunks[0]
    local_len = chunks[0].size(dim)
    seq_len = local_len * cp_size
    order = torch.cat([load_balanced_positions(seq_len, r, cp_size, device=chunks[0].device) for r in range(cp_size)])
    stacked = torch.cat(chunks, dim=dim)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(seq_len, device=order.device)
    return stacked.index_select(dim, inverse)
