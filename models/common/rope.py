"""Rotary position embeddings (RoPE) with the two long-context frequency rescalings we need.

Tables are kept as real ``[max_seq_len, rope_dim // 2, 2]`` (cos, sin) float32 buffers rather than
complex tensors: ``Module.to(dtype)`` silently drops the imaginary part of complex buffers, and
real tensors go through DTensor / compile paths without special cases.

The model looks rows up with a ``positions`` LongTensor instead of slicing ``[:seqlen]``. Under
context parallelism a rank holds two non-contiguous chunks of the sequence (see
``models/common/sequence.py``), so "the first ``s`` rows" would be the wrong rotation for half of
its tokens.

Pairs are rotated in the interleaved layout (channels ``2i`` and ``2i + 1`` form one complex
number), matching the Meta Llama and DeepSeek-V3 reference checkpoints;
:func:`apply_rotary_emb_half_split` rotates ``transformers``' half-split pairs (Qwen3's
checkpoints) through the same function.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from models.common.sequence import load_balanced_positions


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1 long-context rescaling: long wavelengths are slowed by ``scale_factor``, short
    ones are kept, and the band in between is interpolated. Defaults are Llama 3.1's."""

    scale_factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.scale_factor <= 0:
            raise ValueError(f"Llama3RopeScaling.scale_factor must be > 0, got {self.scale_factor}.")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(
                "Llama3RopeScaling needs 0 < low_freq_factor < high_freq_factor, got "
                f"low={self.low_freq_factor}, high={self.high_freq_factor}."
            )
        if self.original_max_position_embeddings <= 0:
            raise ValueError(
                "Llama3RopeScaling.original_max_position_embeddings must be > 0, got "
                f"{self.original_max_position_embeddings}."
            )

    def apply(self, inv_freq: torch.Tensor, max_seq_len: int, theta: float) -> torch.Tensor:
        wavelen = 2 * math.pi / inv_freq
        low_freq_wavelen = self.original_max_position_embeddings / self.low_freq_factor
        high_freq_wavelen = self.original_max_position_embeddings / self.high_freq_factor
        slowed = inv_freq / self.scale_factor
        smooth = (self.original_max_position_embeddings / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        blended = (1 - smooth) * slowed + smooth * inv_freq
        out = torch.where(wavelen > low_freq_wavelen, slowed, inv_freq)
        in_between = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(in_between, blended, out)


@dataclass(frozen=True)
class YarnRopeScaling:
    """YaRN rescaling as in the DeepSeek-V3 reference: dimensions that rotate fewer than
    ``beta_slow`` times over ``original_seq_len`` are slowed by ``factor``, those rotating more
    than ``beta_fast`` times are kept, with a linear ramp in between. Like the reference it only
    takes effect when the table is longer than ``original_seq_len``; the matching softmax
    temperature correction lives in the attention (:func:`yarn_softmax_scale`)."""

    factor: float = 40.0
    original_seq_len: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0

    def __post_init__(self) -> None:
        if self.factor < 1:
            raise ValueError(f"YarnRopeScaling.factor must be >= 1, got {self.factor}.")
        if self.original_seq_len <= 0:
            raise ValueError(f"YarnRopeScaling.original_seq_len must be > 0, got {self.original_seq_len}.")
        if self.beta_fast <= 0 or self.beta_slow <= 0:
            raise ValueError(
                "YarnRopeScaling.beta_fast and beta_slow must be > 0, got "
                f"beta_fast={self.beta_fast}, beta_slow={self.beta_slow}."
            )

    def apply(self, inv_freq: torch.Tensor, max_seq_len: int, theta: float) -> torch.Tensor:
        if max_seq_len <= self.original_seq_len:
            return inv_freq
        rope_dim = 2 * inv_freq.numel()

        def correction_dim(num_rotations: float) -> float:
            return rope_dim * math.log(self.original_seq_len / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))

        low = max(math.floor(correction_dim(self.beta_fast)), 0)
        high = min(math.ceil(correction_dim(self.beta_slow)), rope_dim - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp(
            (torch.arange(inv_freq.numel(), dtype=inv_freq.dtype, device=inv_freq.device) - low) / (high - low),
            0,
            1,
        )
        keep = 1 - ramp
        return inv_freq / self.factor * (1 - keep) + inv_freq * keep


def yarn_softmax_scale(head_dim: int, scaling: YarnRopeScaling | None, mscale: float, max_seq_len: int) -> float:
    """Attention temperature for YaRN: the reference multiplies ``head_dim**-0.5`` by
    ``(0.1 * mscale * ln(factor) + 1)**2`` whenever the extended table is in use, compensating the
    flatter attention that slowed rotations produce."""
    scale = head_dim**-0.5
    if scaling is not None and max_seq_len > scaling.original_seq_len:
        m = 0.1 * mscale * math.log(scaling.factor) + 1.0
        scale = scale * m * m
    return scale


def compute_rope_table(
    rope_dim: int,
    max_seq_len: int,
    theta: float,
    scaling: Llama3RopeScaling | YarnRopeScaling | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """``[max_seq_len, rope_dim // 2, 2]`` float32 table of (cos, sin).

    Angles are formed in float64 so that large positions (>= 1e5) keep their phase accuracy;
    callers that need identical tables everywhere compute on CPU and copy (see
    :meth:`RotaryEmbedding.reset_table`)."""
    if rope_dim <= 0 or rope_dim % 2 != 0:
        raise ValueError(f"RoPE dimension must be a positive even int, got {rope_dim}.")
    if max_seq_len <= 0:
        raise ValueError(f"RoPE max_seq_len must be > 0, got {max_seq_len}.")
    if theta <= 0:
        raise ValueError(f"RoPE theta must be > 0, got {theta}.")
    exponents = torch.arange(0, rope_dim, 2, dtype=torch.float64, device=device) / rope_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is not None:
        inv_freq = scaling.apply(inv_freq, max_seq_len, theta)
    t = torch.arange(max_seq_len, dtype=torch.float64, device=device)
    angles = torch.outer(t, inv_freq)
    return torch.stack([angles.cos(), angles.sin()], dim=-1).to(torch.float32)


class RotaryEmbedding(nn.Module):
    """Owns the RoPE table for one model. Calling it with positions returns the rows to pass to
    :func:`apply_rotary_emb`.

    The table is a non-persistent buffer: it is a pure function of the config, so checkpoints
    need not carry it, and after meta-device construction plus ``to_empty`` it is rebuilt by
    :meth:`reset_table` (called from the models' ``init_weights``)."""

    def __init__(
        self,
        rope_dim: int,
        max_seq_len: int,
        theta: float,
        scaling: Llama3RopeScaling | YarnRopeScaling | None = None,
    ) -> None:
        super().__init__()
        self.rope_dim = rope_dim
        self.max_seq_len = max_seq_len
        self.theta = theta
        self.scaling = scaling
        # No explicit device: under ``with torch.device("meta")`` this stays free.
        self.register_buffer("table", compute_rope_table(rope_dim, max_seq_len, theta, scaling), persistent=False)

    @torch.no_grad()
    def reset_table(self) -> None:
        """Recompute on CPU and copy to wherever the buffer lives, restoring float32 if the
        module was cast."""
        device = self.table.device
        if device.type == "meta":
            raise ValueError(
                "RoPE table is on the meta device; call model.to_empty(device=...) before "
                "init_weights so the table has real storage."
            )
        table = compute_rope_table(self.rope_dim, self.max_seq_len, self.theta, self.scaling)
        self.table = table.to(device)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        if positions.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"RoPE positions must be an integer tensor, got {positions.dtype}.")
        positions = positions.to(self.table.device)
        if positions.dim() == 1:
            return self.table.index_select(0, positions)
        # per-row positions [bs, s] -> [bs, s, rope_dim // 2, 2]
        rows = self.table.index_select(0, positions.reshape(-1))
        return rows.view(*positions.shape, *self.table.shape[1:])

    def extra_repr(self) -> str:
        return f"rope_dim={self.rope_dim}, max_seq_len={self.max_seq_len}, theta={self.theta}, scaling={self.scaling}"


def apply_rotary_emb(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ([bs, s, heads, d]) by the rows ``rope`` for its positions: ``[s, d // 2,
    2]`` (one position per sequence index, shared by the batch) or ``[bs, s, d // 2, 2]`` (per
    row, e.g. positions that restart at each document).
    The rotation is done in float32 and cast back: bf16 loses the small sin terms at low
    frequencies. It is one complex multiplication over views of the (cos, sin) pairs: three
    kernels per call (cast up, multiply, cast back) where the written-out real form took nine,
    which on a GPU is memory traffic over every query and key of every layer, twice (forward
    and backward)."""
    if x.dim() != 4:
        raise ValueError(f"apply_rotary_emb expects x of shape [bs, s, heads, d], got {tuple(x.shape)}.")
    bs, s, d = x.shape[0], x.shape[1], x.shape[-1]
    if rope.shape not in ((s, d // 2, 2), (bs, s, d // 2, 2)):
        raise ValueError(
            f"RoPE rows have shape {tuple(rope.shape)} but x needs ({s}, {d // 2}, 2) or ({bs}, {s}, "
            f"{d // 2}, 2). The model builds these rows from the sequence length of its input; if a "
            "parallelism plan shards the sequence of the layer input (e.g. sequence parallel between "
            "pipeline stages), gather it before the model forward so positions cover the full local "
            "sequence."
        )
    # (x0 + i x1) * (cos + i sin); view_as_complex needs the pairs contiguous (a no-op after
    # the bf16 -> fp32 cast, one copy for strided fp32 slices such as MLA's rope parts)
    xc = torch.view_as_complex(x.float().contiguous().unflatten(-1, (d // 2, 2)))
    rc = torch.view_as_complex(rope.float().contiguous())
    rc = rc[None, :, None, :] if rope.dim() == 3 else rc[:, :, None, :]
    return torch.view_as_real(xc * rc).flatten(-2).type_as(x)


def apply_rotary_emb_half_split(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """RoPE on ``x`` [bs, s, heads, d] in the half-split layout (pair ``i`` is channels ``i``
    and ``i + d / 2``), through the interleaved :func:`apply_rotary_emb` on reordered channels."""
    d = x.shape[-1]
    interleaved = x.unflatten(-1, (2, d // 2)).transpose(-1, -2).flatten(-2)
    out = apply_rotary_emb(interleaved, rope)
    return out.unflatten(-1, (d // 2, 2)).transpose(-1, -2).flatten(-2)


def local_positions(
    seqlen_local: int,
    cp_rank: int,
    cp_size: int,
    max_seq_len: int,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Global positions of the ``seqlen_local`` tokens a context-parallel rank holds (plain
    ``arange`` when ``cp_size == 1``), checked against the RoPE table length."""
    if not (isinstance(cp_size, int) and isinstance(cp_rank, int) and cp_size >= 1 and 0 <= cp_rank < cp_size):
        raise ValueError(
            f"Invalid context-parallel attributes cp_rank={cp_rank!r}, cp_size={cp_size!r}; "
            "need ints with 0 <= cp_rank < cp_size."
        )
    seqlen = seqlen_local * cp_size
    if seqlen > max_seq_len:
        raise ValueError(
            f"Sequence length {seqlen} (local {seqlen_local} x cp {cp_size}) exceeds "
            f"max_seq_len={max_seq_len}; build the model with a larger max_seq_len."
        )
    return load_balanced_positions(seqlen, cp_rank, cp_size, device)
