"""The planner's ``--fit`` prices (tools/planner/fit.py) against the memory options' own
functions, which their tests measure exact (issue 53):

- chunked loss: what the fit takes off the loss phase (tools/planner/phases.py: the start of
  the loss backward, where the plain path holds the logits, the float32 log-softmax and the
  loss's two float32 gradients, ``12 + a`` bytes per ``[tokens, vocab / tp]`` element) is the
  option's own ``chunked_loss_saving_bytes`` (models/common/chunked_loss.py) less two things
  that function leaves out of the chunked path, read off ``_ChunkedHeadCE.backward``: the
  input gradient it allocates before the loop (``a rows dim``) and, below float32, what the
  weight-gradient step holds beyond the chunk's buffers when that is more (the chunk's cast
  gradient, the ``[v, dim]`` product and its float32 copy; at the end the accumulator's
  cast: ``tools.planner.fit.chunked_head_bytes``). The function's plain side counts the head weight's gradient
  (``a v dim``), which the plain path makes only in the head's backward, after the peak, and its
  chunked side a float32 weight gradient of ``(4 + a) v dim``, which in float32 is one tensor
  (``grad_w.to(float32)`` is ``grad_w``): the two differ by the same ``4 v dim`` and cancel.
  Exact, over llama3 debugmodel on one rank, tp=2, fsdp=2, cp=2 and the last stage of pp=2
  (1F1B, 2 micro-batches), float32 and bf16, MTP (deepseek_v3 debugmodel, one depth: the head
  runs on 2 t rows), and a chunk larger than the micro-batch. Negative control: the fit's first
  formula, ``(a + 4) (t - min(C, t)) v``, misses the weight gradient's float32 accumulator.
  The whole-step saving (peak without - peak with) is the census's in benchmarks/memory_options.py
  (tests/unit/test_memory_options_bench.py).
- activation offload under full AC: what the fit takes off the blocks' activations is the option's ``block_input_bytes`` of the
  rank's blocks (models/parallel/activation_offload.py, what the hooks move and the e2e test
  counts), all of it at the loss backward, and in the blocks' backward all but one block's
  worth, the block whose saved tensors came back for its backward; the RoPE rows
  (``attention_input_bytes``, offloaded once per forward) are not in the planner's estimate and
  not in its saving. Exact on one rank, tp=2 with sequence parallelism, cp=2, in bf16 and
  float32. Negative control: the former rule (two blocks kept in both phases) is not it.
- bf16 optimizer state and CPU offload: one rank of dp_shard=3 (FSDP2 pads dim 0) and of
  tp=2 x dp_shard=2, the model parallelized by the real code on the meta device under the fake
  backend (in one forked process, tools/forkserver.py): the planner's ``optimizer / 2`` equals
  ``state_dtype_saving`` (trainer/optim/low_precision.py, what the start-up line says) and its
  params / grads / optimizer equal ``cpu_offload_bytes`` with the trainer's ``state_bytes_fn``, to the
  byte, for AdamW and for Muon (one momentum buffer for the hidden matrices); with the option
  the optimizer step's phase falls by all of them and the loss phase by the parameters and
  the state (no gradient exists at the loss backward of a step's only micro-batch), and the
  peak by between the two. Negative control:
  ``cpu_offload_bytes`` by optimizer name, the old Muon bound (8 bytes per element), is above
  the planner's Muon state.
"""

from __future__ import annotations

import dataclasses

import pytest

pytestmark = pytest.mark.unit

CHUNK_CASES = [  # (model, degrees, choice overrides, chunk)
    ("llama3", {}, {}, 32),
    ("llama3", {}, {"param_dtype": "float32"}, 32),
    ("llama3", {"tp": 2}, {}, 48),
    ("llama3", {"dp_shard": 2}, {"param_dtype": "float32"}, 32),
    ("llama3", {"cp": 2}, {}, 16),
    ("llama3", {"pp": 2}, {"schedule": "1F1B", "n_microbatches": 2}, 32),
    ("llama3", {}, {}, 4096),  # the chunk holds the whole micro-batch
    ("deepseek_v3", {}, {}, 32),
]


def _job(model: str, world: int, optimizer: str = "AdamW"):
    from tools.planner.estimate import Job
    from tools.planner.hardware import load_hardware

    return Job(model, "debugmodel", world, world, 128, 4, load_hardware("h100"), optimizer=optimizer)


@pytest.mark.parametrize("case", CHUNK_CASES, ids=lambda c: f"{c[0]}-{c[1]}-{c[2].get('param_dtype', 'bf16')}-{c[3]}")
def test_fit_chunked_loss_saving_is_the_options_own(case):
    from models.common.chunked_loss import chunked_loss_saving_bytes
    from parallel_dims.layout import validate_degrees
    from tools.planner.activations import head_bytes
    from tools.planner.choice import DTYPE_BYTES, LayoutChoice
    from tools.planner.fit import option_parts
    from tools.planner.inventory import model_inventory
    from tools.planner.phases import peak

    model, degrees, over, chunk = case
    world = 1
    for v in degrees.values():
        world *= v
    d = validate_degrees(world_size=world, **degrees)
    c = LayoutChoice(global_batch=4, local_batch=2 * (2 if d.pp > 1 else 1), seq_len=128, **over)
    job = _job(model, world)
    rank = (d.pp - 1) * (world // d.pp)  # the rank with the head
    _, args = model_inventory(model, "debugmodel")
    a = DTYPE_BYTES[c.param_dtype]
    mb = c.local_batch // (c.n_microbatches if d.pp > 1 else 1)
    plain = option_parts(job, d, c, rank, (), chunk)
    on = option_parts(job, d, c, rank, ("loss_chunk_tokens",), chunk)
    fit = (plain.head + plain.loss_grads) - (on.head + on.loss_grads)  # the loss phase's head and loss bytes
    assert peak(plain)["phase_loss"] - peak(on)["phase_loss"] == fit  # nothing else in that phase moves

    t = mb * (128 // d.cp)
    rows = t * (1 + getattr(args, "mtp_layers", 0))
    v = args.vocab_size // d.tp
    no_vocab = dataclasses.replace(args, vocab_size=0)
    sp = c.sequence_parallel
    held = head_bytes(args, mb, 128, d.tp, d.cp, sp, a) - head_bytes(no_vocab, mb, 128, d.tp, d.cp, sp, a)
    assert held == (a + 4) * rows * v  # the planner's plain logits + log-softmax
    assert plain.loss_grads == 8 * rows * v  # + the loss backward's two float32 gradients: 12 + a in all
    option = chunked_loss_saving_bytes(rows, args.vocab_size, args.dim, chunk, tp=d.tp, compute_bytes=a)
    low, c_rows, dim = (a if a != 4 else 0), min(chunk, rows), args.dim
    # what the option's function leaves out: the input gradient; below float32 what the
    # weight-gradient step's casts hold beyond the chunk's buffers when that is more
    casts = max(low * c_rows * v + (low + 4) * v * dim, low * v * dim) - (4 + low) * c_rows * v
    left_out = a * rows * dim + (max(casts, 0) if low else 0)
    assert option > 0 and fit == option - left_out, (fit, option, left_out)
    assert fit != (a + 4) * (rows - min(chunk, rows)) * v  # negative control: the former formula


@pytest.mark.parametrize("degrees", [{}, {"tp": 2}, {"cp": 2}], ids=str)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_fit_activation_offload_saving_is_the_options_own(degrees, dtype):
    from models.parallel.activation_offload import block_input_bytes
    from parallel_dims.layout import validate_degrees
    from tools.planner.choice import DTYPE_BYTES, LayoutChoice
    from tools.planner.fit import option_parts
    from tools.planner.inventory import model_inventory

    world = 1
    for v in degrees.values():
        world *= v
    d = validate_degrees(world_size=world, **degrees)
    c = LayoutChoice(global_batch=2, local_batch=2, seq_len=128, ac="full", param_dtype=dtype)
    job = _job("llama3", world)
    _, args = model_inventory("llama3", "debugmodel")
    on = option_parts(job, d, c, 0, ("activation_offload",), 32)
    held = option_parts(job, d, c, 0, (), 32).layers
    fit_loss, fit_backward = held - on.layers, held - on.layers_backward

    def moved(n: int) -> int:
        return block_input_bytes(n, 2, 128, args.dim, cp=d.cp, tp=d.tp, sp=c.sequence_parallel, a=DTYPE_BYTES[dtype])

    assert fit_loss == moved(args.n_layers) > 0, (fit_loss, moved(args.n_layers))
    assert fit_backward == moved(args.n_layers) - moved(1) > 0, (fit_backward, moved(args.n_layers))
    # negative control: the former rule, two blocks' worth kept on the device in every phase
    assert fit_loss != moved(args.n_layers) - moved(2) and fit_backward != moved(args.n_layers) - moved(2)


def rank_option_bytes(degrees: dict, rank: int) -> dict:
    """One rank of ``degrees`` (llama3 debugmodel parallelized on the meta device, fake
    backend): per optimizer, ``cpu_offload_bytes`` by config and by name, and
    ``state_dtype_saving``."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from models.parallel.offload import cpu_offload_bytes
    from models.parallelize import ParallelizeOptions
    from models.registry import build_model, get_model_spec
    from parallel_dims import ParallelDims
    from parallel_dims.process_groups import register_fake_backend
    from trainer.config import Optimizer
    from trainer.optim.low_precision import state_bytes_fn, state_dtype_saving

    register_fake_backend()
    pd = ParallelDims(**degrees)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=pd.world_size)
    try:
        pd.build_mesh("cpu")
        part = build_model("llama3", "debugmodel", device="meta")
        get_model_spec("llama3", "debugmodel").parallelize_fn(part, pd, ParallelizeOptions(param_dtype="float32"))
        out = {}
        for optimizer in ("AdamW", "Muon"):
            cfg = Optimizer(name=optimizer, state_dtype="bfloat16")
            out[optimizer] = {
                "offload": cpu_offload_bytes([part], state_bytes_fn(cfg, "float32")),
                "offload_by_name": cpu_offload_bytes([part], optimizer),
                "bf16_saving": state_dtype_saving([part], cfg),
            }
        return out
    finally:
        dist.destroy_process_group()


def test_fit_state_and_offload_prices_are_the_options_own():
    from parallel_dims.layout import validate_degrees
    from tests.distributed.run_json import run_on_own_process
    from tools.planner.choice import LayoutChoice
    from tools.planner.estimate import memory_for_rank
    from tools.planner.fit import option_memory, option_parts

    cases = [({"dp_shard": 3, "world_size": 3}, 2), ({"dp_shard": 2, "tp": 2, "world_size": 4}, 3)]
    for degrees, rank in cases:
        d = validate_degrees(**degrees)
        c = LayoutChoice(global_batch=4, local_batch=4 // d.dp_shard if d.dp_shard < 4 else 1, seq_len=128)
        c = dataclasses.replace(c, global_batch=c.local_batch * d.dp_shard)
        both = run_on_own_process(f"{__name__}:rank_option_bytes", degrees, rank)
        for optimizer, got in both.items():
            job = _job("llama3", d.world_size, optimizer)
            parts = option_parts(job, d, c, rank, (), 32)
            half = option_parts(job, d, c, rank, ("state_dtype",), 32)
            where = (degrees, rank, optimizer)
            assert parts.optimizer - half.optimizer == got["bf16_saving"], (where, parts, got)
            off = got["offload"]
            assert (parts.params, parts.grads, parts.optimizer) == (off["params"], off["grads"], off["optimizer"]), (
                where,
                parts,
                off,
            )
            mem, gone = memory_for_rank(job, d, c, rank), option_memory(job, d, c, rank, ("cpu_offload",), 32)
            assert mem["phase_optimizer"] - gone["phase_optimizer"] == off["total"], where
            assert mem["phase_loss"] - gone["phase_loss"] == off["params"] + off["optimizer"], where
            assert off["params"] + off["optimizer"] <= mem["total"] - gone["total"] <= off["total"], where
            if optimizer == "Muon":  # negative control: the name-only bound overcounts Muon's state
                assert got["offload_by_name"]["optimizer"] > parts.optimizer, where


def test_phases_place_the_gradients_where_the_trainer_has_them():
    """tools/planner/phases.py on llama3 debugmodel, rank 0 of fsdp=2: with one micro-batch per
    step the loss backward holds no gradient (``zero_grad(set_to_none=True)``), the optimizer
    step holds parameters + gradients + state and nothing else, and the peak is the largest
    phase; with two micro-batches (accumulation) the second loss backward also holds the first's
    gradients, FSDP2's unsharded float32 accumulators of every group (``set_requires_gradient_sync``
    defers the reduce-scatter), and nothing else changes in that phase. Negative control: the
    additive sum of the kinds is above the phase peak."""
    from parallel_dims.layout import validate_degrees
    from tools.planner.choice import LayoutChoice
    from tools.planner.phases import PHASES, peak
    from tools.planner.rank_memory import memory_parts, rank_context

    d = validate_degrees(world_size=2, dp_shard=2)
    job = _job("llama3", 2)
    one = LayoutChoice(global_batch=4, local_batch=2, seq_len=128)
    two = LayoutChoice(global_batch=8, local_batch=2, seq_len=128)
    p1 = memory_parts(job, d, one, rank_context(job, d, one, 0))
    p2 = memory_parts(job, d, two, rank_context(job, d, two, 0))
    m1, m2 = peak(p1), peak(p2)
    assert p1.accumulated == 0 and p2.accumulated_unsharded
    ctx = rank_context(job, d, two, 0)
    assert p2.accumulated == 4 * ctx.unsharded[0]  # every group's gathered elements, float32 (reduce dtype)
    assert m1["phase_optimizer"] == p1.params + p1.grads + p1.optimizer
    assert m1["total"] == max(m1[f"phase_{p}"] for p in PHASES)
    if m1["peak_phase"] == 0:
        assert m1["grads"] == 0 and m1["unsharded_grads"] == 0
    assert m2["phase_loss"] - m1["phase_loss"] == p2.accumulated
    additive = (
        p1.params + p1.grads + p1.optimizer + p1.gathered_loss + p1.unsharded_start + p1.layers + p1.head
        + p1.loss_grads + p1.recompute
    )  # fmt: skip
    assert additive > m1["total"]
