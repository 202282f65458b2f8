"""``--fit``: the cheapest combination of a layout (degrees, batch split, schedule, AC, reshard)
and the memory options that fits the GPU.

The options and the config fields that turn them on (issue 53):

* chunked cross-entropy, ``training.loss_chunk_tokens = C``: the head and the loss run C
  tokens at a time, so at the loss backward's start, of the logits (compute dtype), their fp32
  log-softmax (``(a + 4) t v`` bytes per micro-batch held, ``t`` tokens on a rank with ``v``
  vocabulary columns) and the loss's two fp32 gradients (``8 t v``), what stays is the chunked
  head's backward (:func:`chunked_head_bytes`: one chunk's buffer, the weight gradient's float32
  accumulator, the input gradient), and the trainer holds no logits through the backward:
  :func:`chunked_loss_saving`, checked against the option's own ``chunked_loss_saving_bytes``;
  cost: the head's forward matmul once more per chunk in the backward (``2 t dim v`` FLOPs per
  pass, times 1 + the MTP depths);
* CPU offload, ``training.cpu_offload = true`` (FSDP2's CPUOffloadPolicy): the fp32 parameter
  shards, their gradients and the optimizer state live on the host (0 GPU bytes in every
  phase that holds them; the gradients exist only from the backward on); cost: every
  FSDP unshard copies the rank's fp32 shards host-to-device (4 bytes per padded element per
  gather), every gradient reduction copies them back (4 bytes each), over the host link, counted
  exposed; the optimizer step runs on the CPU at the host memory bandwidth instead of the GPU's;
* activation offload, ``activation_checkpoint.offload = true``: the saved activations of the
  transformer blocks go to the host in the forward and come back in the backward; the GPU keeps
  none of them at the loss backward (the copies run on the compute stream: a block's device
  memory is free for the next kernels once its forward is done) and one block's worth in the
  blocks' backward (a block's saved tensors come back when its backward unpacks them and go
  with it), besides the head's buffers and the recomputation; cost: those bytes twice over the
  host link per forward, hidden behind the rank's compute except what exceeds it;
* bf16 optimizer state, ``optimizer.state_dtype = "bfloat16"``: AdamW's moments and Muon's
  momentum in bf16, half the state bytes; time: AdamW's step reads and writes 8 bytes fewer per
  parameter (the two states at 2 instead of 4 bytes, read and written).

Every option acts on the step's phases (:func:`option_parts`, :mod:`tools.planner.phases`), so
what it saves is the peak without it less the peak with it: an option that lowers a phase that
is not the peak saves less than its bytes. Per layout the options are tried in sets of
increasing size and only the minimal sets that fit are kept (an option the layout does not need
is not added); the results are ranked by estimated tokens/s per GPU like the plain search.
Memory is priced per rank (the first and the last pipeline stage, as
:func:`tools.planner.estimate.estimate`), from the same terms the planner prints.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

from .choice import DTYPE_BYTES, grad_accum_steps
from .estimate import Estimate, Job, _in_flight, estimate, memory_for_rank
from .hardware import GIB, step_bytes_per_param
from .inventory import model_inventory
from .phases import peak

__all__ = [
    "OPTIONS",
    "FitResult",
    "chunked_head_bytes",
    "chunked_loss_saving",
    "config_lines",
    "fit_layouts",
    "merge_into_toml",
    "option_memory",
    "option_parts",
]

OPTIONS = ("loss_chunk_tokens", "state_dtype", "activation_offload", "cpu_offload")
DEFAULT_CHUNK_TOKENS = 1024


@dataclass
class FitResult:
    estimate: Estimate  # memory and time with the options applied
    options: tuple[str, ...]  # names from OPTIONS
    saved: dict  # bytes each option takes off the busiest rank's total


def chunked_loss_saving(args, t: int, tp: int, a: int, chunk_tokens: int) -> int:
    """What the chunked loss takes off the loss phase (:mod:`tools.planner.phases`) of one
    micro-batch of ``t`` local tokens per pass (``1 + D`` passes with D MTP depths, one head
    call): the four ``[tokens, vocab / tp]`` tensors of the plain loss's backward start (the
    logits, the log-softmax and the loss's two float32 gradients, ``12 + a`` bytes per element)
    less what the chunked head holds then, :func:`chunked_head_bytes`. The option's own
    ``chunked_loss_saving_bytes`` (models/common/chunked_loss.py, the trainer's start-up line)
    is larger by the input gradient (``a rows dim``) and, below float32, by what the chunked
    backward's casts add beyond the chunk buffers (tests/unit/test_fit_xcheck.py)."""
    rows = t * (1 + getattr(args, "mtp_layers", 0))
    v = -(-args.vocab_size // tp)
    return (12 + a) * rows * v - chunked_head_bytes(args, t, tp, a, chunk_tokens)


def chunked_head_bytes(args, t: int, tp: int, a: int, chunk_tokens: int) -> int:
    """The most the chunked head's backward (models/common/chunked_loss.py ``_ChunkedHeadCE``)
    holds at once on one micro-batch of ``t`` local tokens per pass (``rows`` with the MTP
    depths, ``c = min(C, rows)``): the input gradient (``a rows dim``) and the float32
    weight-gradient accumulator (``4 v dim``) throughout, plus the largest of: one chunk's
    float32 logits buffer and, below float32, its cast (``(4 + low) c v``, ``low`` = ``a`` below
    float32, else 0: the cast and ``addmm_`` make no copy in float32); below float32, the
    chunk's cast gradient with its weight-gradient product and that product's float32 copy
    (``a c v + (a + 4) v dim``), and the accumulator's final cast (``a v dim``)."""
    rows = t * (1 + getattr(args, "mtp_layers", 0))
    v = -(-args.vocab_size // tp)
    c = min(chunk_tokens, rows)
    low = a if a != 4 else 0
    moments = [(4 + low) * c * v]
    if low:
        moments += [low * c * v + (low + 4) * v * args.dim, low * v * args.dim]
    return a * rows * args.dim + 4 * v * args.dim + max(moments)


def option_parts(job: Job, d, choice, rank: int, options: tuple, chunk_tokens: int):
    """:func:`tools.planner.rank_memory.memory_parts` of ``rank`` with ``options`` on."""
    from .rank_memory import memory_parts, rank_context

    ctx = rank_context(job, d, choice, rank)
    parts = memory_parts(job, d, choice, ctx)
    _, args = model_inventory(job.model, job.flavor, **job.overrides)
    stages = ctx.stages
    mb = ctx.mb
    a = DTYPE_BYTES[choice.param_dtype]
    _, logits_held = _in_flight(choice, d.pp, ctx.plan)
    has_head = any(head for _, _, head in stages)
    if "loss_chunk_tokens" in options and has_head:
        t = mb * (job.seq_len // d.cp)
        rows = t * (1 + getattr(args, "mtp_layers", 0))
        v = -(-args.vocab_size // d.tp)
        # no logits or log-softmax held per micro-batch, no loss gradients: one chunk at a time
        parts.head -= logits_held * (a + 4) * rows * v
        parts.loss_grads = chunked_head_bytes(args, t, d.tp, a, chunk_tokens)
        parts.logits_kept = 0  # the trainer holds the per-token losses instead
    if "activation_offload" in options:
        from .choice import selective_every
        from .estimate import _activations

        key = tuple(sorted(job.overrides.items()))
        held = n_layers = 0
        for layers, _e, head in stages:
            est = _activations(
                job.model, job.flavor, key, layers, mb, job.seq_len, d.tp, d.cp, d.etp, a, choice.ac, head,
                selective_every(choice), choice.sequence_parallel,
            )  # fmt: skip
            held += est.layers
            n_layers += len(layers)
        # none at the loss backward: every block's saved tensors went to the host in its forward
        # (on the compute stream, so the device copy is free for the next kernels once the
        # block's forward is done); in the blocks' backward one block's come back at a time
        # (brought back when its backward unpacks them, released after it): one block of one
        # micro-batch (models/parallel/activation_offload.py)
        parts.layers_backward = min(parts.layers, held / n_layers if n_layers else 0)
        parts.layers = 0
    if "state_dtype" in options:
        parts.optimizer = parts.optimizer / 2
    if "cpu_offload" in options:
        parts.params = parts.grads = parts.optimizer = parts.head_grads = 0
        if not parts.accumulated_unsharded:  # without sharding the accumulated gradients are the host's
            parts.accumulated = 0
    return parts


def option_memory(job: Job, d, choice, rank: int, options: tuple, chunk_tokens: int) -> dict:
    """:func:`memory_for_rank` of ``rank`` with ``options`` on (the peak phase's bytes per term,
    ``total``, each phase's total: :func:`tools.planner.phases.peak`)."""
    return peak(option_parts(job, d, choice, rank, options, chunk_tokens))


def _host_seconds(job: Job, d, choice, rank: int, options: tuple, busy: float) -> float:
    """Exposed host-link time of ``options`` on ``rank`` (CPU offload's copies; the part of
    activation offload's copies that its compute does not hide)."""
    hw = job.hardware
    link = hw.host_link_gbps * 1e9
    base = memory_for_rank(job, d, choice, rank)
    m = choice.n_microbatches if d.pp > 1 else 1
    forwards = grad_accum_steps(choice, d) * m
    total = 0.0
    if "cpu_offload" in options:
        padded_bytes = base["params"]  # 4 bytes per padded element
        syncs = grad_accum_steps(choice, d) if d.pp > 1 else 1
        gathers = forwards * (2 if choice.reshard == "default" and d.pp == 1 else 1)
        total += padded_bytes * (gathers + syncs) / link
    if "activation_offload" in options:
        held = option_parts(job, d, choice, rank, (), 0).layers
        kept = option_parts(job, d, choice, rank, ("activation_offload",), 0).layers
        moved = (held - kept) * forwards * 2
        total += max(0.0, moved / link - busy)
    return total


def _with_options(job: Job, base: Estimate, options: tuple, chunk_tokens: int) -> Estimate:
    d, c = base.degrees, base.choice
    stride_pp = d.world_size // d.pp
    ranks = sorted({0, (d.pp - 1) * stride_pp})
    mems = [option_memory(job, d, c, r, options, chunk_tokens) for r in ranks]
    mem = max(mems, key=lambda x: x["total"])
    fits = mem["total"] <= job.hardware.usable_gib * GIB
    t = dict(base.time)
    hw = job.hardware
    rate = hw.peak_flops(c.param_dtype) * job.efficiency
    _, args = model_inventory(job.model, job.flavor, **job.overrides)
    extra = 0.0
    if "loss_chunk_tokens" in options:
        tokens = c.local_batch * grad_accum_steps(c, d) * (job.seq_len // d.cp)
        passes = 1 + getattr(args, "mtp_layers", 0)
        extra += 2 * tokens * args.dim * (args.vocab_size // d.tp) * passes / rate
    busy = t["compute"] + t["recompute"] + t["tp_overhead"] + t["cp_overhead"] + t["elementwise"]
    host = max(_host_seconds(job, d, c, r, options, busy) for r in ranks)
    optimizer = t["optimizer"]
    if "state_dtype" in options and job.optimizer == "AdamW":
        per = step_bytes_per_param(c.param_dtype, c.reduce_dtype)
        optimizer *= (per - 8) / per
    if "cpu_offload" in options:
        optimizer *= hw.memory_gbps / hw.host_memory_gbps
    t["loss_recompute"] = extra
    t["host_link"] = host
    t["total"] = t["total"] + extra * (1 + base.bubble_fraction / max(1e-12, 1 - base.bubble_fraction)) + host
    t["total"] += optimizer - t["optimizer"]
    t["optimizer"] = optimizer
    tokens = job.global_batch * job.seq_len
    return dataclasses.replace(
        base, memory=mem, fits=fits, time=t, tokens_per_s_per_gpu=tokens / t["total"] / d.world_size
    )


def fit_layouts(job: Job, estimates, chunk_tokens: int = DEFAULT_CHUNK_TOKENS, top: int | None = None):
    """For every estimated layout (``PlanResult.estimates``; a layout not priced is priced
    here when some option set fits it), the minimal option sets that make it fit, each priced;
    ranked by tokens/s per GPU (fewer options first on ties)."""
    usable = job.hardware.usable_gib * GIB
    out: list[FitResult] = []
    for e in estimates:
        if e.fits:
            out.append(FitResult(e, (), {}))
            continue
        d, c = e.degrees, e.choice
        stride_pp = d.world_size // d.pp
        ranks = sorted({0, (d.pp - 1) * stride_pp})
        minimal: list[tuple] = []
        for k in range(1, len(OPTIONS) + 1):
            for opts in itertools.combinations(OPTIONS, k):
                if any(set(s) <= set(opts) for s in minimal):
                    continue
                worst = max(option_memory(job, d, c, r, opts, chunk_tokens)["total"] for r in ranks)
                if worst <= usable:
                    minimal.append(opts)
        if not minimal:
            continue
        priced = e if e.time is not None else estimate(job, d, c, time_if_oom=True)
        for opts in minimal:
            f = _with_options(job, priced, opts, chunk_tokens)
            saved = {o: priced.memory["total"] - _with_options(job, priced, (o,), chunk_tokens).memory["total"]
                     for o in opts}  # fmt: skip
            out.append(FitResult(f, opts, saved))
    out.sort(key=lambda r: (-r.estimate.tokens_per_s_per_gpu, len(r.options)))
    return out[:top] if top else out


def config_lines(options: tuple, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> list[str]:
    """The trainer config fields that turn ``options`` on, as TOML lines."""
    lines = []
    training = []
    if "loss_chunk_tokens" in options:
        training.append(f"loss_chunk_tokens = {chunk_tokens}")
    if "cpu_offload" in options:
        training.append("cpu_offload = true")
    if training:
        lines += ["[training]", *training]
    if "activation_offload" in options:
        lines += ["[activation_checkpoint]", "offload = true"]
    if "state_dtype" in options:
        lines += ["[optimizer]", 'state_dtype = "bfloat16"']
    return lines


def merge_into_toml(snippet: str, lines: list[str]) -> str:
    """``snippet`` (a config's TOML) with the option ``lines`` (:func:`config_lines`) added, each
    under its table: at the end of that table where the snippet has it, else as a new table."""
    out = snippet.rstrip("\n").split("\n")
    table = None
    for line in lines:
        if line.startswith("["):
            table = line
            continue
        if table in out:
            end = out.index(table) + 1
            while end < len(out) and out[end] and not out[end].startswith(("[", "#")):
                end += 1
            out.insert(end, line)
        else:
            out += ["", table, line]
    return "\n".join(out) + "\n"
