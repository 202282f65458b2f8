"""Pipeline parallelism on the ``pp`` mesh with ``torch.distributed.pipelining``.

Three steps, in the order the trainer runs them:

1. :func:`split_model` cuts the (meta-device) model into pipeline stages by transformer layer and
   keeps the stages this pp rank owns. A stage is the model class itself with the layers it
   does not own deleted and ``tok_embeddings`` / ``norm`` + ``output`` set to None away from the
   ends, so parameter FQNs (``layers.7.attention.wq.weight``) are those of the full model:
   FQN-seeded ``init_weights``, checkpoints and optimizer state need no renaming, and a
   pipelined run starts from exactly the weights of an unpipelined one.
2. The trainer parallelizes each stage (``parallelize_model``), materializes and initializes it,
   then calls :func:`build_pipeline_schedule`.
3. Every optimizer step calls :func:`pipeline_step` once per local batch, then
   :func:`sum_loss_over_pp` so that every rank (rank 0 included) knows the loss.

Loss convention (DESIGN.md section 5). The trainer's ``loss_fn(logits, labels)`` returns the SUM
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
tensor ``[microbatch, local seq, dim]`` (with sequence parallelism the TP plan gathers the
sequence at stage boundaries, so it is a plain tensor there too), so we give the metadata
statically and check each stage's output against it (:class:`_CheckedStage`).
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Sequence

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

from models.parallel.tensor_parallel import loss_parallel_context
from parallel_dims import ParallelDims

__all__ = [
    "SCHEDULES",
    "ScheduleInfo",
    "StageSplit",
    "Pipeline",
    "PipelineBoundaryError",
    "stage_layer_ranges",
    "stage_indices_for_rank",
    "split_model",
    "build_pipeline_schedule",
    "pipeline_step",
    "sum_loss_over_pp",
    "bubble_fraction",
    "stage_activation_dtype",
]


@dataclass(frozen=True)
class ScheduleInfo:
    """What we need to know about a torch schedule class to feed it.

    ``stages_per_rank``: None for any number >= 2 (looped/interleaved schedules), else the exact
    number. ``style``: how stages map to ranks: ``loop`` (rank r owns r, r+pp, r+2pp, ...) or
    ``v`` (rank r owns r and 2pp-1-r, so the first and last stage share rank 0)."""

    cls: type
    stages_per_rank: int | None
    style: str
    min_microbatches_per_stage: bool = False  # torch's 1F1B needs n_microbatches >= stages
    interleaved_rounds: bool = False  # flex schedules need n_mb % max(1, n_mb // pp) == 0


# Every schedule here was run over gloo on CPU against the unpipelined reference
# (tests/distributed/test_pipeline.py). DualPipeV is left out: it needs a user-supplied
# overlapped forward/backward callback to be more than ZBV.
SCHEDULES: dict[str, ScheduleInfo] = {
    "GPipe": ScheduleInfo(ScheduleGPipe, 1, "loop"),
    "1F1B": ScheduleInfo(Schedule1F1B, 1, "loop", min_microbatches_per_stage=True),
    "Interleaved1F1B": ScheduleInfo(ScheduleInterleaved1F1B, None, "loop", interleaved_rounds=True),
    "LoopedBFS": ScheduleInfo(ScheduleLoopedBFS, None, "loop"),
    "InterleavedZeroBubble": ScheduleInfo(
        ScheduleInterleavedZeroBubble, None, "loop", interleaved_rounds=True
    ),
    "ZBVZeroBubble": ScheduleInfo(ScheduleZBVZeroBubble, 2, "v"),
}

DEFAULT_STAGES_PER_RANK = 2  # for multi-stage schedules when nothing else fixes the stage count


def _schedule_info(name: str) -> tuple[str, ScheduleInfo]:
    """Canonical name and info; case-insensitive like torch's ``get_schedule_class``."""
    by_lower = {k.lower(): k for k in SCHEDULES}
    canonical = by_lower.get(str(name).lower())
    if canonical is None:
        raise ValueError(
            f"unknown pipeline schedule {name!r}; legal schedules: {', '.join(SCHEDULES)}"
        )
    return canonical, SCHEDULES[canonical]


# ----------------------------------------------------------------------------- splitting
def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _split_point_index(point: int | str) -> int:
    """Split points are layer indices; the config spells them as FQNs (``layers.4``)."""
    if isinstance(point, bool):
        raise ValueError(f"pipeline split point {point!r} is not a layer index")
    if isinstance(point, int):
        return point
    match = re.fullmatch(r"\s*(?:layers\.)?(\d+)\s*", str(point))
    if match is None:
        raise ValueError(
            f"pipeline split point {point!r} is neither a layer index nor 'layers.<index>'"
        )
    return int(match.group(1))


def stage_layer_ranges(
    n_layers: int, num_stages: int, split_points: Sequence[int | str] | None = None
) -> list[tuple[int, int]]:
    """``[start, end)`` transformer-layer range of every stage.

    Explicit ``split_points`` are the layers where a new stage starts (so ``[4, 8]`` makes
    three stages: 0-3, 4-7, 8-end). Without them layers are spread evenly; when they do not
    divide evenly the extra layers go to the middle stages first, then the first stage, then the
    last: the last stage also runs the output projection and the loss over the vocabulary (for
    Llama 3 8B the output matmul alone is ~2.4 layers' worth of FLOPs) and the first stage the
    embedding lookup (almost free).
    """
    _positive_int("n_layers", n_layers)
    if split_points:
        points = [_split_point_index(p) for p in split_points]
        if len(points) + 1 != num_stages:
            raise ValueError(
                f"{len(points)} pipeline split points make {len(points) + 1} stages, but the "
                f"layout needs {num_stages} (pp x stages per rank); give {num_stages - 1} points"
            )
        bad = [p for p in points if not 0 < p < n_layers]
        if bad:
            raise ValueError(
                f"pipeline split points {bad} are out of range: each must be a layer index in "
                f"1..{n_layers - 1} (n_layers={n_layers}), where a new stage starts"
            )
        if any(b <= a for a, b in zip(points, points[1:])):
            raise ValueError(
                f"pipeline split points {points} must be strictly increasing (every stage "
                "needs at least one layer)"
            )
        bounds = [0, *points, n_layers]
        return [(bounds[i], bounds[i + 1]) for i in range(num_stages)]
    if n_layers < num_stages:
        raise ValueError(
            f"n_layers={n_layers} is fewer than the {num_stages} pipeline stages; every stage "
            f"needs at least one layer: lower pp or the stages per rank so that "
            f"pp x stages_per_rank <= {n_layers}"
        )
    base, extra = divmod(n_layers, num_stages)
    priority = list(range(1, num_stages - 1)) + [0, num_stages - 1]
    counts = [base] * num_stages
    for s in priority[:extra]:
        counts[s] += 1
    ranges, start = [], 0
    for c in counts:
        ranges.append((start, start + c))
        start += c
    return ranges


def stage_indices_for_rank(pp_rank: int, pp: int, num_stages: int, style: str = "loop") -> list[int]:
    """Stages owned by ``pp_rank``, in execution order (the order torch's schedules expect)."""
    if num_stages % pp:
        raise ValueError(f"{num_stages} stages do not divide over pp={pp} ranks")
    per_rank = num_stages // pp
    if style == "loop":
        return [pp_rank + k * pp for k in range(per_rank)]
    if style == "v":
        if per_rank != 2:
            raise ValueError(f"a V-shaped schedule needs exactly 2 stages per rank, got {per_rank}")
        return [pp_rank, num_stages - 1 - pp_rank]
    raise ValueError(f"unknown stage-to-rank style {style!r}; legal: loop, v")


def _resolve_num_stages(
    schedule: str,
    info: ScheduleInfo,
    pp: int,
    n_layers: int,
    split_points: Sequence[int | str] | None,
    stages_per_rank: int | None,
    layers_per_stage: int | None,
) -> int:
    """Total stage count from whichever of split points / layers per stage / stages per rank
    is given, checked against what the schedule can run."""
    if split_points and layers_per_stage is not None:
        raise ValueError("give either pipeline split_points or layers_per_stage, not both")
    if split_points:
        num_stages = len(split_points) + 1
        source = f"{len(split_points)} split points"
    elif layers_per_stage is not None:
        _positive_int("layers_per_stage", layers_per_stage)
        if n_layers % layers_per_stage:
            raise ValueError(
                f"layers_per_stage={layers_per_stage} does not divide n_layers={n_layers}; "
                "use a divisor or explicit split points"
            )
        num_stages = n_layers // layers_per_stage
        source = f"layers_per_stage={layers_per_stage}"
    else:
        if stages_per_rank is None:
            stages_per_rank = info.stages_per_rank or DEFAULT_STAGES_PER_RANK
        _positive_int("stages_per_rank", stages_per_rank)
        num_stages = pp * stages_per_rank
        source = f"stages_per_rank={stages_per_rank}"
    if split_points or layers_per_stage is not None:
        if stages_per_rank is not None and num_stages != pp * stages_per_rank:
            raise ValueError(
                f"{source} make {num_stages} stages but stages_per_rank={stages_per_rank} with "
                f"pp={pp} needs {pp * stages_per_rank}"
            )
    if num_stages % pp:
        raise ValueError(
            f"{source} make {num_stages} stages, which do not divide over pp={pp} ranks; the "
            f"stage count must be a multiple of pp"
        )
    per_rank = num_stages // pp
    if info.stages_per_rank is not None and per_rank != info.stages_per_rank:
        multi = [n for n, i in SCHEDULES.items() if i.stages_per_rank != 1]
        hint = (
            f"use one of {', '.join(multi)} for several stages per rank"
            if info.stages_per_rank == 1
            else f"{schedule} needs exactly {info.stages_per_rank} stages per rank"
        )
        raise ValueError(
            f"schedule {schedule} runs {info.stages_per_rank} stage(s) per rank but {source} "
            f"with pp={pp} give {per_rank}; {hint}"
        )
    if info.stages_per_rank is None and per_rank < 2:
        single = [n for n, i in SCHEDULES.items() if i.stages_per_rank == 1]
        raise ValueError(
            f"schedule {schedule} interleaves several stages per rank but {source} with pp={pp} "
            f"give {per_rank}; use {' or '.join(single)} for one stage per rank, or more stages"
        )
    return num_stages


class StageSplit(NamedTuple):
    """This rank's stage modules, their global stage indices, and the whole split."""

    modules: list[nn.Module]
    stage_indices: list[int]
    num_stages: int
    layer_ranges: list[tuple[int, int]]  # of every stage, by stage index


def _check_pipelinable(model: nn.Module) -> None:
    for name in ("tok_embeddings", "layers", "norm", "output"):
        if not hasattr(model, name):
            raise ValueError(
                f"{type(model).__name__} has no {name!r}; pipeline splitting needs the "
                "tok_embeddings / layers / norm / output structure of our models"
            )
    if getattr(getattr(model, "args", None), "aux_loss_coeff", 0.0):
        # The sequence-wise aux loss is added to the loss in the trainer; on a pipeline the MoE
        # layers of earlier stages never see the loss function, so it would silently vanish.
        raise ValueError(
            f"aux_loss_coeff={model.args.aux_loss_coeff} is not supported with pipeline "
            "parallelism (pp > 1) yet; set aux_loss_coeff = 0 (auxiliary-loss-free balancing "
            "via load_balance_coeff works) or pp = 1"
        )


def _carve_stage(
    model: nn.Module, layer_range: tuple[int, int], is_first: bool, is_last: bool
) -> nn.Module:
    start, end = layer_range
    for key in list(model.layers.keys()):
        if not start <= int(key) < end:
            del model.layers[key]
    if not is_first:
        model.tok_embeddings = None
    if not is_last:
        model.norm = None
        model.output = None
    return model


def split_model(
    model: nn.Module | Callable[[], nn.Module],
    pd: ParallelDims,
    n_layers: int,
    split_points: Sequence[int | str] | None = None,
    schedule: str = "1F1B",
    *,
    stages_per_rank: int | None = None,
    layers_per_stage: int | None = None,
) -> StageSplit:
    """The pipeline stages this pp rank owns, as separate modules (unparallelized, on the
    model's device; use a meta-device model and materialize each stage after parallelizing).

    ``model`` is either a model (deep-copied once per local stage: cheap on meta) or a factory
    returning a fresh one. The stage count is ``len(split_points) + 1``, or
    ``n_layers / layers_per_stage``, or ``pp * stages_per_rank`` (default 1 for single-stage
    schedules, 2 for interleaved ones); stage ``i`` goes to pp rank ``i % pp`` (looped) or, for
    ZBVZeroBubble, V-shaped (rank r owns r and 2pp-1-r).
    """
    canonical, info = _schedule_info(schedule)
    if pd.pp < 2:
        raise ValueError(
            f"split_model needs pipeline parallelism, but pp={pd.pp}; with pp=1 train the "
            "whole model"
        )
    num_stages = _resolve_num_stages(
        canonical, info, pd.pp, n_layers, split_points, stages_per_rank, layers_per_stage
    )
    ranges = stage_layer_ranges(n_layers, num_stages, split_points)
    indices = stage_indices_for_rank(pd.coordinate("pp"), pd.pp, num_stages, info.style)
    modules = []
    for stage in indices:
        full = copy.deepcopy(model) if isinstance(model, nn.Module) else model()
        _check_pipelinable(full)
        if len(full.layers) != n_layers:
            raise ValueError(
                f"n_layers={n_layers} but the model has {len(full.layers)} layers; pass the "
                "model's own layer count"
            )
        modules.append(_carve_stage(full, ranges[stage], stage == 0, stage == num_stages - 1))
    return StageSplit(modules, indices, num_stages, ranges)


# ----------------------------------------------------------------------------- schedule
class PipelineBoundaryError(ValueError):
    """A stage's output does not match the metadata its pipeline was built with."""


class _CheckedStage(PipelineStage):
    """A ``PipelineStage`` that checks what it sends: the tensor must match the metadata the
    receiving stage allocated its buffer from, or gloo/NCCL would fail obscurely (or hang).
    The check lives on the stage, not as a hook on the module, so one module can serve
    several pipelines (e.g. different micro-batch counts)."""

    def __init__(self, *args, boundary: torch.Tensor, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._boundary_shape = tuple(boundary.shape)
        self._boundary_dtype = boundary.dtype

    def forward_maybe_with_nosync(self, *args, **kwargs):
        output = super().forward_maybe_with_nosync(*args, **kwargs)
        if not self.is_last:
            self._check(output)
        return output

    def _check(self, output) -> None:
        if isinstance(output, DTensor) or not isinstance(output, torch.Tensor):
            raise PipelineBoundaryError(
                f"pipeline stage {self.stage_index} must hand a plain tensor to the next stage, "
                f"got {type(output).__name__}"
            )
        if tuple(output.shape) != self._boundary_shape or output.dtype != self._boundary_dtype:
            raise PipelineBoundaryError(
                f"pipeline stage {self.stage_index} produced activations {tuple(output.shape)} "
                f"{output.dtype}, but the pipeline was built for {self._boundary_shape} "
                f"{self._boundary_dtype}; pass build_pipeline_schedule the activation_dtype the "
                "stages compute in (the FSDP mixed-precision param_dtype when FSDP is on), the "
                "local batch size and seq_len"
            )


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


def build_pipeline_schedule(
    stages: Sequence[nn.Module],
    stage_indices: Sequence[int],
    pd: ParallelDims,
    schedule_name: str,
    n_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    local_batch_size: int,
    seq_len: int,
    activation_dtype: torch.dtype = torch.float32,
    loss_parallel: bool = False,
) -> Pipeline:
    """Wrap this rank's (parallelized, initialized) stage modules in ``PipelineStage``s on the
    pp group and build ``schedule_name`` over them.

    ``loss_fn(logits, labels)`` must return the SUM of token losses of one micro-batch (see
    the module docstring for the normalization). ``local_batch_size`` is the number of
    sequences this rank feeds per :func:`pipeline_step` (split into ``n_microbatches``),
    ``seq_len`` the full sequence length (divided by cp here), ``activation_dtype`` the dtype of
    the hidden states between stages, and ``loss_parallel`` whether the logits are
    vocab-sharded DTensors (tp > 1 with loss parallelism).
    """
    canonical, info = _schedule_info(schedule_name)
    pp = pd.pp
    if pp < 2:
        raise ValueError(f"build_pipeline_schedule needs pp > 1, got pp={pp}")
    stages, stage_indices = list(stages), list(stage_indices)
    if not stages or len(stages) != len(stage_indices):
        raise ValueError(
            f"got {len(stages)} stage modules and {len(stage_indices)} stage indices; pass the "
            "modules and indices split_model returned"
        )
    num_stages = pp * len(stages)
    expected = stage_indices_for_rank(pd.coordinate("pp"), pp, num_stages, info.style)
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
    if local_batch_size % n_microbatches:
        legal = [d for d in range(1, local_batch_size + 1) if local_batch_size % d == 0]
        raise ValueError(
            f"n_microbatches={n_microbatches} does not divide the local batch of "
            f"{local_batch_size} sequences; legal microbatch counts: {', '.join(map(str, legal))}"
        )
    if info.min_microbatches_per_stage and n_microbatches < num_stages:
        raise ValueError(
            f"schedule {canonical} needs n_microbatches >= the {num_stages} pipeline stages, "
            f"got {n_microbatches}; use at least {num_stages} (or GPipe)"
        )
    if info.interleaved_rounds:
        rounds = max(1, n_microbatches // pp)
        if n_microbatches % rounds:
            raise ValueError(
                f"schedule {canonical} with pp={pp} needs n_microbatches to be a multiple of "
                f"its rounds max(1, n_microbatches // pp) = {rounds}, got {n_microbatches}; "
                f"use a multiple of pp={pp} or fewer than {2 * pp}"
            )
    if seq_len % pd.cp:
        raise ValueError(f"seq_len={seq_len} is not divisible by cp={pd.cp}")
    seq_local = seq_len // pd.cp
    mb = local_batch_size // n_microbatches

    device = _module_device(stages[0])
    group = pd.get_mesh("pp").get_group()
    pipeline_stages = []
    for module, index in zip(stages, stage_indices):
        dim = module.args.dim
        hidden = torch.empty(
            mb, seq_local, dim, dtype=activation_dtype, device="meta", requires_grad=True
        )
        first, last = index == 0, index == num_stages - 1
        inputs = torch.empty(mb, seq_local, dtype=torch.long, device="meta") if first else hidden
        # The last stage's output goes only to the loss, never over the wire; torch 2.13 reads
        # no metadata from it, torch 2.11 checks its dtype: the logits come out in the compute
        # dtype.
        outputs = (
            torch.empty(mb, seq_local, module.args.vocab_size, dtype=activation_dtype, device="meta")
            if last
            else hidden
        )
        pipeline_stages.append(
            _CheckedStage(
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
) -> torch.Tensor | None:
    """Forward and backward of one local batch through the pipeline; gradients accumulate into
    the stage parameters (call once per gradient-accumulation step, then clip and step).

    ``inputs``/``labels``: this rank's ``[local_batch_size, seq_len / cp]`` token ids and
    targets (the same slice every pp rank of a pipeline would read; only the ranks holding the
    first / last stage use them, others may pass None). ``global_token_count``: the number of
    tokens the whole optimizer step's loss is normalized by.

    Returns the sum of this rank's micro-batch losses (already divided by the global token
    count; a float32 scalar) on ranks holding the last stage, None elsewhere. Pass it to
    :func:`sum_loss_over_pp`, then reduce over the ``loss`` mesh as without pipelining.
    """
    if isinstance(global_token_count, torch.Tensor):
        bad = global_token_count.numel() != 1 or not bool(global_token_count > 0)
    else:
        bad = isinstance(global_token_count, bool) or not global_token_count > 0
    if bad:
        raise ValueError(f"global_token_count must be a positive number, got {global_token_count!r}")
    want = (pipe.local_batch_size, pipe.seq_len_local)
    for name, t, end in (("inputs", inputs, "first"), ("labels", labels, "last")):
        if not (pipe.has_first_stage if end == "first" else pipe.has_last_stage):
            continue
        if t is None:
            raise ValueError(f"this rank holds the {end} pipeline stage; pass {name}")
        if tuple(t.shape) != want:
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
            pipe.schedule.step(*args, target=target, losses=losses, return_outputs=False)
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
    """The loss every pp rank should log: the last stage's value (0 from the others, so a sum
    over pp is a broadcast), as a float32 scalar on ``device``. Collective over pp."""
    total = (
        local_loss.detach().float().clone().to(device)
        if local_loss is not None
        else torch.zeros((), dtype=torch.float32, device=device)
    )
    if pp_mesh is not None and pp_mesh.size() > 1:
        dist.all_reduce(total, group=pp_mesh.get_group())
    return total


def bubble_fraction(schedule: str, pp: int, n_microbatches: int, stages_per_rank: int = 1) -> float:
    """Idle fraction of a rank's step in the textbook cost model (forward F, input-backward B
    and weight-backward W each take the same time per stage chunk; no communication cost).

    GPipe / 1F1B: (p-1) / (m + p-1). Interleaved / looped with v stages per rank: the fill and
    drain shrink to one chunk, (p-1) / (v m + p-1). Zero-bubble (ZB-H1 style) fills the drain
    with deferred weight gradients, leaving (p-1) F-sized slots out of 3 v m: (p-1) / (3 v m +
    p-1). ZB-V with F = B = W is bubble-free in this model (0)."""
    canonical, _ = _schedule_info(schedule)
    p, m, v = pp, n_microbatches, stages_per_rank
    if canonical in ("GPipe", "1F1B"):
        return (p - 1) / (m + p - 1)
    if canonical in ("Interleaved1F1B", "LoopedBFS"):
        return (p - 1) / (v * m + p - 1)
    if canonical == "InterleavedZeroBubble":
        return (p - 1) / (3 * v * m + p - 1)
    return 0.0
