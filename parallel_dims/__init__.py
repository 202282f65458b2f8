"""Parallelism degrees -> rank layout -> DeviceMeshes. Imports nothing from trainer/ or models/."""

# First of all: a torch below the supported range stops here with one line, not a traceback.
from ._torch_support import check_torch_version as _check_torch_version

_check_torch_version()

from .builders import (  # noqa: E402
    MESH_BUILDER_ENV,
    MESH_BUILDERS,
    layout_builder_available,
    resolve_mesh_builder,
)
from .layout import Degrees, RankLayout, validate_degrees  # noqa: E402
from .model_rules import ModelRules, check_model_layout  # noqa: E402
from .parallel_dims import ParallelDims  # noqa: E402
from .process_groups import default_backend, default_device_type, process_group_timeout  # noqa: E402

__all__ = [
    "MESH_BUILDERS",
    "MESH_BUILDER_ENV",
    "Degrees",
    "ModelRules",
    "ParallelDims",
    "RankLayout",
    "check_model_layout",
    "default_backend",
    "default_device_type",
    "layout_builder_available",
    "process_group_timeout",
    "resolve_mesh_builder",
    "validate_degrees",
]
