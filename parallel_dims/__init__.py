"""Parallelism degrees -> rank layout -> DeviceMeshes. Imports nothing from trainer/ or models/."""

from .layout import Degrees, RankLayout, validate_degrees
from .parallel_dims import ParallelDims, check_model_layout, default_backend, default_device_type

__all__ = [
    "Degrees",
    "ParallelDims",
    "RankLayout",
    "check_model_layout",
    "default_backend",
    "default_device_type",
    "validate_degrees",
]
