"""Cutting a model into the pipeline stages one pp rank owns, along the job's stage plan (plan.py).

A stage is the model class itself with the layers it does not own deleted and
``tok_embeddings`` / ``norm`` + ``output`` set to None away from the ends, so parameter FQNs
(``layers.7.attention.wq.weight``) are those of the full model: FQN-seeded ``init_weights``,
checkpoints and optimizer state need no renaming, and a pipelined run starts from exactly the
weights of an unpipelined one.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import NamedTuple

from torch import nn

from models.parallel.pipeline.plan import StagePlan
from parallel_dims import ParallelDims

__all__ = ["StageSplit", "split_model"]


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


def _carve_stage(model: nn.Module, layer_range: tuple[int, int], is_first: bool, is_last: bool) -> nn.Module:
    start, end = layer_range
    for key in list(model.layers.keys()):
        if not start <= int(key) < end:
            del model.layers[key]
    if not is_first:
        model.tok_embeddings = None
    if not is_last:
        model.norm = None
        model.output = None
        if getattr(model, "mtp", None) is not None:
            model.mtp = None  # DeepSeek-V3's MTP depths run after the head's norm: last stage only
    return model


def split_model(model: nn.Module | Callable[[], nn.Module], stages: StagePlan, pd: ParallelDims) -> StageSplit:
    """The pipeline stages this pp rank owns under the job's stage plan, as separate modules
    (unparallelized, on the model's device; use a meta-device model and materialize each stage
    after parallelizing).

    ``model`` is either a model (deep-copied once per local stage: cheap on meta) or a factory
    returning a fresh one. ``stages``: the :class:`~models.parallel.pipeline.plan.StagePlan`
    (``JobPlan.stages``, or :func:`~models.parallel.pipeline.plan.plan_stages` for the same
    numbers): which layers each stage holds and which stages each pp rank runs; nothing is
    re-planned here.
    """
    if pd.pp < 2:
        raise ValueError(f"split_model needs pipeline parallelism, but pp={pd.pp}; with pp=1 train the whole model")
    if stages.pp != pd.pp:
        raise ValueError(
            f"the stage plan is for pp={stages.pp}, the layout has pp={pd.pp}; plan the stages for this layout"
        )
    num_stages, n_layers = stages.num_stages, stages.n_layers
    ranges = list(stages.layer_ranges)
    indices = stages.stages_for_rank(pd.coordinate("pp"))
    modules = []
    for stage in indices:
        full = copy.deepcopy(model) if isinstance(model, nn.Module) else model()
        _check_pipelinable(full)
        if len(full.layers) != n_layers:
            raise ValueError(
                f"the stage plan splits n_layers={n_layers} but the model has {len(full.layers)} layers; "
                f"plan the stages for the model's own layer count"
            )
        modules.append(_carve_stage(full, ranges[stage], stage == 0, stage == num_stages - 1))
    return StageSplit(modules, indices, num_stages, ranges)
