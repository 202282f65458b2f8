"""Block-causal attention (document masking, issue 26) proven on one process: the document
structure of packed rows (models/common/documents.py), both models against a run of each
document alone, independence of documents (logits and loss gradients), per-document RoPE
positions, the FlexAttention and varlen layouts against SDPA, activation checkpointing and
torch.compile. (Bad input through the CLI: test_document_masking_cli.py; layouts over several
processes: tests/distributed.)

Tolerances. Everything runs in float32 on CPU. Where two sides run the same kernels on the same
shapes the test asserts bitwise equality. Otherwise the two sides compute the same math through
differently shaped kernels (a document alone is a shorter row; another mask geometry puts a
document's queries in other tiles of the SDPA kernel; MoE groups tokens per expert), which
changes the summation order of GEMM and attention reductions: a few float32 ulps per layer.
Logits of these random-init 2-layer models are at most about 4 in magnitude (1 ulp ~ 4.8e-7);
the largest difference measured is 1.2e-6 (written next to each tolerance), so
``LOGIT_ATOL = 1e-5`` (about 20 ulps) leaves a margin of about 8 and stays four orders below
what the negative controls show (plain causal attention moves later documents' logits by
0.05-0.2). Gradients are at most about 0.2; measured differences are at most 1.5e-8, so
``GRAD_ATOL = 1e-6``; the causal controls move them by about 1e-2.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from models.common.attention import (
    AttentionCore,
    block_causal_mask,
    chunk_block_mask,
    varlen_attention,
    varlen_layout,
)
from models.common.documents import Documents, document_ids, document_stats, positions_in_document
from models.common.sequence import load_balanced_positions, load_balanced_shard
from models.parallel.activation_checkpoint import apply_activation_checkpointing
from models.parallel.context_parallel import load_balanced_causal_attention
from models.registry import build_model
from tests.distributed.inductor_probe import skip_without_flex_cpu, skip_without_inductor_cpu

MODELS = ["llama3", "deepseek_v3"]
EOS = 1
VOCAB = 256
MAX_SEQ = 64
LOGIT_ATOL = 1e-5
GRAD_ATOL = 1e-6


def _model(name: str, mask: str = "block_causal", positions: bool = False, n_layers: int = 2):
    """The debug flavor, small; the seeded init depends on parameter names only, so models that
    differ in attention settings have the same weights."""
    model = build_model(
        name, "debugmodel", device="cpu", eos_id=EOS, attn_mask_type=mask, document_positions=positions,
        vocab_size=VOCAB, max_seq_len=MAX_SEQ, n_layers=n_layers,
    )  # fmt: skip
    model.init_weights(0)
    return model


def _doc(n: int, seed: int) -> torch.Tensor:
    """``n`` token ids of one document (never EOS)."""
    return torch.randint(2, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


_EOS = torch.tensor([EOS])


# ------------------------------------------------------------------ 1. the document structure


@pytest.mark.parametrize(
    "row, ids, positions",
    [
        # two documents ended by EOS (the EOS belongs to the document it ends), then a third
        ([7, 1, 7, 7, 1, 7], [0, 0, 1, 1, 1, 2], [0, 1, 0, 1, 2, 0]),
        # the row starts in the middle of a document: its tail is document 0
        ([7, 7, 1, 7], [0, 0, 0, 1], [0, 1, 2, 0]),
        # consecutive EOS: the second one is a document of its own
        ([7, 1, 1, 7], [0, 0, 1, 2], [0, 1, 0, 0]),
        # a row that starts with EOS: the EOS ends document 0 (cut by the row edge)
        ([1, 7, 7], [0, 1, 1], [0, 0, 1]),
        # a row ending with EOS: no empty document after it
        ([7, 7, 1], [0, 0, 0], [0, 1, 2]),
        # no EOS: one document
        ([7, 7, 7, 7], [0, 0, 0, 0], [0, 1, 2, 3]),
    ],
)
def test_document_ids_and_positions(row, ids, positions):
    tokens = torch.tensor([row])
    got = document_ids(tokens, EOS)
    assert got.dtype == torch.int64 and got.tolist() == [ids]
    assert positions_in_document(got).tolist() == [positions]


def test_documents_per_row_and_stats():
    rows = torch.tensor([[7, 1, 7, 7, 1, 7], [7, 7, 7, 7, 7, 7], [1, 1, 1, 1, 1, 1]])
    ids = document_ids(rows, EOS)
    # rows are independent: each restarts at document 0
    assert ids.tolist() == [[0, 0, 1, 1, 1, 2], [0] * 6, [0, 1, 2, 3, 4, 5]]
    assert positions_in_document(ids).tolist() == [[0, 1, 0, 1, 2, 0], [0, 1, 2, 3, 4, 5], [0] * 6]
    # documents per row 3, 1, 6 -> mean 10/3; mean length 6 / (10/3)
    mean_len, per_row = document_stats(rows, EOS)
    assert per_row == pytest.approx(10 / 3, abs=1e-12) and mean_len == pytest.approx(1.8, abs=1e-12)
    assert document_stats(rows[:2], EOS) == (3.0, 2.0)
    # Documents.q_ids reads the global row at this rank's (load-balanced) positions
    q_pos = load_balanced_positions(6 * 2, 1, 2)  # [3, 4, 5, 6, 7, 8] of a 12-token row
    row = torch.tensor([[7, 7, 1, 7, 7, 7, 1, 1, 7, 7, 7, 7]])
    docs = Documents(ids=document_ids(row, EOS), q_positions=q_pos)
    assert q_pos.tolist() == [3, 4, 5, 6, 7, 8]
    assert docs.q_ids.tolist() == [[1, 1, 1, 1, 2, 3]]
    with pytest.raises(ValueError, match="integer token ids"):
        document_ids(rows.float(), EOS)


def test_block_causal_mask_by_hand_and_its_chunks():
    docs = Documents(ids=document_ids(torch.tensor([[7, 1, 7, 7, 1]]), EOS), q_positions=torch.arange(5))
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [0, 0, 1, 0, 0],
            [0, 0, 1, 1, 0],
            [0, 0, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    full = block_causal_mask(docs, 0, 5)
    assert full.shape == (1, 1, 5, 5) and torch.equal(full[0, 0], expected)
    # a query chunk against its key prefix is the same rows of the full mask
    assert torch.equal(block_causal_mask(docs, 2, 2)[0, 0], expected[2:4, :4])


# ------------------------------------------------------------------ 2. reference: documents alone


def _packed_docs() -> list[torch.Tensor]:
    """[doc A, EOS], [doc B, EOS], [doc C] (C is cut by the row end)."""
    return [torch.cat([_doc(10, 1), _EOS]), torch.cat([_doc(13, 2), _EOS]), _doc(9, 3)]


def _at_offset(model, offset: int):
    """Run ``model`` on a row placed at global positions ``offset ..`` (RoPE only: the shell reads
    the positions of its tokens from ``local_positions``)."""

    def positions(seqlen_local, device):
        return torch.arange(offset, offset + seqlen_local, device=device)

    model.local_positions = positions
    return model


@pytest.mark.parametrize("positions", [False, True], ids=["row_positions", "document_positions"])
@pytest.mark.parametrize("name", MODELS)
def test_block_causal_equals_each_document_alone(name, positions):
    """Each document of a packed row gets the logits it gets alone in its own row (same tokens,
    its EOS included). With document_positions the lone run uses positions 0.. like the packed
    one. Without, the lone document is run twice: at its original offset (the very same RoPE
    rows as in the packed row) and at positions 0..: RoPE makes q.k depend on the query-key
    offset only, so both match up to the rounding of different rotation angles. Measured max
    error 1.2e-6 (llama3) and 4.8e-7 (deepseek_v3), against LOGIT_ATOL 1e-5."""
    docs = _packed_docs()
    row = torch.cat(docs)[None]
    model = _model(name, positions=positions)
    causal = _model(name, mask="causal")
    with torch.no_grad():
        packed = model(row)[0]
        packed_causal = causal(row)[0]
        offset = 0
        for i, doc in enumerate(docs):
            span = slice(offset, offset + len(doc))
            alone = model(doc[None])[0]
            assert _max_err(packed[span], alone) <= LOGIT_ATOL, (i, _max_err(packed[span], alone))
            if not positions:
                placed = _at_offset(_model(name), offset)
                rope, _ = placed.attention_inputs(doc[None], len(doc), 1, doc.device)
                assert torch.equal(rope, placed.rope.table[offset : offset + len(doc)])  # really moved
                shifted = placed(doc[None])[0]
                assert _max_err(packed[span], shifted) <= LOGIT_ATOL, (i, _max_err(packed[span], shifted))
            if i > 0:
                # negative control: causal attention lets a later document see the earlier ones
                assert _max_err(packed_causal[span], alone) > 1000 * LOGIT_ATOL, i
            offset += len(doc)


# ------------------------------------------------------------------ 3. independence


def _doc_b_logits_and_grads(model, doc_a: torch.Tensor, doc_b: torch.Tensor):
    """Logits of doc B in the packed row [doc A, EOS, doc B] and the gradients of doc B's
    next-token loss with respect to every parameter."""
    row = torch.cat([doc_a, _EOS, doc_b])[None]
    start = len(doc_a) + 1
    model.zero_grad(set_to_none=True)
    logits = model(row)
    F.cross_entropy(logits[0, start:-1], row[0, start + 1 :]).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert all(g is not None for g in grads.values())
    return logits[0, start:].detach(), grads


def _grad_err(a: dict, b: dict) -> float:
    return max(_max_err(a[n], b[n]) for n in a)


@pytest.mark.parametrize("name", MODELS)
def test_replacing_doc_a_leaves_doc_b_unchanged(name):
    """Llama 3 is bitwise: the same kernels run on the same shapes, doc B's queries give doc A's
    keys a probability of exactly 0 (masked scores are -inf), so doc A's values enter doc B's
    outputs as exact zeros, and doc B's loss sends exactly zero gradient into doc A's rows,
    whose contributions to every weight gradient are then exact zeros too (x * 0 = 0 for finite
    x, added in the same order). DeepSeek-V3's MoE sorts tokens by expert: other doc A tokens
    change the grouped GEMMs' row counts and the order of the experts' gradient sums, so it is
    equal within tolerance (measured 2.4e-7 on logits, 1.5e-8 on gradients); its dense first
    layer alone (MLA attention) is bitwise like Llama."""
    doc_a, doc_a2, doc_b = _doc(12, 10), _doc(12, 11), _doc(15, 12)
    model = _model(name)
    logits, grads = _doc_b_logits_and_grads(model, doc_a, doc_b)
    logits2, grads2 = _doc_b_logits_and_grads(model, doc_a2, doc_b)
    if name == "llama3":
        assert torch.equal(logits, logits2)
        assert all(torch.equal(grads[n], grads2[n]) for n in grads), [
            n for n in grads if not torch.equal(grads[n], grads2[n])
        ]
    else:
        assert _max_err(logits, logits2) <= LOGIT_ATOL
        assert _grad_err(grads, grads2) <= GRAD_ATOL
        dense = _model(name, n_layers=1)  # n_dense_layers = 1: attention and a dense FFN only
        d_logits, d_grads = _doc_b_logits_and_grads(dense, doc_a, doc_b)
        d_logits2, d_grads2 = _doc_b_logits_and_grads(dense, doc_a2, doc_b)
        assert not dense.moe_layers()
        assert torch.equal(d_logits, d_logits2) and all(torch.equal(d_grads[n], d_grads2[n]) for n in d_grads)
    # negative control: with causal attention doc B reads doc A (measured 0.05-0.07 on logits,
    # 8e-3-1.3e-2 on gradients)
    causal = _model(name, mask="causal")
    c_logits, c_grads = _doc_b_logits_and_grads(causal, doc_a, doc_b)
    c_logits2, c_grads2 = _doc_b_logits_and_grads(causal, doc_a2, doc_b)
    assert _max_err(c_logits, c_logits2) > 1000 * LOGIT_ATOL
    assert _grad_err(c_grads, c_grads2) > 1000 * GRAD_ATOL


# ------------------------------------------------------------------ 4. per-document positions


def test_rope_rows_restart_at_each_document_start():
    """The RoPE rows every layer gets (Decoder.attention_inputs) are the table's rows at the
    in-document positions with document_positions, at the row positions without: exact (a row
    lookup)."""
    rows = torch.tensor([[7, 7, 1, 7, 7, 7, 1, 7], [1, 7, 7, 7, 7, 7, 7, 7]])
    expected = [[0, 1, 2, 0, 1, 2, 3, 0], [0, 0, 1, 2, 3, 4, 5, 6]]
    for name in MODELS:
        model = _model(name, positions=True)
        rope, mask = model.attention_inputs(rows, rows.size(1), rows.size(0), rows.device)
        assert torch.equal(rope, model.rope.table[torch.tensor(expected)])
        assert torch.equal(mask, block_causal_mask(Documents(document_ids(rows, EOS), torch.arange(8)), 0, 8))
        plain = _model(name)
        rope, _ = plain.attention_inputs(rows, rows.size(1), rows.size(0), rows.device)
        assert torch.equal(rope, plain.rope.table[:8])


@pytest.mark.parametrize("name", MODELS)
def test_document_positions_doc_b_same_wherever_it_sits(name):
    """Doc B's logits are the same whether doc B starts its row or follows doc A. With
    document_positions its RoPE rows are identical in both places; without, they are shifted by
    doc A's length, which RoPE's relative form cancels. Either way only the mask geometry (which
    SDPA tiles doc B's queries fall in) differs: tolerance (measured <= 1.2e-6)."""
    doc_a, doc_b = _doc(11, 20), _doc(14, 21)
    rows = torch.stack([torch.cat([doc_a, _EOS, doc_b]), torch.cat([doc_b, _EOS, doc_a])])
    start = len(doc_a) + 1
    with torch.no_grad():
        logits = {p: _model(name, positions=p)(rows) for p in (True, False)}
    for p, out in logits.items():
        assert _max_err(out[0, start:], out[1, : len(doc_b)]) <= LOGIT_ATOL, (
            p,
            _max_err(out[0, start:], out[1, : len(doc_b)]),
        )
    # both settings give the same logits for block_causal: inside one document every query-key
    # offset is the same under both numberings (they differ by a constant per document), and
    # RoPE scores depend on that offset only
    assert _max_err(logits[True], logits[False]) <= LOGIT_ATOL
    # negative control: with cross-document attention (cores switched to plain causal) the
    # offsets between documents differ between the numberings, and so do the logits (measured
    # 5.3e-3 on llama3: only what later documents read of earlier ones moves)
    switched = {}
    for p in (True, False):
        model = _model(name, positions=p)
        for block in model.layers.values():
            block.attention.core.mask_type = "causal"
        with torch.no_grad():
            switched[p] = model(rows)
    assert _max_err(switched[True], switched[False]) > 100 * LOGIT_ATOL


# ------------------------------------------------------------------ 5. FlexAttention on CPU


def _qkv_and_docs(s: int):
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(2, 50, (2, s), generator=gen)
    tokens[0, [5, 17, 18, 26]] = EOS  # short documents, consecutive EOS
    tokens[1, [12]] = EOS
    q, k, v = (torch.randn(2, 2, s, 16, generator=gen) for _ in range(3))
    return q, k, v, Documents(ids=document_ids(tokens, EOS), q_positions=torch.arange(s))


# The compiled tests skip where inductor cannot build what they need on this machine, with the
# reason (tests/distributed/inductor_probe.py): e.g. under ATEN_CPU_CAPABILITY=default (the
# kernel lane's setting), where torch 2.13's FlexAttention CPU lowering refuses to run.


def test_flex_matches_sdpa_forward_on_cpu():
    """FlexAttention (compiled; torch 2.13 runs its forward on CPU, not its backward) against the
    SDPA reference, on a whole row (AttentionCore) and on the context-parallel chunk path of cp
    rank 1 of 2 (both chunks start mid-row; masks built like ContextParallelAttentionCore.prepare
    does) against SDPA block-causal over the whole row, sharded. Different kernels: tolerance
    1e-5 on outputs of magnitude ~3 (measured 0 on the row, 4.8e-7 on the chunks). Cost: three
    flex compilations, ~25 s on a cold inductor cache."""
    skip_without_flex_cpu()
    s, cp, rank = 32, 2, 1
    q, k, v, docs = _qkv_and_docs(s)
    t0 = time.perf_counter()
    with torch.no_grad():
        sdpa = AttentionCore("block_causal", "sdpa")
        ref = sdpa(q, k, v, sdpa.prepare(docs, 2, s, q.device))
        flex = AttentionCore("block_causal", "flex")
        out = flex(q, k, v, flex.prepare(docs, 2, s, q.device))
        assert _max_err(out, ref) <= LOGIT_ATOL
        causal = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert _max_err(out, causal) > 1000 * LOGIT_ATOL  # negative control: the masks differ

        # the next micro-batch (other documents, same shapes) reuses the compiled kernel: the
        # BlockMask and the document ids its mask_mod reads are graph inputs, not constants, so
        # training does not recompile flex every step (on a GPU: minutes, then dynamo's
        # recompile limit and an eager fallback that materializes every score). The counter does
        # catch it: a mask_mod closing over a Python int per micro-batch recompiles (measured:
        # unique_graphs 1 -> 2)
        graphs = counters["stats"]["unique_graphs"]
        other = (torch.arange(s) // 7).expand(2, s).contiguous()  # documents of 7 tokens
        docs2 = Documents(ids=other, q_positions=docs.q_positions)
        assert not torch.equal(docs2.ids, docs.ids)
        out2 = flex(q, k, v, flex.prepare(docs2, 2, s, q.device))
        assert counters["stats"]["unique_graphs"] == graphs, "flex recompiled for new documents"
        assert _max_err(out2, sdpa(q, k, v, sdpa.prepare(docs2, 2, s, q.device))) <= LOGIT_ATOL
        assert _max_err(out2, out) > 1000 * LOGIT_ATOL  # the new documents did change the mask

        c = s // (2 * cp)
        starts = (rank * c, (2 * cp - 1 - rank) * c)
        q_local = load_balanced_shard(q, 2, rank, cp)
        masks = tuple(chunk_block_mask(docs, start, c, 2, q.device) for start in starts)
        chunks = load_balanced_causal_attention(q_local, k, v, rank, cp, masks=masks, attn_type="flex")
        expected = load_balanced_shard(ref, 2, rank, cp)
        assert _max_err(chunks, expected) <= LOGIT_ATOL
        assert _max_err(chunks, load_balanced_shard(causal, 2, rank, cp)) > 1000 * LOGIT_ATOL
        # the SDPA chunk path with the boolean chunk masks agrees too
        bool_masks = tuple(block_causal_mask(docs, start, c) for start in starts)
        sdpa_chunks = load_balanced_causal_attention(q_local, k, v, rank, cp, masks=bool_masks)
        assert _max_err(sdpa_chunks, expected) <= LOGIT_ATOL
    print(f"flex on CPU: {time.perf_counter() - t0:.1f}s")


# ------------------------------------------------------------------ 6. varlen layout


def _reference_varlen(q, k, v, cu, cu_k, max_q, max_k, *, scale, window_size):
    """What torch's varlen_attn computes, written out: ``q, k, v`` are ``[tokens, heads, d]``,
    sequence ``i`` is tokens ``cu[i]:cu[i+1]``, causal inside it (window (-1, 0))."""
    assert window_size == (-1, 0) and torch.equal(cu, cu_k) and max_q == max_k
    out = torch.empty(q.size(0), q.size(1), v.size(-1))
    bounds = cu.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        assert 0 < b - a <= max_q

        def seq(t, a=a, b=b):
            return t[a:b].transpose(0, 1)[None]

        o = F.scaled_dot_product_attention(seq(q), seq(k), seq(v), is_causal=True, scale=scale)
        out[a:b] = o[0].transpose(0, 1)
    return out


def test_varlen_layout_and_attention_equal_sdpa_block_causal():
    rows = torch.tensor([[7, 1, 7, 7, 1, 7, 7, 7], [7, 7, 7, 7, 7, 7, 7, 1]])
    layout = varlen_layout(Documents(document_ids(rows, EOS), torch.arange(8)))
    # documents of lengths 2, 3, 3 in row 0 and one of 8 in row 1, in flattened token order
    assert layout.cu_seqlens.dtype == torch.int32 and layout.cu_seqlens.tolist() == [0, 2, 5, 8, 16]
    assert layout.max_len == 8

    s = 32
    q, k, v, docs = _qkv_and_docs(s)
    layout = varlen_layout(docs)
    out = varlen_attention(q, k, v, layout, scale=0.3, kernel=_reference_varlen)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=block_causal_mask(docs, 0, s), scale=0.3)
    # per-document SDPA calls against one masked call: other shapes, tolerance (measured below 1e-6)
    assert _max_err(out, ref) <= LOGIT_ATOL
    causal = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)
    assert _max_err(out, causal) > 1000 * LOGIT_ATOL  # negative control


# ------------------------------------------------------------------ 7. AC and compile


def _packed_batch() -> torch.Tensor:
    rows = torch.randint(2, VOCAB, (2, 32), generator=torch.Generator().manual_seed(30))
    rows[0, [7, 19]] = EOS
    rows[1, [11]] = EOS
    return rows


def _loss_and_grads(model, rows):
    logits = model(rows)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), rows[:, 1:].flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("name", MODELS)
def test_activation_checkpointing_block_causal_is_bitwise(name, mode, monkeypatch):
    """Checkpointing recomputes each block's forward with the same kernels on the same shapes
    (the mask is an input of the block, not rebuilt), so loss and gradients are bitwise those of
    the run without it; and the mask is built once per micro-batch, not per layer nor again in
    the recomputation."""
    rows = _packed_batch()
    loss, grads = _loss_and_grads(_model(name), rows)
    model = _model(name)
    apply_activation_checkpointing(model, mode, "op")
    import models.common.attention as attention

    built = []
    real = attention.block_causal_mask
    monkeypatch.setattr(attention, "block_causal_mask", lambda *a: built.append(1) or real(*a))
    ac_loss, ac_grads = _loss_and_grads(model, rows)
    assert len(built) == 1
    assert torch.equal(loss, ac_loss)
    assert all(torch.equal(grads[n], ac_grads[n]) for n in grads)


def test_compiled_blocks_block_causal_match_eager():
    """torch.compile per block, as models/parallelize.py does, on a one-layer Llama 3 with
    block_causal: forward and backward. Inductor fuses the elementwise ops (norms, RoPE, SiLU)
    and reorders their reductions: tolerance (measured 0 on the loss, 7.5e-9 on gradients of
    magnitude ~0.09). ~16 s on a cold inductor cache; one case only."""
    skip_without_inductor_cpu()
    rows = _packed_batch()
    loss, grads = _loss_and_grads(_model("llama3", n_layers=1), rows)
    model = _model("llama3", n_layers=1)
    for block in model.layers.values():
        block.compile()
    c_loss, c_grads = _loss_and_grads(model, rows)
    assert _max_err(loss, c_loss) <= LOGIT_ATOL
    assert _grad_err(grads, c_grads) <= GRAD_ATOL
    # negative control: the same compiled model's causal twin (same weights) differs
    causal_loss, _ = _loss_and_grads(_model("llama3", mask="causal", n_layers=1), rows)
    assert _max_err(causal_loss, c_loss) > 10 * LOGIT_ATOL
