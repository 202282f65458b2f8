"""The args half of the model contract: what every model's configuration dataclass provides.

A model's args class is a ``@dataclass`` that subclasses :class:`DecoderArgs` (a plain class, so
it adds no dataclass fields and leaves the subclass's field order alone) and has these fields,
read by the decoder shell (``models/common/decoder.py``), the trainer and the layout checks:

* ``dim`` (residual width), ``n_layers``, ``n_heads``, ``vocab_size``, ``max_seq_len``,
  ``norm_eps``;
* ``attn_mask_type`` (``causal`` | ``block_causal``), ``attn_type`` (``sdpa`` | ``flex`` |
  ``varlen``), ``eos_id`` (the token that ends each packed document; None when no document
  masking is used) and ``document_positions`` (restart RoPE positions at each document start):
  the attention settings of ``models/common/attention.py`` and ``documents.py``, checked by
  :func:`check_attention_args`;
* ``validate()``: raise ``ValueError`` naming the bad field. The shell calls it before building.

and may declare ``tie_word_embeddings: bool = False`` (the class attribute below is the default
for models that do not): the output head uses the embedding's weight, one parameter for both.

and overrides the properties below where the default does not fit. Properties rather than
fields so the published flavors stay plain dataclasses; give every dataclass field a default
(a field without one would pick up a property of the same name as its default).

No torch import here: flavor tables can be read without loading model code.
"""

from __future__ import annotations

ATTN_MASK_TYPES = ("causal", "block_causal")
ATTN_TYPES = ("sdpa", "flex", "varlen")


def check_attention_args(
    owner: str, attn_mask_type: object, attn_type: object, eos_id: object, document_positions: object
) -> None:
    """Raise ``ValueError`` naming the bad field of a model's attention settings."""
    if attn_mask_type not in ATTN_MASK_TYPES:
        raise ValueError(f"{owner}.attn_mask_type must be one of {', '.join(ATTN_MASK_TYPES)}; got {attn_mask_type!r}.")
    if attn_type not in ATTN_TYPES:
        raise ValueError(f"{owner}.attn_type must be one of {', '.join(ATTN_TYPES)}; got {attn_type!r}.")
    if not isinstance(document_positions, bool):
        raise ValueError(f"{owner}.document_positions must be true or false; got {document_positions!r}.")
    if eos_id is not None and (isinstance(eos_id, bool) or not isinstance(eos_id, int) or eos_id < 0):
        raise ValueError(f"{owner}.eos_id must be a token id (an int >= 0) or None; got {eos_id!r}.")
    needs_documents = attn_mask_type == "block_causal" or document_positions
    if needs_documents and eos_id is None:
        raise ValueError(
            f"{owner}: attn_mask_type='block_causal' and document_positions need the EOS token id that ends "
            "each packed document (eos_id); the trainer sets it from the tokenizer, set it yourself when "
            "building the model by hand."
        )
    if document_positions and attn_mask_type != "block_causal":
        raise ValueError(
            f"{owner}.document_positions restarts RoPE positions at each document start, which only "
            "makes sense when documents cannot see each other; set attn_mask_type='block_causal' too."
        )
    if attn_type == "varlen" and attn_mask_type != "block_causal":
        raise ValueError(
            f"{owner}.attn_type='varlen' runs one attention per document, so it needs "
            "attn_mask_type='block_causal'; use 'sdpa' or 'flex' for plain causal attention."
        )


def positive_int(owner: str, name: str, value: object) -> None:
    """Refuse ``owner.name = value`` unless it is a positive int (a bool is not)."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{owner}.{name} must be a positive int, got {value!r}.")


def non_negative_int(owner: str, name: str, value: object) -> None:
    """Refuse ``owner.name = value`` unless it is an int >= 0 (a bool is not)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{owner}.{name} must be an int >= 0, got {value!r}.")


def positive_number(owner: str, name: str, value: object) -> None:
    """Refuse ``owner.name = value`` unless it is a positive int or float (a bool is not)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{owner}.{name} must be a positive number, got {value!r}.")


class DecoderArgs:
    """Base of every model's args dataclass; see the module docstring for the required
    fields."""

    # Whether the output head reuses tok_embeddings.weight (one Parameter for both uses, as in
    # Llama 3.2 1B/3B and the small Qwen3 models). A plain class attribute, not a dataclass
    # field: a subclass that supports tying declares the field ``tie_word_embeddings: bool =
    # False`` (which then shadows this), one that does not inherits False.
    tie_word_embeddings: bool = False

    def check_tie_word_embeddings(self) -> None:
        """Raise ``ValueError`` when ``tie_word_embeddings`` is not a bool (call from
        ``validate()``)."""
        if not isinstance(self.tie_word_embeddings, bool):
            raise ValueError(
                f"{type(self).__name__}.tie_word_embeddings must be true or false; got {self.tie_word_embeddings!r}."
            )

    @property
    def needs_documents(self) -> bool:
        """Whether the forward needs each row's document structure (block-causal masking or
        in-document RoPE positions)."""
        return self.attn_mask_type == "block_causal" or self.document_positions

    def check_attention(self) -> None:
        """Raise ``ValueError`` naming a bad attention setting (call from ``validate()``)."""
        check_attention_args(
            type(self).__name__, self.attn_mask_type, self.attn_type, self.eos_id, self.document_positions
        )

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
