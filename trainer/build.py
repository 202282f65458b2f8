"""What the trainer builds from the job plan: this rank's model parts (split into its pipeline
stages along ``plan.stages``, parallelized with ``plan.parallelize``, materialized and
FQN-seeded) and, with pp > 1, the pipeline schedule over them.

Everything about the layout comes from the :class:`~trainer.plan.JobPlan`; nothing here reads
``[parallelism]`` (tests/unit/test_plan_drives_runtime.py checks that a plan alone determines it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from models.common.init import canonical_fqn
from models.parallel.offload import materialize
from models.parallel.pipeline import split_model
from models.parallelize import apply_converters
from trainer.forward import LossFn

if TYPE_CHECKING:
    from models.parallel.pipeline import Pipeline
    from trainer.plan import JobPlan

__all__ = ["build_model_parts", "build_pipeline", "trainable_params"]


def build_model_parts(plan: JobPlan, model: nn.Module, device: torch.device, seed: int) -> list[nn.Module]:
    """``model`` (on the meta device) cut into this rank's stages (pp > 1) or whole, each part
    parallelized, materialized on ``device`` and initialized from ``seed`` (FQN-seeded: stages
    match the full model). The meshes must be built."""
    parts = list(split_model(model, plan.stages, plan.parallel_dims).modules) if plan.stages is not None else [model]
    for part in parts:
        plan.model.parallelize_fn(part, plan.parallel_dims, plan.parallelize)
        # with CPU offload on an accelerator the parameters in host memory (models/parallel/offload.py)
        materialize(part, device, seed, plan.parallelize.cpu_offload)
    return parts


Params = list[tuple[str, tuple[int, ...]]]


def trainable_params(plan: JobPlan, model: nn.Module) -> tuple[Params, Params]:
    """(trainable, frozen) parameters of the whole model (every pipeline stage) as they are after
    every converter of ``model.converters`` (LoRA adds adapters and freezes the base; float8
    keeps names and shapes): FQN and global shape, for the optimizer's group check and start-up
    summary. ``model``: the unconverted model on the meta device (left as it is: a second one,
    built from the plan as it was, is converted; not a deepcopy, which under local_tensor mode
    returns the parameters as plain tensors that torchao's float8 swap refuses). The meshes must
    be built."""
    opts = plan.parallelize
    if opts.float8 is not None or opts.lora is not None:
        with torch.device("meta"):
            model = plan.model.model_cls(plan.model.args)
        model = apply_converters(model, plan.parallel_dims, opts)
    trainable: Params = []
    frozen: Params = []
    for name, p in model.named_parameters():
        (trainable if p.requires_grad else frozen).append((canonical_fqn(name), tuple(p.shape)))
    return trainable, frozen


def build_pipeline(
    plan: JobPlan, model_parts: list[nn.Module], loss_fn: LossFn, *, loss_parallel: bool
) -> Pipeline | None:
    """The training schedule of ``plan.stages`` over this rank's stage modules; None without pp."""
    if plan.stages is None:
        return None
    # imported here, not at the top: the pipeline runtime imports torch.distributed.pipelining
    # and with it torch._dynamo, about a second of every rank's start-up that a run without pp
    # does not need
    from models.parallel.pipeline import build_pipeline_schedule, stage_activation_dtype

    pd = plan.parallel_dims
    return build_pipeline_schedule(
        model_parts,
        plan.stages.stages_for_rank(pd.coordinate("pp")),
        pd,
        plan.stages,
        loss_fn,
        local_batch_size=plan.batch.local_batch_size,
        seq_len=plan.batch.seq_len,
        activation_dtype=stage_activation_dtype(plan.parallelize.param_dtype),
        loss_parallel=loss_parallel,
    )
