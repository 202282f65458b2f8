"""The decoder shell every model subclasses, and the module half of the model contract.

A model is ``tok_embeddings -> layers (blocks) -> norm -> output`` with RoPE rows computed once
per forward from the global positions of this rank's tokens. :class:`Decoder` owns all of that;
a model subclass only says how to build its RoPE table and its blocks (and, if it needs it,
extra init). The parallelism code relies on this structure, so it is the contract:

* ``tok_embeddings``, ``layers`` (``nn.ModuleDict`` keyed ``"0"``, ``"1"``, ...), ``norm``,
  ``output`` (whose weight *is* ``tok_embeddings.weight`` when ``args.tie_word_embeddings``):
  FSDP wraps them, the TP plan matches them, pipeline splitting deletes ``layers``
  entries and sets ``tok_embeddings`` / ``norm`` + ``output`` to None away from the ends (so
  parameter FQNs, and with them FQN-seeded init and checkpoints, are the full model's);
* ``cp_rank`` / ``cp_size``: set by the context-parallel applier; :meth:`Decoder.local_positions`
  turns them into the positions of this rank's load-balanced tokens, and ``sequence_gather``
  (set by the same applier) turns this rank's token ids into the whole row's, from which the
  document structure is computed (``models/common/documents.py``);
* the forward takes ``doc_tokens``: on a pipeline stage without ``tok_embeddings`` (fed hidden
  states) the micro-batch's token ids, from which the stage computes the same document
  structure and positions as the first stage (the schedule passes them as a keyword argument
  to every stage; only needed when ``args.needs_documents``);
* every layer gets ``(h, rope, mask)``: the RoPE rows and the attention mask are built once per
  micro-batch here (the mask by the first layer's ``attention.core.prepare``), not per layer;
* inference (``trainer/inference/``) calls the forward with ``cache=``: a KV cache (duck-typed,
  so this folder imports nothing of the trainer) that gives the positions of the new tokens
  (``cache.positions(s, device)``: after those already cached) and one object per layer
  (``cache.layer(name)``) that each attention hands its new keys and values to
  (``update(k, v)`` -> every key and value so far) and attends through
  (``attend(q, k, v, scale)``, causal against the cache); without it (the default, training)
  nothing of that path runs;
* ``boundary_seq_shards``: set by the tensor-parallel applier (tp under sequence parallel): the
  hidden states a pipeline stage receives and sends hold this rank's ``1 / boundary_seq_shards``
  of its local sequence (:meth:`Decoder.local_seq_len`);
* blocks are :class:`DecoderBlock`: ``attention_norm``, ``attention`` (a
  :class:`DecoderAttention`), ``ffn_norm`` and either ``feed_forward`` (dense, a
  ``models/common/feed_forward.FeedForward``) or ``moe`` (``moe_enabled`` says which);
* :meth:`Decoder.moe_layers`: the MoE modules (``models/common/moe.MoE``) of the layers
  this model (or pipeline stage) holds; the one definition the parallelize plan and the
  trainer use.

The args half of the contract is ``models/common/args.DecoderArgs``; the registry
(``models/registry.py``) ties a model class to its flavors and parallelize function.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from models.common.args import DecoderArgs
from models.common.chunked_loss import enable_chunked_head
from models.common.documents import Documents, document_ids, positions_in_document
from models.common.flops import model_flops_per_token
from models.common.init import InitRule, full_init_tensor, init_parameters, standard_rule, write_full_into
from models.common.norms import RMSNorm
from models.common.rope import RotaryEmbedding, local_positions
from parallel_dims.torch_compat import per_rank

__all__ = ["Decoder", "DecoderAttention", "DecoderBlock", "moe_layers"]


class DecoderAttention(nn.Module):
    """Base of every attention module: ``forward(x [bs, s, dim], rope rows) -> [bs, s, dim]``,
    with the position-mixing part in an ``nn.Module`` attribute ``core`` (called with
    already-rotated, already-repeated heads; context parallelism swaps it).

    What tensor parallelism needs, declared per class (or per instance where it depends on
    the config) instead of guessed from attribute names:

    * ``tp_colwise``: the projections that produce heads, split column-wise over tp (each
      rank computes its share of heads; read head counts from tensor shapes in ``forward``);
    * ``tp_rowwise``: the output projection, split row-wise (partial sums reduced over tp);
    * ``tp_grad_syncs``: names of ``Callable[[Tensor], Tensor]`` attributes the module applies
      to tensors computed by replicated weights but consumed by this rank's heads only; the TP
      applier sets each to an all-reduce of the gradient (identity otherwise).

    Every other parameter stays replicated over tp.

    What the start-up kernels line (``models/kernels.py``) reports: :meth:`narrow_value_heads`,
    for an attention whose values are narrower than its queries and keys."""

    tp_colwise: tuple[str, ...] = ()
    tp_rowwise: str = "wo"
    tp_grad_syncs: tuple[str, ...] = ()

    def narrow_value_heads(self) -> tuple[str, int, int] | None:
        """``(label, q/k head dim, value head dim)`` when this attention's values are narrower
        than its queries and keys (the kernels may pad them: ``models/common/attention.py``
        ``value_head_plan``), reported under ``label``; None (the default) otherwise."""
        return None


class DecoderBlock(nn.Module):
    """Pre-norm residual block: ``h = x + attention(attention_norm(x)); out = h +
    ffn(ffn_norm(h))``, where ``ffn`` is ``moe`` when ``moe_enabled`` and ``feed_forward``
    otherwise. Subclasses build ``attention_norm``, ``attention``, ``ffn_norm`` and the FFN
    in use (only that one is registered)."""

    moe_enabled: bool = False

    def __init__(self, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: Any = None, cache: Any = None) -> torch.Tensor:
        if cache is None:
            h = x + self.attention(self.attention_norm(x), rope, mask)
        else:  # inference with a KV cache: a keyword, so tensor parallelism's input plan is unchanged
            h = x + self.attention(self.attention_norm(x), rope, mask, cache=cache)
        ffn = self.moe if self.moe_enabled else self.feed_forward
        return h + ffn(self.ffn_norm(h))


class Decoder(nn.Module):
    """Shell of a decoder-only LM. Subclasses implement :meth:`build_rope` and
    :meth:`build_block`; they may override :meth:`init_rule` and extend :meth:`init_weights`.

    Construction order (and with it module and parameter order) is ``tok_embeddings``,
    ``rope``, ``layers``, ``norm``, ``output``."""

    def __init__(self, args: DecoderArgs) -> None:
        super().__init__()
        args.validate()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.rope = self.build_rope(args)
        self.layers = nn.ModuleDict({str(i): self.build_block(i, args) for i in range(args.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(args.dim, eps=args.norm_eps)
        self.output: nn.Linear | None = enable_chunked_head(nn.Linear(args.dim, args.vocab_size, bias=False))
        if args.tie_word_embeddings:
            # one Parameter for both uses ([vocab, dim] either way): named_parameters lists it
            # once, as tok_embeddings.weight, so init, optimizer and checkpoints see one tensor
            self.output.weight = self.tok_embeddings.weight
        # Set by the context-parallel applier; this rank holds the load-balanced chunks
        # ``cp_rank`` of ``cp_size`` of every sequence.
        self.cp_rank = 0
        self.cp_size = 1
        # Set by the context-parallel applier: this rank's [bs, s_local] token ids -> the whole
        # row's [bs, seq] in sequence order (an all-gather over cp); identity without cp.
        self.sequence_gather = _identity
        # Set by the tensor-parallel applier under sequence parallelism: hidden states cross
        # pipeline stage boundaries sharded along the sequence into this many parts (tp), so
        # each tp rank sends its own shard to the same tp rank of the next stage.
        self.boundary_seq_shards = 1
        # Set by the trainer (training.loss_chunk_tokens): called with ``labels``, the last stage
        # returns each token's cross-entropy computed this many tokens at a time instead of the
        # logits (models/common/chunked_loss.py)
        self.loss_chunk_tokens = 0

    def to_empty(self, *, device, recurse: bool = True):
        """``nn.Module.to_empty``, which materialises a meta model by giving each module's
        parameter slots new Parameters one by one, so a tied head would get a weight of its own;
        re-tied after it. (``to`` / ``cuda`` between real devices keep the Parameter objects, and
        with them the tie; the parallel appliers keep the two slots on one object.)"""
        out = super().to_empty(device=device, recurse=recurse)
        self._retie()
        return out

    def _retie(self) -> None:
        if self.args.tie_word_embeddings and self.tok_embeddings is not None and self.output is not None:
            if self.output.weight is not self.tok_embeddings.weight:
                self.output.weight = self.tok_embeddings.weight

    # ------------------------------------------------------------------ what a model supplies
    def build_rope(self, args: DecoderArgs) -> RotaryEmbedding:
        """The RoPE table (its width is the rotated slice of a head)."""
        raise NotImplementedError(f"{type(self).__name__} must implement build_rope(args)")

    def build_block(self, layer_id: int, args: DecoderArgs) -> DecoderBlock:
        """Layer ``layer_id`` (the global index: pipeline stages keep their layers' ids)."""
        raise NotImplementedError(f"{type(self).__name__} must implement build_block(layer_id, args)")

    def init_rule(self) -> InitRule:
        """How each parameter is drawn (see ``models/common/init.py``)."""
        return standard_rule(self.args.n_layers, self.args.dim, tied=self.args.tie_word_embeddings)

    # ------------------------------------------------------------------ the shell
    def local_positions(self, seqlen_local: int, device: torch.device) -> torch.Tensor:
        """Global positions of this rank's tokens (identity without context parallelism)."""
        # per rank: under comm.mode = local_tensor cp_rank holds one int per simulated rank
        return per_rank(local_positions)(seqlen_local, self.cp_rank, self.cp_size, self.args.max_seq_len, device)

    def local_seq_len(self, inputs: torch.Tensor) -> int:
        """Length of this rank's (cp-local) sequence, which RoPE positions are computed for:
        token ids hold all of it; the hidden states a later pipeline stage receives hold
        ``1 / boundary_seq_shards`` of it (their sequence-parallel shard)."""
        if self.tok_embeddings is not None:
            return inputs.shape[1]
        return inputs.shape[1] * self.boundary_seq_shards

    def forward(
        self,
        tokens: torch.Tensor,
        doc_tokens: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        *,
        cache: Any = None,
    ) -> torch.Tensor:
        """``tokens`` [bs, s] -> logits [bs, s, vocab]; with ``labels`` [bs, s] (and
        ``loss_chunk_tokens`` set) each token's float32 cross-entropy [bs, s] instead, the head
        and loss run chunk by chunk (:meth:`head`). On pipeline stages without
        ``tok_embeddings`` the input is hidden states [bs, s / boundary_seq_shards, dim] and
        ``doc_tokens`` the micro-batch's token ids [bs, s] (needed when ``args.needs_documents``);
        without ``output`` the hidden states after the last local layer (normed if ``norm`` is
        kept) are returned, in the layout of the blocks' output (sequence-sharded under
        sequence parallelism). With ``cache`` (inference, see the module docstring):
        :meth:`cached_forward`."""
        if cache is not None:
            return self.cached_forward(tokens, cache)
        h, _, _ = self.trunk(tokens, doc_tokens)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is None:
            return h
        return self.head(h, labels)

    def cached_forward(self, tokens: torch.Tensor, cache: Any) -> torch.Tensor:
        """Logits of ``tokens`` [bs, s] that follow the tokens ``cache`` holds: RoPE at the
        positions the cache gives, every layer's attention through its cache entry, causal
        over the whole context (a prompt is one document: no block-causal masking). The whole
        model only (no pipeline stage, no context parallelism)."""
        if self.tok_embeddings is None or self.output is None or self.cp_size > 1:
            raise ValueError("a KV cache needs the whole model on each rank: no pipeline stage, no context parallelism")
        h = self._embed(tokens)
        rope = self.rope(cache.positions(tokens.shape[1], tokens.device))
        for name, layer in self.layers.items():
            h = layer(h, rope, None, cache=cache.layer(name))
        return self.output(self.norm(h))

    def head(self, h: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        """The output head on the normed states ``h``: the logits, or with ``labels`` each
        token's cross-entropy, ``loss_chunk_tokens`` tokens at a time
        (``models/common/chunked_loss.py``)."""
        if labels is None:
            return self.output(h)
        if self.loss_chunk_tokens < 1:
            raise ValueError("the model got labels but training.loss_chunk_tokens is 0: the plain head returns logits")
        return self.output(h, labels=labels, chunk_tokens=self.loss_chunk_tokens)

    def trunk(
        self, tokens: torch.Tensor, doc_tokens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """The embedding (or received hidden states) through this model's layers: the last
        layer's output before the final norm, with the RoPE rows and attention mask the layers
        used (a model with blocks after the trunk, such as DeepSeek-V3's MTP depths, reuses them)."""
        h = self._embed(tokens)
        ids = tokens if self.tok_embeddings is not None else doc_tokens
        rope, mask = self.attention_inputs(ids, self.local_seq_len(tokens), h.size(0), tokens.device)
        for layer in self.layers.values():
            h = layer(h, rope, mask)
        return h, rope, mask

    def blocks(self) -> list[nn.Module]:
        """Every decoder block this model (or pipeline stage) holds: its ``layers``, then any
        block a model runs after them (DeepSeek-V3's MTP depths). The appliers that wrap blocks
        (FSDP, activation checkpointing, compile, compute copies) and :meth:`moe_layers` read
        this list."""
        return list(self.layers.values())

    def documents(self, ids: torch.Tensor | None, positions: torch.Tensor) -> Documents:
        """The document structure of this rank's micro-batch: ``ids`` [bs, s_local] token ids of
        this rank's tokens (at global ``positions``)."""
        if ids is None:
            raise ValueError(
                f"attn_mask_type={self.args.attn_mask_type!r} / document_positions="
                f"{self.args.document_positions} need the micro-batch's token ids on every pipeline "
                "stage: call a stage without tok_embeddings as stage(hidden, doc_tokens=token_ids)"
            )
        if ids.dim() != 2 or ids.is_floating_point() or ids.size(1) != positions.numel():
            raise ValueError(
                f"doc_tokens must be integer token ids [bs, {positions.numel()}] (this rank's local "
                f"sequence), got {tuple(ids.shape)} {ids.dtype}"
            )
        full = self.sequence_gather(ids)
        return Documents(ids=document_ids(full, self.args.eos_id), q_positions=positions)

    def attention_inputs(
        self, ids: torch.Tensor | None, seqlen_local: int, bs: int, device: torch.device
    ) -> tuple[torch.Tensor, Any]:
        """The RoPE rows and the attention mask every layer of this micro-batch uses (built once
        per micro-batch). RoPE rows are ``[s_local, ...]`` for the row's global positions, or
        ``[bs, s_local, ...]`` for in-document positions (``args.document_positions``)."""
        positions = self.local_positions(seqlen_local, device)
        docs = self.documents(ids, positions) if self.args.needs_documents else None
        if docs is not None and self.args.document_positions:
            rope = self.rope(positions_in_document(docs.ids).index_select(1, positions))
        else:
            rope = self.rope(positions)
        core = next(iter(self.layers.values())).attention.core
        mask = core.prepare(docs if self.args.attn_mask_type == "block_causal" else None, bs, seqlen_local, device)
        return rope, mask

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.tok_embeddings is not None:
            if tokens.dim() != 2 or tokens.is_floating_point():
                raise ValueError(
                    f"Expected integer token ids of shape [bs, s], got {tuple(tokens.shape)} "
                    f"{tokens.dtype}. (Only pipeline stages without tok_embeddings take hidden "
                    "states.)"
                )
            return self.tok_embeddings(tokens)
        dim = self.args.dim
        if tokens.dim() != 3 or tokens.shape[-1] != dim:
            raise ValueError(
                f"This model has no tok_embeddings (a later pipeline stage), so it expects hidden "
                f"states [bs, s / boundary_seq_shards, {dim}], got {tuple(tokens.shape)}."
            )
        return tokens

    def init_weights(self, seed: int) -> None:
        """Seeded, layout-independent init (see ``models/common/init.py``); also rebuilds the
        RoPE table, which ``to_empty`` leaves as garbage. Subclasses with buffers to reset call
        this first."""
        init_parameters(self, seed, self.init_rule())
        if self.args.tie_word_embeddings and self.tok_embeddings is None and self.output is not None:
            # a last pipeline stage's copy of the tied weight: drawn as the embedding it mirrors
            # (models/parallel/pipeline/tied.py keeps the two copies equal)
            fqn = "tok_embeddings.weight"
            rule = self.init_rule()(fqn, self.output, "weight")
            with torch.no_grad():
                write_full_into(self.output.weight, full_init_tensor(rule, self.output.weight.shape, seed, fqn))
        self.rope.reset_table()

    def moe_layers(self) -> list[nn.Module]:
        """The MoE modules of the layers this model (or pipeline stage) holds, in layer order;
        empty for a dense model."""
        return [block.moe for block in self.blocks() if block.moe_enabled]

    def active_params(self) -> int:
        """Parameters one token uses: all of them, less the routed experts a token does not
        visit (each MoE layer runs ``top_k`` of its ``num_experts``). Whole model expected
        (meta is fine)."""
        total = sum(p.numel() for p in self.parameters())
        moes = self.moe_layers()
        if not moes:
            return total
        routing = {(moe.top_k, moe.num_experts) for moe in moes}
        if len(routing) == 1:
            ((top_k, num_experts),) = routing
            routed = sum(p.numel() for moe in moes for p in moe.experts.parameters())
            return int(total - routed * (1 - top_k / num_experts))
        return int(
            total
            - sum(sum(p.numel() for p in moe.experts.parameters()) * (1 - moe.top_k / moe.num_experts) for moe in moes)
        )

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (``models/common/flops.py``) of this whole, unsharded
        model: its active parameters and the attention width its args declare."""
        return model_flops_per_token(
            self.active_params(),
            self.args.n_layers,
            self.args.attention_dim,
            seq_len,
            # the lookup costs no FLOPs, the head's matmul does: tied, the one [vocab, dim]
            # tensor counted in active_params is the head's
            0 if self.args.tie_word_embeddings else self.tok_embeddings.weight.numel(),
        )


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def moe_layers(model: Decoder) -> list[nn.Module]:
    """:meth:`Decoder.moe_layers` as a function."""
    return model.moe_layers()
