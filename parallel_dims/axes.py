"""The parallel axes, once: every other list of degrees is derived from :data:`AXES`.

``Degrees`` and ``validate_degrees`` (layout.py), ``ParallelDims``' constructor, the trainer
config's ``[parallelism]`` degree keys and their short aliases, the describe CLI's flags and the
loss-comparison tool's layout keys all read this table. Adding an axis means adding a row here,
plus the code that builds and uses its mesh (``layout.py``'s rank modes, the appliers).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Axis:
    """One parallelism degree."""

    name: str  # the degree's name: ParallelDims field, mesh name, config alias, layout key
    config_key: str  # its key in the trainer config's [parallelism] section
    help: str
    default: int = 1
    # True when the degree multiplies into the world size; ep and etp fold over other axes
    process_axis: bool = True
    # other names a user may write for it in a layout spec (compare tool)
    layout_aliases: tuple[str, ...] = ()

    @property
    def cli_flag(self) -> str:
        """The describe CLI's flag, e.g. ``--dp-replicate``."""
        return "--" + self.name.replace("_", "-")


AXES: tuple[Axis, ...] = (
    Axis(
        "dp_replicate", "data_parallel_replicate_degree",
        "Replica groups of DDP/HSDP: each holds a full copy of the (sharded) model.",
    ),
    Axis(
        "dp_shard", "data_parallel_shard_degree",
        "FSDP shard degree; -1 infers it from the world size (all ranks the others leave).",
        default=-1, layout_aliases=("fsdp",),
    ),
    Axis("cp", "context_parallel_degree", "Context parallelism: the sequence split over ranks."),
    Axis("tp", "tensor_parallel_degree", "Tensor (and sequence/loss) parallelism."),
    Axis("pp", "pipeline_parallel_degree", "Pipeline stages."),
    Axis(
        "ep", "expert_parallel_degree",
        "Expert parallelism for MoE layers; folds over the dp_shard, cp and tp ranks.",
        process_axis=False,
    ),
    Axis(
        "etp", "expert_tensor_parallel_degree",
        "Tensor parallelism inside experts: 1 or tp.", process_axis=False,
    ),
)  # fmt: skip

DEGREE_NAMES: tuple[str, ...] = tuple(a.name for a in AXES)
PROCESS_AXES: tuple[str, ...] = tuple(a.name for a in AXES if a.process_axis)
DEFAULT_DEGREES: dict[str, int] = {a.name: a.default for a in AXES}
BY_NAME: dict[str, Axis] = {a.name: a for a in AXES}
