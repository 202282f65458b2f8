"""The part of ParallelDims' surface that exists for torchtitan users: ``*_enabled`` flags,
derived sizes, ``dense_mesh``/``sparse_mesh`` and ``pd.<name>_mesh`` role accessors, with
torchtitan's names and meaning, so code written against torchtitan's ParallelDims runs here.
Our own code asks ``get_mesh`` / ``fsdp_mesh_for`` / ``size`` instead."""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh

from .layout import ONE_D_AXES

__all__ = ["TorchtitanCompat"]


class TorchtitanCompat:
    """Mixed into :class:`~parallel_dims.ParallelDims` (which provides the degrees and
    ``get_mesh`` / ``get_optional_mesh``)."""

    @property
    def dense_mesh(self) -> DeviceMesh:
        return self.get_mesh("dense")

    @property
    def sparse_mesh(self) -> DeviceMesh:
        return self.get_mesh("sparse")

    def __getattr__(self, item: str):
        # fsdp_mesh, loss_mesh, tp_mesh, ...: the mesh of that role, or None when disabled.
        if item.endswith("_mesh") and item[: -len("_mesh")] in ONE_D_AXES:
            return self.get_optional_mesh(item[: -len("_mesh")])
        raise AttributeError(item)

    @property
    def dp_enabled(self) -> bool:
        return self.dp_replicate > 1 or self.dp_shard > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def dp_cp_enabled(self) -> bool:
        return self.dp_enabled or self.cp_enabled

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard_enabled or self.cp_enabled

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def etp_enabled(self) -> bool:
        return self.etp > 1

    @property
    def efsdp(self) -> int:
        return self.degrees.efsdp

    @property
    def fsdp_gradient_divide_factor(self) -> int:
        """Data-parallel ranks contributing to a gradient: experts are sharded on a smaller mesh
        than dense params but must be divided like them."""
        return self.dp_replicate * self.dp_shard * self.cp

    @property
    def non_data_parallel_size(self) -> int:
        return self.cp * self.tp * self.pp

    @property
    def seq_len_divisor(self) -> int:
        """Sequence parallel needs seq_len % tp == 0; load-balanced CP needs seq_len % 2cp."""
        return self.tp * (self.cp * 2)
