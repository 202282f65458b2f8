"""Every kind of transformer block compiles into one graph with ``fullgraph=True`` under both
activation-checkpointing modes the trainer offers per block, and the compiled block computes what
the eager block computes.

Cases: the Llama 3 dense block, the DeepSeek-V3 dense block (layer 0) and the DeepSeek-V3 MoE
block (layer 1: grouped-GEMM experts, the routing-count buffer and the sequence-wise aux loss all
on), each in bfloat16 (as on a GPU: ``torch._grouped_mm``'s meta kernel, which tracing runs,
takes only bf16) under per-op selective AC and full AC, applied by
``models/parallel/activation_checkpoint.py`` and compiled per block with ``block.compile(...)``
exactly as ``models/parallelize.py`` does. One forward and backward per case.

Why it matters: a graph break inside a checkpointed block makes dynamo give up on the
activation-checkpoint higher-order op and run that block's checkpoint eagerly (torch 2.11 did so
for the MoE block while ``MoE.forward`` stored ``self.aux_loss_sum``: a side effect in the
checkpointed body). ``fullgraph=True`` turns any break into an error; a counting backend checks
that dynamo handed over exactly one graph per case and ``counters["graph_break"]`` stays empty.

The backend is ``aot_eager``: dynamo and AOTAutograd trace the block (where graph breaks and
side-effect refusals happen) and the captured ATen graph runs with the eager kernels, so no C++
compiler is needed (no inductor probe, tests/distributed/inductor_probe.py) and a case costs
about a second on 2 cores. The smallest debug shapes suffice: what breaks graphs is the code
path (AC wrapper, router, dispatch, grouped GEMM, combine, aux loss), not the sizes.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.backends.registry import lookup_backend
from torch._dynamo.utils import counters

from models.parallel.activation_checkpoint import apply_activation_checkpointing
from models.registry import build_model

SEQ, BATCH, VOCAB = 16, 2, 64
# (activation_checkpoint.mode, selective_ac_option) as the trainer passes them
AC = {"selective-op": ("selective", "op"), "full": ("full", "op")}
# name -> (model, layer index, overrides): the DeepSeek debug model's layer 0 is dense, layer 1 MoE
BLOCKS = {
    "llama3-dense": ("llama3", 0, {}),
    "deepseek_v3-dense": ("deepseek_v3", 0, {}),
    "deepseek_v3-moe": ("deepseek_v3", 1, {"aux_loss_coeff": 0.01}),
}


class _CountingBackend:
    """``aot_eager`` that records each graph dynamo hands it."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []
        self._inner = lookup_backend("aot_eager")

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return self._inner(gm, example_inputs)


def _block_and_inputs(name: str, ac: str):
    model_name, layer, overrides = BLOCKS[name]
    torch.manual_seed(0)
    model = build_model(
        model_name, "debugmodel", device="cpu", n_layers=2, vocab_size=VOCAB, max_seq_len=SEQ, **overrides
    )
    model.init_weights(0)
    model.to(torch.bfloat16)
    for moe in model.moe_layers():  # FSDP2's mixed precision casts parameters only: buffers stay float32
        for buf in ("tokens_per_expert", "expert_bias"):
            setattr(moe, buf, getattr(moe, buf).float())
    apply_activation_checkpointing(model, *AC[ac])
    block = model.layers[str(layer)]
    assert block.moe_enabled == name.endswith("moe")
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    rope, mask = model.attention_inputs(tokens, SEQ, BATCH, tokens.device)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(BATCH, SEQ, model.args.dim, generator=gen).bfloat16()
    cotangent = torch.randn(BATCH, SEQ, model.args.dim, generator=gen)
    return block, (x, rope, mask), cotangent


def _fwd_bwd(block, inputs, cotangent):
    x, rope, mask = inputs
    x = x.detach().requires_grad_(True)
    block.zero_grad(set_to_none=True)
    out = block(x, rope, mask)
    (out.float() * cotangent).sum().backward()
    grads = {n: p.grad.float().clone() for n, p in block.named_parameters() if p.grad is not None}
    return out.detach().float(), x.grad.float(), grads


@pytest.mark.parametrize("ac", list(AC))
@pytest.mark.parametrize("name", list(BLOCKS))
def test_block_compiles_to_one_graph(name, ac):
    """Compiles with ``fullgraph=True`` (any graph break raises), dynamo hands over one graph
    and records no graph break, and the compiled forward output, input gradient and every
    parameter gradient equal eager's within bf16's tolerance (aot_eager runs the same ATen
    kernels; only AOTAutograd's decompositions and op order may differ, by a rounding or two
    of bf16's 8-bit significand)."""
    if name.endswith("moe") and not hasattr(torch, "_grouped_mm"):
        pytest.skip(f"torch {torch.__version__} has no torch._grouped_mm")
    block, inputs, cotangent = _block_and_inputs(name, ac)
    ref_out, ref_dx, ref_grads = _fwd_bwd(block, inputs, cotangent)
    if block.moe_enabled:
        counts_after_eager = block.moe.tokens_per_expert.clone()

    torch._dynamo.reset()
    counters.clear()
    backend = _CountingBackend()
    block.compile(backend=backend, fullgraph=True)
    try:
        out, dx, grads = _fwd_bwd(block, inputs, cotangent)
    finally:
        torch._dynamo.reset()
    assert dict(counters["graph_break"]) == {}, dict(counters["graph_break"])
    assert len(backend.graphs) == 1, [g.code for g in backend.graphs]

    tol = dict(rtol=1.6e-2, atol=1e-2)  # bf16: 2^-6 relative, plus an absolute floor near zero
    torch.testing.assert_close(out, ref_out, **tol)
    torch.testing.assert_close(dx, ref_dx, **tol)
    assert grads.keys() == ref_grads.keys() and len(grads) == sum(1 for _ in block.parameters())
    for n in grads:
        torch.testing.assert_close(grads[n], ref_grads[n], **tol, msg=lambda m, n=n: f"{n}: {m}")
    if block.moe_enabled:
        # the compiled forward counted its tokens once more, exactly as the eager one did
        torch.testing.assert_close(block.moe.tokens_per_expert, 2 * counts_after_eager, rtol=0, atol=0)
