"""The args half of the model contract: what every model's configuration dataclass provides.

A model's args class is a ``@dataclass`` that subclasses :class:`DecoderArgs` (a plain class, so
it adds no dataclass fields and leaves the subclass's field order alone) and has these fields,
read by the decoder shell (``models/common/decoder.py``), the trainer and the layout checks:

* ``dim`` (residual width), ``n_layers``, ``n_heads``, ``vocab_size``, ``max_seq_len``,
  ``norm_eps``;
* ``validate()``: raise ``ValueError`` naming the bad field. The shell calls it before building.

and overrides the properties below where the default does not fit. Properties rather than
fields so the published flavors stay plain dataclasses; give every dataclass field a default
(a field without one would pick up a property of the same name as its default).

No torch import here: flavor tables can be read without loading model code.
"""

from __future__ import annotations


class DecoderArgs:
    """Base of every model's args dataclass; see the module docstring for the required
    fields."""

    @property
    def num_experts(self) -> int:
        """Routed experts per MoE layer (what expert parallelism splits); 0 for a dense model.
        This is how a model says whether it has experts: callers ask ``has_experts``."""
        return 0

    @property
    def has_experts(self) -> bool:
        return self.num_experts > 0

    @property
    def attention_dim(self) -> int:
        """Width of the query/key dot product summed over heads (``n_heads * qk head dim``):
        the attention term of the FLOPs estimate (``models/common/flops.py``)."""
        raise NotImplementedError(
            f"{type(self).__name__} must define the attention_dim property (n_heads times the "
            "query/key head dim); see models/common/args.py."
        )

    @property
    def tp_kv_heads(self) -> int | None:
        """Key/value head count that tensor parallelism must divide (grouped-query attention),
        or None when the attention has no separate KV heads to split (MHA, MLA)."""
        return None
