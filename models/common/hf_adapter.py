"""Hugging Face state-dict adapters: our parameter names and layouts <-> a ``transformers``
checkpoint's, per model, reached through the registry (``register_model(...,
hf_state_dict_adapter=Cls)``; :func:`models.registry.get_hf_adapter`).

A model's adapter subclasses :class:`HFStateDictAdapter` and lists, for its args, one entry
per tensor of our state dict (:meth:`HFStateDictAdapter._entries`):

* :class:`Plain`: same tensor under another name;
* :class:`RopeRows`: rows of a query/key projection, permuted per head between the interleaved
  rotary layout (channels ``2i, 2i + 1`` form a pair: Meta's checkpoints and our
  ``models/common/rope.py``) and the half-split layout (pair ``i`` is channels ``i`` and
  ``i + head_dim / 2``: ``transformers``' ``rotate_half``);
* :class:`Stacked`: our ``[E, a, b]`` expert tensor is ``E`` checkpoint tensors ``[a, b]``;
* :class:`Absent`: a tensor the checkpoint format has no place for, loaded as a constant
  (and refused on export unless it still holds that constant);
* :class:`Copies`: one of our tensors that the checkpoint stores several times (DeepSeek-V3's
  MTP layers repeat the embedding and the head): exported under every name, loaded from the
  first (the others must equal it);
* :class:`Tied`: our key is another of our tensors under a second name (the output head of a
  model with ``tie_word_embeddings``): exported as nothing (the checkpoint holds the source
  once), loaded from the source's checkpoint tensor; a checkpoint that also stores the alias
  (``lm_head.weight``) loads only when it equals the source.

The base class turns those entries into :meth:`~HFStateDictAdapter.to_hf`,
:meth:`~HFStateDictAdapter.from_hf`, :meth:`~HFStateDictAdapter.hf_keys` and the shard-wise
:meth:`~HFStateDictAdapter.from_hf_local`; the model adapter adds ``hf_config`` (the
``config.json`` of a flavor) and the config check.

Tensors are full (unsharded) and keep their dtype; dtype conversion is the caller's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from models.common.args import DecoderArgs
from models.common.hf_config import ConfigField, HFConfigCheck, HFConfigMismatch, rope_config, same_value

__all__ = [
    "Absent",
    "ConfigField",
    "Copies",
    "HFConfigMismatch",
    "HFStateDictAdapter",
    "Plain",
    "RopeRows",
    "Stacked",
    "Tied",
    "half_split_to_interleaved",
    "interleaved_to_half_split",
    "rope_config",
    "same_value",
]

Read = Callable[[str, "tuple[slice, ...] | None"], Tensor]


# ---------------------------------------------------------------------------------------------
# rotary layouts


def interleaved_to_half_split(w: Tensor, n_heads: int) -> Tensor:
    """Rows of a q/k projection ``[n_heads * head_dim, cols]`` from the interleaved rotary
    layout to the half-split one (per head: row ``2i + c`` -> row ``c * head_dim / 2 + i``)."""
    rows, cols = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def half_split_to_interleaved(w: Tensor, n_heads: int) -> Tensor:
    """Inverse of :func:`interleaved_to_half_split`."""
    rows, cols = w.shape
    return w.reshape(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


# ---------------------------------------------------------------------------------------------
# entries


@dataclass(frozen=True)
class Plain:
    """``ours`` is ``hf`` unchanged."""

    ours: str
    hf: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class RopeRows:
    """``ours`` (interleaved rotary rows) is ``hf`` (half-split rows) permuted per head;
    ``shape`` is ``(n_heads * head_dim, cols)``."""

    ours: str
    hf: str
    shape: tuple[int, int]
    n_heads: int

    @property
    def head_dim(self) -> int:
        return self.shape[0] // self.n_heads


@dataclass(frozen=True)
class Stacked:
    """``ours`` ``[E, a, b]`` is ``torch.stack([hf[0], ..., hf[E-1]])`` (each ``[a, b]``, same
    orientation: no transposition)."""

    ours: str
    hf: tuple[str, ...]
    shape: tuple[int, int, int]


@dataclass(frozen=True)
class Absent:
    """``ours`` has no counterpart in the checkpoint format: loads as ``fill`` and can be
    exported only while it still equals ``fill`` (``why`` explains, for the error)."""

    ours: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    fill: float
    why: str


@dataclass(frozen=True)
class Tied:
    """``ours`` is our tensor ``source`` under a second name (one Parameter in the model); the
    checkpoint stores only the source. ``hf`` is the name the untied format would give it
    (``lm_head.weight``): a checkpoint may still store it, and then it must equal the source."""

    ours: str
    source: str
    hf: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Copies:
    """``ours`` is stored several times in the checkpoint: under ``hf[0]`` and as copies under
    ``hf[1:]`` (DeepSeek-V3's MTP layers store the embedding and the output head again). Export
    writes every copy; import reads ``hf[0]`` and, reading whole tensors, requires the copies to
    equal it."""

    ours: str
    hf: tuple[str, ...]
    shape: tuple[int, ...]


Entry = Plain | RopeRows | Stacked | Absent | Tied | Copies


def _hf_keys_of(entry: Entry) -> tuple[str, ...]:
    if isinstance(entry, (Stacked, Copies)):
        return entry.hf
    if isinstance(entry, (Absent, Tied)):
        return ()
    return (entry.hf,)


def _norm_slices(slices: tuple[slice, ...], shape: tuple[int, ...], key: str) -> tuple[slice, ...]:
    slices = tuple(slices)
    if len(slices) > len(shape) or not all(isinstance(s, slice) for s in slices):
        raise ValueError(f"{key}: local_slices must be at most {len(shape)} slice objects, got {slices!r}.")
    return slices + (slice(None),) * (len(shape) - len(slices))


# ---------------------------------------------------------------------------------------------
# the adapter


class HFStateDictAdapter(HFConfigCheck):
    """Base of the per-model adapters; see the module docstring. Subclasses set
    ``hf_architecture`` and ``model_type`` (per instance where the flavor decides them) and
    implement :meth:`_entries`, :meth:`hf_config`, :meth:`_config_fields` (and, for extra
    rules, :meth:`_config_problems`)."""

    hf_architecture: str = ""
    model_type: str = ""
    # our model name in the registry, for messages
    model_name: str = ""

    def __init__(self, args: DecoderArgs) -> None:
        self.args = args
        self._entry_table: dict[str, Entry] | None = None
        self._hf_table: dict[str, tuple[Entry, int]] | None = None

    @property
    def _by_ours(self) -> dict[str, Entry]:
        """our key -> entry, built on first use (config checks never need it)."""
        if self._entry_table is None:
            self._entry_table = {e.ours: e for e in self._entries()}
        return self._entry_table

    @property
    def _hf_to_entry(self) -> dict[str, tuple[Entry, int]]:
        if self._hf_table is None:
            self._hf_table = {k: (e, i) for e in self._by_ours.values() for i, k in enumerate(_hf_keys_of(e))}
        return self._hf_table

    # ------------------------------------------------------------------ what a model supplies
    def _entries(self) -> Iterable[Entry]:
        raise NotImplementedError

    def is_ignored_hf_key(self, hf_key: str) -> bool:
        """Checkpoint keys that carry nothing we load (e.g. old ``rotary_emb.inv_freq``
        buffers); :meth:`from_hf` skips them instead of calling them unexpected."""
        return hf_key.endswith("rotary_emb.inv_freq")

    # ------------------------------------------------------------------ introspection
    def our_keys(self) -> dict[str, tuple[int, ...]]:
        """Every key of our state dict for this flavor -> its shape."""
        return {k: tuple(e.shape) for k, e in self._by_ours.items()}

    def hf_keys(self) -> dict[str, tuple[int, ...]]:
        """Every checkpoint key this flavor expects -> its shape."""
        out: dict[str, tuple[int, ...]] = {}
        for e in self._by_ours.values():
            if isinstance(e, Stacked):
                for k in e.hf:
                    out[k] = tuple(e.shape[1:])
            elif isinstance(e, Copies):
                out.update(dict.fromkeys(e.hf, tuple(e.shape)))
            elif not isinstance(e, (Absent, Tied)):
                out[e.hf] = tuple(e.shape)
        return out

    def hf_keys_for(self, our_key: str) -> tuple[str, ...]:
        """The checkpoint keys our tensor ``our_key`` is made of (empty for a tensor the
        format does not hold)."""
        return _hf_keys_of(self._entry(our_key))

    def keep_in_fp32(self, hf_key: str) -> bool:
        """Whether an exporter should write ``hf_key`` in float32 whatever the export dtype
        (transformers keeps these in float32)."""
        return False

    def _entry(self, our_key: str) -> Entry:
        try:
            return self._by_ours[our_key]
        except KeyError:
            raise ValueError(
                f"{our_key!r} is not a tensor of {self.model_name or type(self).__name__}'s state dict for these args."
            ) from None

    # ------------------------------------------------------------------ conversion
    def to_hf(self, state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Our full state dict -> the checkpoint's keys and layouts (dtypes unchanged). Every
        returned tensor owns its storage or is one of the inputs, so a safetensors writer
        never sees two names sharing memory."""
        unexpected = sorted(set(state_dict) - set(self._by_ours))
        if unexpected:
            raise ValueError(
                f"to_hf: unexpected key(s) {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''} in the state "
                f"dict; expected the full state dict of this {self.model_name} flavor."
            )
        out: dict[str, Tensor] = {}
        for our_key, e in self._by_ours.items():
            if our_key not in state_dict:
                raise ValueError(f"to_hf: missing key {our_key!r} in the state dict.")
            t = state_dict[our_key]
            if tuple(t.shape) != tuple(e.shape):
                raise ValueError(f"to_hf: {our_key!r} has shape {tuple(t.shape)}, expected {tuple(e.shape)}.")
            if isinstance(e, Plain):
                out[e.hf] = t
            elif isinstance(e, RopeRows):
                out[e.hf] = interleaved_to_half_split(t, e.n_heads)
            elif isinstance(e, Stacked):
                for i, k in enumerate(e.hf):
                    out[k] = t[i].clone()
            elif isinstance(e, Copies):
                out[e.hf[0]] = t
                for k in e.hf[1:]:
                    out[k] = t.clone()  # its own storage: safetensors refuses shared memory
            elif isinstance(e, Tied):
                src = state_dict.get(e.source)
                if src is not None and t is not src and "meta" not in (t.device.type, src.device.type):
                    if not torch.equal(t, src):
                        raise ValueError(
                            f"to_hf: {our_key!r} differs from {e.source!r}, but the model ties them (one tensor "
                            "in the checkpoint); export a model whose two uses share one parameter"
                        )
            else:
                if t.device.type != "meta" and not bool((t == e.fill).all()):
                    raise ValueError(f"to_hf: {our_key!r} cannot be exported: {e.why}")
        return out

    def from_hf(self, hf_state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """A checkpoint's full state dict -> ours. Raises ValueError naming the key for a
        missing key, a wrong shape or an unexpected key."""
        aliases = {e.hf: e for e in self._by_ours.values() if isinstance(e, Tied)}
        unexpected = sorted(
            k
            for k in hf_state_dict
            if k not in self._hf_to_entry and k not in aliases and not self.is_ignored_hf_key(k)
        )
        if unexpected:
            raise ValueError(
                f"from_hf: unexpected key(s) {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''} in the "
                f"checkpoint; it is not a {self.hf_architecture} checkpoint of this flavor's shapes."
            )
        expected = self.hf_keys()

        def get(k: str) -> Tensor:
            if k not in hf_state_dict:
                raise ValueError(f"from_hf: missing key {k!r} in the checkpoint.")
            t = hf_state_dict[k]
            if tuple(t.shape) != expected[k]:
                raise ValueError(f"from_hf: {k!r} has shape {tuple(t.shape)}, expected {expected[k]}.")
            return t

        out: dict[str, Tensor] = {}
        for our_key, e in self._by_ours.items():
            if isinstance(e, Plain):
                out[our_key] = get(e.hf)
            elif isinstance(e, RopeRows):
                out[our_key] = half_split_to_interleaved(get(e.hf), e.n_heads)
            elif isinstance(e, Stacked):
                out[our_key] = torch.stack([get(k) for k in e.hf])
            elif isinstance(e, Copies):
                out[our_key] = get(e.hf[0])
                for k in e.hf[1:]:
                    if not torch.equal(get(k), out[our_key]):
                        raise ValueError(
                            f"from_hf: the checkpoint's {k!r} differs from {e.hf[0]!r}; this model shares one "
                            "tensor for both, so they must be equal"
                        )
            elif isinstance(e, Absent):
                out[our_key] = torch.full(e.shape, e.fill, dtype=e.dtype)
        for e in aliases.values():
            out[e.ours] = out[e.source]
            if e.hf in hf_state_dict and not torch.equal(hf_state_dict[e.hf], self.to_hf_tensor(e.source, out)):
                raise ValueError(
                    f"from_hf: the checkpoint stores {e.hf!r} different from the tensor it is tied to, but these "
                    "args tie them (tie_word_embeddings); load it with tie_word_embeddings = false"
                )
        return out

    def to_hf_tensor(self, our_key: str, state_dict: Mapping[str, Tensor]) -> Tensor:
        """The checkpoint tensor of our single-key entry ``our_key`` (Plain or RopeRows)."""
        e = self._entry(our_key)
        t = state_dict[our_key]
        return interleaved_to_half_split(t, e.n_heads) if isinstance(e, RopeRows) else t

    def from_hf_local(self, our_key: str, local_slices: tuple[slice, ...], read: Read) -> Tensor:
        """Our tensor ``our_key`` restricted to ``local_slices`` (one slice per dim of our full
        tensor), reading through ``read(hf_key, slices or None)`` only what it needs: a plain
        tensor's slice, the heads that a row range of a permuted q/k touches, the experts in
        the slice of a stacked tensor. Equals ``from_hf(full)[our_key][local_slices]``."""
        e = self._entry(our_key)
        if isinstance(e, Tied):
            return self.from_hf_local(e.source, local_slices, read)
        sl = _norm_slices(local_slices, tuple(e.shape), our_key)
        if isinstance(e, Plain):
            return read(e.hf, sl)
        if isinstance(e, Copies):
            return read(e.hf[0], sl)
        if isinstance(e, Absent):
            return torch.full(e.shape, e.fill, dtype=e.dtype)[sl]
        if isinstance(e, Stacked):
            experts = range(*sl[0].indices(e.shape[0]))
            if len(experts) == 0:
                probe = read(e.hf[0], (slice(0, 0), slice(0, 0)))
                n1 = len(range(*sl[1].indices(e.shape[1])))
                n2 = len(range(*sl[2].indices(e.shape[2])))
                return torch.empty((0, n1, n2), dtype=probe.dtype, device=probe.device)
            return torch.stack([read(e.hf[i], sl[1:]) for i in experts])
        # RopeRows: read the whole heads the rows touch, un-permute them, then cut the rows.
        rows = range(*sl[0].indices(e.shape[0]))
        hd = e.head_dim
        if len(rows) == 0:
            return read(e.hf, (slice(0, 0), sl[1]))
        h0 = min(rows[0], rows[-1]) // hd
        h1 = max(rows[0], rows[-1]) // hd + 1
        block = read(e.hf, (slice(h0 * hd, h1 * hd), sl[1]))
        block = half_split_to_interleaved(block, h1 - h0)
        base = h0 * hd
        if rows.step == 1:
            return block[rows.start - base : rows.stop - base]
        return block[torch.tensor([r - base for r in rows], dtype=torch.long, device=block.device)]
