"""LoRA composes with activation checkpointing (selective per-op and full) and with compile.

One process, the LoRA debug models (every attention and feed-forward projection adapted; on
DeepSeek-V3 the routed experts too, one adapter pair per expert), ``lora_b`` drawn non-zero so that
every ``A`` has a gradient. Reference: the eager model without AC. Each case applies AC as the
trainer does (``models/parallel/activation_checkpoint.py``), then compiles every block with
``fullgraph=True`` as ``models/parallelize.py`` does, and runs one forward + backward:

* AC alone (eager) gives bitwise the reference's loss and adapter gradients: the recomputed
  forward runs the same kernels on the same inputs;
* compiled (``aot_eager``, as tests/unit/test_compile_blocks.py: dynamo and AOTAutograd trace the
  block, the ATen graph runs eager kernels, no C++ compiler) each adapted block is ONE graph with
  no graph break (the adapters' forward hooks and the experts' merge are traced, not skipped),
  and the loss and every adapter gradient equal the reference's within the dtype's tolerance:
  fp32 (Llama 3) 1e-5 relative + 1e-7 absolute, a few roundings where AOTAutograd's
  decompositions reassociate; bf16 (DeepSeek-V3: ``torch._grouped_mm``'s meta kernel, which tracing
  runs, takes only bf16) 1.6e-2 relative + 1e-2 absolute, as tests/unit/test_compile_blocks.py;
* negative control: the same comparison against the model with its adapters' scale changed
  (``lora.alpha`` 16 -> 8) fails, so the tolerance would see an adapter the graph dropped or
  mis-scaled.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.backends.registry import lookup_backend
from torch._dynamo.utils import counters

from models.parallel.activation_checkpoint import apply_activation_checkpointing
from models.parallel.lora import LoRAOptions, convert_to_lora, is_adapter_key
from models.registry import build_model

pytestmark = pytest.mark.unit

SEQ, BATCH, VOCAB = 16, 2, 64
AC = {"selective-op": ("selective", "op"), "full": ("full", "op")}
CASES = {  # name -> (model, LoRA options, dtype)
    "llama3": ("llama3", LoRAOptions(rank=4), torch.float32),
    "deepseek_v3-expert-adapters": ("deepseek_v3", LoRAOptions(rank=4, experts=True), torch.bfloat16),
}
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-7), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}


def _model(name: str, ac: str | None, alpha: float = 16.0):
    model_name, opts, dtype = CASES[name]
    torch.manual_seed(0)
    model = build_model(model_name, "debugmodel", device="cpu", n_layers=2, vocab_size=VOCAB, max_seq_len=SEQ)
    convert_to_lora(model, opts)
    model.init_weights(0)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("lora_b"):  # PEFT's init is B = 0: A would get no gradient
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
        for mod in model.modules():
            if hasattr(mod, "lora_scale"):
                mod.lora_scale = alpha / opts.rank
    model.to(dtype)
    for moe in model.moe_layers():  # as FSDP2's mixed precision: buffers stay float32
        for buf in ("tokens_per_expert", "expert_bias"):
            setattr(moe, buf, getattr(moe, buf).float())
    if ac is not None:
        apply_activation_checkpointing(model, *AC[ac])
    return model


def _step(model) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    loss = F.cross_entropy(model(tokens).float().flatten(0, 1), tokens.flatten())
    loss.backward()
    grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
    assert grads and all(is_adapter_key(n) for n in grads), sorted(grads)
    return loss.detach(), grads


class _CountingBackend:
    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []
        self._inner = lookup_backend("aot_eager")

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return self._inner(gm, example_inputs)


def _close(got, want, tol) -> bool:
    (loss, grads), (ref_loss, ref_grads) = got, want
    return (
        grads.keys() == ref_grads.keys()
        and torch.allclose(loss, ref_loss, **tol)
        and all(torch.allclose(grads[n], ref_grads[n], **tol) for n in grads)
    )


@pytest.fixture(scope="module")
def references() -> dict:
    return {name: _step(_model(name, None)) for name in CASES}


@pytest.mark.parametrize("ac", list(AC))
@pytest.mark.parametrize("name", list(CASES))
def test_lora_with_ac_and_compile_matches_eager(name, ac, references):
    ref_loss, ref_grads = references[name]
    n_adapters = sum(1 for n, _ in _model(name, None).named_parameters() if is_adapter_key(n))
    assert len(ref_grads) == n_adapters and all(g.abs().sum() > 0 for g in ref_grads.values())

    loss, grads = _step(_model(name, ac))  # AC, eager: the same kernels again
    assert torch.equal(loss, ref_loss) and grads.keys() == ref_grads.keys()
    assert all(torch.equal(grads[n], ref_grads[n]) for n in grads), [
        n for n in grads if not torch.equal(grads[n], ref_grads[n])
    ]

    model = _model(name, ac)
    torch._dynamo.reset()
    counters.clear()
    backend = _CountingBackend()
    for block in model.layers.values():
        block.compile(backend=backend, fullgraph=True)
    try:
        compiled = _step(model)
        assert dict(counters["graph_break"]) == {}, dict(counters["graph_break"])
        assert len(backend.graphs) == len(model.layers), [g.code for g in backend.graphs]
    finally:
        torch._dynamo.reset()
    tol = TOL[CASES[name][2]]
    assert _close(compiled, references[name], tol)
    # negative control: another adapter scale is outside the tolerance
    assert not _close(compiled, _step(_model(name, None, alpha=8.0)), tol)
