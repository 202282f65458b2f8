"""The pipeline at run time: torch schedules over this rank's stage modules, and the step.

Loss convention (docs/design.md section 5). The trainer's ``loss_fn(logits, labels)`` returns the SUM
of token losses of one micro-batch. The schedule divides it by the step's GLOBAL token count
(all dp/cp ranks, all micro-batches, all gradient-accumulation steps), so the micro-batch
losses add up to the step loss and their gradients add up to its gradient. torch's schedules
would by default also divide every gradient by ``n_microbatches`` (``scale_grads=True``, meant
for per-micro-batch *mean* losses); that would count the normalization twice, so we build them
with ``scale_grads=False``. The result is exact: the same loss and gradient as one unpipelined
forward/backward over the whole batch, up to fp32 summation order.

Stage metadata. torch 2.13 offers two ways for a stage to learn the shapes it sends and
receives: given up front ("static"), or inferred on the first step by running every stage
forward and backward once ("dynamic"). Dynamic inference feeds later stages uninitialized
memory (``torch.empty``), which a MoE layer would route and count into its load-balancing
statistics, and costs an extra forward/backward. Our stages exchange one plain hidden-state
tensor ``[microbatch, local seq / boundary_seq_shards, dim]``: the local sequence is the cp
rank's, and with sequence parallelism each tp rank sends its own sequence shard to the same tp
rank of the next stage (the stage module's ``boundary_seq_shards`` is tp then, set by
``models/parallel/tensor_parallel.py``; 1 otherwise), so we give the metadata statically and
check each stage's output against it (:class:`~models.parallel.pipeline.stage.CheckedStage`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)
from torch.distributed.tensor import DTensor

from models.parallel.pipeline.plan import (
    SCHEDULE_FACTS,
    StagePlan,
    _positive_int,
    check_microbatches,
    schedule_facts,
)
from models.parallel.pipeline.stage import CheckedStage, PipelineBoundaryError
from models.parallel.tensor_parallel import loss_parallel_context
from parallel_dims import ParallelDims

__all__ = [
    "SCHEDULES",
    "Pipeline",
    "PipelineBoundaryError",
    "ScheduleInfo",
    "build_pipeline_schedule",
    "pipeline_step",
    "stage_activation_dtype",
    "sum_loss_over_pp",
]


@dataclass(frozen=True)
class ScheduleInfo:
    """What we need to know about a torch schedule class to feed it: its planning facts
    (:class:`~models.parallel.pipeline.plan.ScheduleFacts`) and the class.

    ``stages_per_rank``: None for any number >= 2 (looped/interleaved schedules), else the exact
    number. ``style``: how stages map to ranks: ``loop`` (rank r owns r, r+pp, r+2pp, ...) or
    ``v`` (rank r owns r and 2pp-1-r, so the first and last stage share rank 0)."""

    cls: type
    stages_per_rank: int | None
    style: str
    min_microbatches_per_stage: bool = False  # torch's 1F1B needs n_microbatches >= stages
    interleaved_rounds: bool = False  # flex schedules need n_mb % max(1, n_mb // pp) == 0


# Every schedule here was run over gloo on CPU against the unpipelined reference
# (tests/distributed/test_pipeline.py). The names and facts are plan.py's SCHEDULE_FACTS.
_SCHEDULE_CLASSES: dict[str, type] = {
    "GPipe": ScheduleGPipe,
    "1F1B": Schedule1F1B,
    "Interleaved1F1B": ScheduleInterleaved1F1B,
    "LoopedBFS": ScheduleLoopedBFS,
    "InterleavedZeroBubble": ScheduleInterleavedZeroBubble,
    "ZBVZeroBubble": ScheduleZBVZeroBubble,
}
assert list(_SCHEDULE_CLASSES) == list(SCHEDULE_FACTS), "schedule classes and facts disagree"

SCHEDULES: dict[str, ScheduleInfo] = {
    name: ScheduleInfo(
        _SCHEDULE_CLASSES[name],
        facts.stages_per_rank,
        facts.style,
        min_microbatches_per_stage=facts.min_microbatches_per_stage,
        interleaved_rounds=facts.interleaved_rounds,
    )
    for name, facts in SCHEDULE_FACTS.items()
}


def _schedule_info(name: str) -> tuple[str, ScheduleInfo]:
    """Canonical name and info; case-insensitive like torch's ``get_schedule_class``."""
    canonical, _ = schedule_facts(name)
    return canonical, SCHEDULES[canonical]


@dataclass
class Pipeline:
    """A built schedule and what :func:`pipeline_step` needs to drive it on this rank."""

    schedule: PipelineScheduleSingle | PipelineScheduleMulti
    token_loss: _GlobalTokenLoss
    stages: list[PipelineStage]
    modules: list[nn.Module]
    schedule_name: str
    n_microbatches: int
    local_batch_size: int
    seq_len_local: int
    loss_parallel: bool
    # every stage needs the micro-batch's token ids (document masking / positions): the
    # schedule passes them to each stage as the keyword argument doc_tokens
    needs_documents: bool = False
    # chunked loss (training.loss_chunk_tokens): the last stage takes the micro-batch's labels as
    # the keyword argument labels and returns per-token losses (models/common/chunked_loss.py)
    head_labels: bool = False
    has_first_stage: bool = field(init=False)
    has_last_stage: bool = field(init=False)

    def __post_init__(self) -> None:
        self.has_first_stage = any(s.is_first for s in self.stages)
        self.has_last_stage = any(s.is_last for s in self.stages)


class _GlobalTokenLoss:
    """The trainer's per-micro-batch token-loss SUM divided by the step's global token count,
    which :func:`pipeline_step` sets before every step (it changes with padding/ignored
    tokens). Held here rather than passed through ``schedule.step(loss_kwargs=...)``, which
    torch 2.11's schedules do not have."""

    def __init__(self, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        self.loss_fn = loss_fn
        self.global_token_count: int | float | torch.Tensor | None = None

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.global_token_count is None:
            raise RuntimeError("pipeline loss called outside pipeline_step (no global token count)")
        return self.loss_fn(output, target) / self.global_token_count


def stage_activation_dtype(param_dtype: str) -> torch.dtype:
    """The dtype hidden states cross stage boundaries in, for ``build_pipeline_schedule``.

    FSDP2's mixed precision casts a wrapped stage's inputs to ``param_dtype`` and computes in
    it, and :func:`models.parallelize.parallelize_model` wraps every stage with FSDP2 whenever
    there is data parallelism or ``param_dtype`` is not float32 (on the size-1 shard mesh
    without data parallelism), so the stages always compute in ``param_dtype``.
    """
    dtype = getattr(torch, str(param_dtype), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"param_dtype={param_dtype!r} is not a floating-point torch dtype name")
    return dtype


def _module_device(module: nn.Module) -> torch.device:
    for p in module.parameters():
        dev = p.device
        if dev.type == "meta":
            raise ValueError(
                "pipeline stage parameters are on the meta device; call to_empty(device=...) and "
                "init_weights(seed) on each stage before build_pipeline_schedule"
            )
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        return dev
    raise ValueError("a pipeline stage has no parameters")


def _boundary_seq_shards(stages: Sequence[nn.Module]) -> int:
    """How many sequence shards the hidden states between stages are cut into (tp under
    sequence parallelism, set on every stage by the TP applier; 1 otherwise)."""
    shards = {int(getattr(module, "boundary_seq_shards", 1)) for module in stages}
    if len(shards) != 1:
        raise ValueError(
            f"this rank's pipeline stages disagree on boundary_seq_shards ({sorted(shards)}); "
            "parallelize every stage with the same tensor/sequence-parallel options"
        )
    (n,) = shards
    if n < 1:
        raise ValueError(f"boundary_seq_shards must be >= 1, got {n}")
    return n


def build_pipeline_schedule(
    stages: Sequence[nn.Module],
    stage_indices: Sequence[int],
    pd: ParallelDims,
    stage_plan: StagePlan,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    local_batch_size: int,
    seq_len: int,
    activation_dtype: torch.dtype = torch.float32,
    loss_parallel: bool = False,
) -> Pipeline:
    """Wrap this rank's (parallelized, initialized) stage modules in ``PipelineStage``s on the
    pp group and build the stage plan's schedule over them, with its micro-batch count.
    ``stage_plan``: the job's :class:`~models.parallel.pipeline.plan.StagePlan` (``JobPlan.stages``),
    made with a micro-batch count; the modules and indices are those ``split_model`` cut along it.

    ``loss_fn(logits, labels)`` must return the SUM of token losses of one micro-batch (see
    the module docstring for the normalization). ``local_batch_size`` is the number of
    sequences this rank feeds per :func:`pipeline_step` (split into ``n_microbatches``),
    ``seq_len`` the full sequence length (divided by cp here, and by each stage module's
    ``boundary_seq_shards`` for the hidden states between stages: tp under sequence
    parallelism), ``activation_dtype`` the dtype of the hidden states between stages, and
    ``loss_parallel`` whether the logits are vocab-sharded DTensors (tp > 1 with loss
    parallelism).
    """
    if stage_plan.n_microbatches is None:
        raise ValueError("build_pipeline_schedule needs a stage plan made with n_microbatches (plan_stages)")
    canonical, info = _schedule_info(stage_plan.schedule)
    n_microbatches = stage_plan.n_microbatches
    pp = pd.pp
    if pp < 2:
        raise ValueError(f"build_pipeline_schedule needs pp > 1, got pp={pp}")
    stages, stage_indices = list(stages), list(stage_indices)
    if not stages or len(stages) != len(stage_indices):
        raise ValueError(
            f"got {len(stages)} stage modules and {len(stage_indices)} stage indices; pass the "
            "modules and indices split_model returned"
        )
    if stage_plan.pp != pp:
        raise ValueError(f"the stage plan is for pp={stage_plan.pp}, the layout has pp={pp}")
    num_stages = stage_plan.num_stages
    expected = stage_plan.stages_for_rank(pd.coordinate("pp"))
    if stage_indices != expected:
        raise ValueError(
            f"schedule {canonical} expects pp rank {pd.coordinate('pp')} to own stages "
            f"{expected}, got {stage_indices}; split the model with the same schedule"
        )
    if info.stages_per_rank is not None and len(stages) != info.stages_per_rank:
        raise ValueError(
            f"schedule {canonical} runs {info.stages_per_rank} stage(s) per rank, got "
            f"{len(stages)}; split the model with the same schedule"
        )
    if info.stages_per_rank is None and len(stages) < 2:
        raise ValueError(f"schedule {canonical} needs at least 2 stages per rank, got 1")
    n_microbatches = _positive_int("n_microbatches", n_microbatches)
    local_batch_size = _positive_int("local_batch_size", local_batch_size)
    seq_len = _positive_int("seq_len", seq_len)
    mb = check_microbatches(canonical, pp, num_stages, n_microbatches, local_batch_size)
    if seq_len % pd.cp:
        raise ValueError(f"seq_len={seq_len} is not divisible by cp={pd.cp}")
    seq_local = seq_len // pd.cp
    shards = _boundary_seq_shards(stages)
    if seq_local % shards:
        raise ValueError(
            f"seq_len / cp = {seq_len}/{pd.cp} = {seq_local} is not divisible by tp={shards}: "
            "with sequence parallelism each tp rank sends its own sequence shard between "
            f"pipeline stages; use a seq_len that is a multiple of {pd.cp * shards}"
        )

    device = _module_device(stages[0])
    group = pd.get_mesh("pp").get_group()
    pipeline_stages = []
    for module, index in zip(stages, stage_indices):
        dim = module.args.dim
        hidden = torch.empty(mb, seq_local // shards, dim, dtype=activation_dtype, device="meta", requires_grad=True)
        first, last = index == 0, index == num_stages - 1
        inputs = torch.empty(mb, seq_local, dtype=torch.long, device="meta") if first else hidden
        # The last stage's output goes only to the loss, never over the wire; torch 2.13 reads
        # no metadata from it, torch 2.11 checks its dtype: the logits come out in the compute
        # dtype.
        # with MTP depths the last stage's logits are the main ones and each depth's, concatenated
        # along the sequence (models/deepseek_v3/model.py)
        logit_rows = seq_local * (1 + getattr(module.args, "mtp_layers", 0))
        # (with the chunked loss: each row's float32 cross-entropy)
        last_shape = (
            (mb, logit_rows) if getattr(module, "loss_chunk_tokens", 0) else (mb, logit_rows, module.args.vocab_size)
        )
        last_dtype = torch.float32 if len(last_shape) == 2 else activation_dtype
        outputs = torch.empty(last_shape, dtype=last_dtype, device="meta") if last else hidden
        pipeline_stages.append(
            CheckedStage(
                module,
                index,
                num_stages,
                device,
                input_args=(inputs,),
                output_args=(outputs,),
                group=group,
                boundary=hidden,
            )
        )
    cls = info.cls
    sched_stage = pipeline_stages[0] if issubclass(cls, PipelineScheduleSingle) else pipeline_stages
    token_loss = _GlobalTokenLoss(loss_fn)
    schedule = cls(
        sched_stage,
        n_microbatches=n_microbatches,
        loss_fn=token_loss,
        scale_grads=False,  # the loss is already normalized by the global token count
    )
    return Pipeline(
        schedule=schedule,
        token_loss=token_loss,
        stages=pipeline_stages,
        modules=list(stages),
        schedule_name=canonical,
        n_microbatches=n_microbatches,
        local_batch_size=local_batch_size,
        seq_len_local=seq_local,
        loss_parallel=loss_parallel,
        needs_documents=any(module.args.needs_documents for module in stages),
        head_labels=any(getattr(module, "loss_chunk_tokens", 0) for module in stages),
    )


def _local_scalar(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.float()


def pipeline_step(
    pipe: Pipeline,
    inputs: torch.Tensor | None,
    labels: torch.Tensor | None,
    global_token_count: int | float | torch.Tensor,
    *,
    forward_only: bool = False,
    mtp_tokens: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Forward and backward of one local batch through the pipeline; gradients accumulate into
    the stage parameters (call once per gradient-accumulation step, then clip and step).
    ``forward_only``: the schedule's forward-only path (``schedule.eval``: the same stages and
    micro-batches, no backward; call it under ``torch.no_grad()``), for evaluation.

    ``inputs``/``labels``: this rank's ``[local_batch_size, seq_len / cp]`` token ids and
    targets (the same slice every pp rank of a pipeline would read; only the ranks holding the
    first / last stage use them, others may pass None, except that with document masking or
    positions every stage reads the token ids: they go to each stage as ``doc_tokens``). ``global_token_count``: the number of
    tokens the whole optimizer step's loss is normalized by. ``mtp_tokens``: with DeepSeek-V3
    multi-token prediction, the ``[local_batch_size, seq_len / cp, D]`` token ids of the MTP
    depths (every stage gets them as a keyword, the last one uses them) and ``labels`` the
    ``[..., 1 + D]`` targets (``trainer/mtp.py``).

    Returns the sum of this rank's micro-batch losses (already divided by the global token
    count; a float32 scalar) on ranks holding the last stage, None elsewhere. Pass it to
    :func:`sum_loss_over_pp`, then reduce over the ``loss`` mesh as without pipelining.
    """
    if isinstance(global_token_count, torch.Tensor):
        # a device count (the trainer's target-token count, >= 1 by construction): its value is
        # not read here, which would make the host wait for the device every step
        bad = global_token_count.numel() != 1
    else:
        bad = isinstance(global_token_count, bool) or not global_token_count > 0
    if bad:
        raise ValueError(f"global_token_count must be a positive number, got {global_token_count!r}")
    want = (pipe.local_batch_size, pipe.seq_len_local)
    for name, t, end in (("inputs", inputs, "first"), ("labels", labels, "last")):
        needed = pipe.has_first_stage or pipe.needs_documents if end == "first" else pipe.has_last_stage
        if not needed:
            continue
        if t is None:
            why = (
                f"holds the {end} pipeline stage" if end == "last" or pipe.has_first_stage else "runs document masking"
            )
            raise ValueError(f"this rank {why}; pass {name}")
        if tuple(t.shape[:2]) != want:
            raise ValueError(
                f"pipeline {name} have shape {tuple(t.shape)}, but the pipeline was built for "
                f"[local_batch_size, seq_len / cp] = {list(want)}"
            )
    args = (inputs,) if pipe.has_first_stage else ()
    target = labels if pipe.has_last_stage else None
    losses: list[torch.Tensor] | None = [] if pipe.has_last_stage else None
    pipe.token_loss.global_token_count = global_token_count
    try:
        with loss_parallel_context(pipe.loss_parallel):
            run = pipe.schedule.eval if forward_only else pipe.schedule.step
            # the stage modules take the token ids as doc_tokens; torch splits keyword arguments
            # into micro-batches like the positional ones and hands them to every stage
            doc_kwargs = {"doc_tokens": inputs} if pipe.needs_documents else {}
            if mtp_tokens is not None:
                doc_kwargs["mtp_tokens"] = mtp_tokens
            if pipe.head_labels and pipe.has_last_stage:
                doc_kwargs["labels"] = labels
            run(*args, target=target, losses=losses, return_outputs=False, **doc_kwargs)
    except RuntimeError as exc:
        # torch wraps errors raised in a stage's forward in a RuntimeError; surface ours as the
        # ValueError it is (the trainer reports ValueErrors as user errors, without traceback)
        if isinstance(exc.__cause__, PipelineBoundaryError):
            raise exc.__cause__ from None
        raise
    if not pipe.has_last_stage:
        return None
    return torch.stack([_local_scalar(loss) for loss in losses]).sum()


def sum_loss_over_pp(
    local_loss: torch.Tensor | None, pp_mesh: DeviceMesh | None, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """The loss every pp rank should log: the sum over pp of each rank's part (the last stage's
    loss; the MoE aux loss of each stage's layers; 0 from a rank with neither), as a float32
    scalar on ``device``. Collective over pp."""
    total = (
        local_loss.detach().float().clone().to(device)
        if local_loss is not None
        else torch.zeros((), dtype=torch.float32, device=device)
    )
    if pp_mesh is not None and pp_mesh.size() > 1:
        dist.all_reduce(total, group=pp_mesh.get_group())
    return total
