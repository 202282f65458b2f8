"""A pipeline stage as the schedules run it: torch's ``PipelineStage`` with the torch-private
fixes of :mod:`parallel_dims.torch_compat` mixed in, and a check that every stage hands the next
one exactly the activations the pipeline was built for."""

from __future__ import annotations

import torch
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor

from parallel_dims.torch_compat import PipelineStageFixes

__all__ = ["CheckedStage", "PipelineBoundaryError"]


class PipelineBoundaryError(ValueError):
    """A stage's output does not match the metadata its pipeline was built with."""


class CheckedStage(PipelineStageFixes, PipelineStage):
    """A ``PipelineStage`` that checks what it sends: the tensor must match the metadata the
    receiving stage allocated its buffer from, or gloo/NCCL would fail obscurely (or hang).
    The check lives on the stage, not as a hook on the module, so one module can serve
    several pipelines (e.g. different micro-batch counts). The torch-private overrides every
    stage needs come from :class:`parallel_dims.torch_compat.PipelineStageFixes`."""

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
                "local batch size and seq_len, and the stages as parallelized (their "
                "boundary_seq_shards)"
            )
