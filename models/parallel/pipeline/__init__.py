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

The package splits on those seams:

- :mod:`.plan`: pure planning on plain ints and strings (no torch): which layers each stage
  holds, which stages each pp rank runs, the stage count, schedule facts and every rule that
  needs only numbers; :func:`~.plan.plan_stages` returns the whole :class:`~.plan.StagePlan`.
- :mod:`.split`: :func:`split_model`, carving the model along a plan.
- :mod:`.schedule`: the runtime (torch schedules, the step, the loss over pp); its docstring
  has the loss convention and the stage metadata.
- :mod:`.stage`: the stage class the schedules run (torch's ``PipelineStage`` with the
  torch-private fixes of :mod:`parallel_dims.torch_compat` and the boundary check).

This module re-exports the public names, so ``from models.parallel.pipeline import X`` works as
it did when all of it was one module. The :mod:`.schedule` names are imported on first use
(PEP 562 ``__getattr__``): :mod:`.schedule` imports ``torch.distributed.pipelining``, which
imports ``torch._dynamo`` (about a second per process), and a run without pp never needs it.
"""

from typing import TYPE_CHECKING

from models.parallel.pipeline.plan import (
    DEFAULT_STAGES_PER_RANK,
    StagePlan,
    bubble_fraction,
    plan_stages,
    stage_indices_for_rank,
    stage_layer_ranges,
)
from models.parallel.pipeline.split import StageSplit, split_model

if TYPE_CHECKING:
    from models.parallel.pipeline.schedule import (
        SCHEDULES,
        Pipeline,
        PipelineBoundaryError,
        ScheduleInfo,
        build_pipeline_schedule,
        pipeline_step,
        stage_activation_dtype,
        sum_loss_over_pp,
    )

_SCHEDULE_NAMES = frozenset(
    {
        "SCHEDULES",
        "Pipeline",
        "PipelineBoundaryError",
        "ScheduleInfo",
        "build_pipeline_schedule",
        "pipeline_step",
        "stage_activation_dtype",
        "sum_loss_over_pp",
    }
)


def __getattr__(name: str):
    if name in _SCHEDULE_NAMES:
        from models.parallel.pipeline import schedule

        value = getattr(schedule, name)
        globals()[name] = value  # later look-ups skip this function
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _SCHEDULE_NAMES)


__all__ = [
    "DEFAULT_STAGES_PER_RANK",
    "SCHEDULES",
    "Pipeline",
    "PipelineBoundaryError",
    "ScheduleInfo",
    "StagePlan",
    "StageSplit",
    "bubble_fraction",
    "build_pipeline_schedule",
    "pipeline_step",
    "plan_stages",
    "split_model",
    "stage_activation_dtype",
    "stage_indices_for_rank",
    "stage_layer_ranges",
    "sum_loss_over_pp",
]
