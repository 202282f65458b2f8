"""The KV cache of one batch of rows being generated: one :class:`LayerCache` per decoder layer.

The model's forward takes it as ``cache=`` (``models/common/decoder.py`` ``cached_forward``):
the cache says at which positions the new tokens sit (RoPE rows for those positions), and each
layer's attention hands it the keys and values of the new tokens (:meth:`LayerCache.update`,
after RoPE, before grouped-query repetition) and attends through it
(:meth:`LayerCache.attend`: the new queries against every cached key, causal). Under tensor
parallelism each rank's attention computes only its own heads, so each rank's cache holds
those heads, sharded like the attention: nothing is gathered. MLA (DeepSeek-V3) stores its
full per-head keys and values, not the compressed latent.

A step may run more tokens than it keeps: under sequence parallelism the tokens of a forward
must divide over tp, so the session pads each step to a multiple of tp with filler tokens after
the real ones. They are written to the cache after the real tokens and :meth:`KVCache.advance`
moves past the real ones only, so the next step overwrites them; no real query attends to them
(they sit after it: causal).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["KVCache", "LayerCache"]


class KVCache:
    """Keys and values of ``capacity`` positions for every layer, allocated on the first write
    (dtype, device, batch size and local heads come from the first keys). ``offset``: how many
    positions hold real tokens. ``position_error`` is a test hook (the negative control of the
    cache's positions): added to the RoPE positions of every step after the first, it makes
    the decoded tokens sit one position off from the prompt's, which must change the output."""

    def __init__(self, capacity: int, max_position: int, position_error: int = 0) -> None:
        self.capacity = capacity
        self.max_position = max_position  # the RoPE table's last row
        self.offset = 0
        self.step_len = 0
        self.position_error = position_error
        self._layers: dict[str, LayerCache] = {}

    def positions(self, s: int, device: torch.device) -> torch.Tensor:
        """The RoPE positions of the ``s`` tokens of this step (called once per forward, before
        the layers): ``offset .. offset + s - 1``, filler tokens past the table clamped to its
        last row (their outputs are never read)."""
        if self.offset + s > self.capacity:
            raise ValueError(f"KV cache of {self.capacity} positions cannot take {s} more after {self.offset}")
        self.step_len = s
        shift = self.position_error if self.offset > 0 else 0
        pos = torch.arange(self.offset, self.offset + s, device=device) + shift
        return pos.clamp_max(self.max_position)

    def layer(self, name: str) -> LayerCache:
        entry = self._layers.get(name)
        if entry is None:
            entry = self._layers[name] = LayerCache(self)
        return entry

    def advance(self, n: int) -> None:
        """The step's first ``n`` tokens are real: the next step starts after them."""
        self.offset += n


class LayerCache:
    """One layer's keys and values: ``[bs, capacity, local heads, head dim]`` each."""

    def __init__(self, owner: KVCache) -> None:
        self.owner = owner
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the step's keys and values ``[bs, s, heads, d]`` after the cached ones; every
        key and value up to the step's last token."""
        o, s = self.owner.offset, k.shape[1]
        if self.k is None:
            cap = self.owner.capacity
            self.k = k.new_zeros(k.shape[0], cap, *k.shape[2:])
            self.v = v.new_zeros(v.shape[0], cap, *v.shape[2:])
        self.k[:, o : o + s] = k
        self.v[:, o : o + s] = v
        return self.k[:, : o + s], self.v[:, : o + s]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
        """Softmax attention of the step's queries ``[bs, h, s, d]`` over the keys and values
        ``[bs, h, offset + s, d]``: query ``i`` sees keys ``0 .. offset + i``. The prompt's step
        (nothing cached) is the training kernel's causal call itself; a one-token step sees
        every key (no mask); other steps take a boolean mask."""
        o, s = self.owner.offset, q.shape[2]
        if o == 0:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        if s == 1:
            return F.scaled_dot_product_attention(q, k, v, scale=scale)
        q_pos = torch.arange(o, o + s, device=q.device)
        mask = torch.arange(o + s, device=q.device)[None, :] <= q_pos[:, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
