"""Parallel dimensions -> one DeviceMesh with named axes; groups are read from it."""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from slipstream.accelerator import get_accelerator
from slipstream.distributed import comm

__all__ = ["MESH_AXES", "DeviceMesh", "ParallelDims", "build_mesh", "dp_group", "dp_sp_group"]

MESH_AXES = ("pp", "dp_replicate", "dp_shard", "sp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of each parallel axis; their product must equal the world size.

    ``dp_shard=-1`` takes whatever the other axes leave.
    """

    world_size: int
    dp_replicate: int = 1
    dp_shard: int = -1
    sp: int = 1
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "sp", "tp", "pp"):
            if getattr(self, name) < 1:
                raise ValueError(f"ParallelDims.{name} = {getattr(self, name)} must be >= 1")
        others = self.dp_replicate * self.sp * self.tp * self.pp
        if self.dp_shard == -1:
            if self.world_size % others:
                raise ValueError(
                    f"world size {self.world_size} is not divisible by dp_replicate*sp*tp*pp = "
                    f"{others}: choose sizes whose product divides the number of processes"
                )
            object.__setattr__(self, "dp_shard", self.world_size // others)
        if others * self.dp_shard != self.world_size:
            raise ValueError(
                f"parallel sizes pp={self.pp} dp_replicate={self.dp_replicate} dp_shard="
                f"{self.dp_shard} sp={self.sp} tp={self.tp} multiply to "
                f"{others * self.dp_shard}, not the world size {self.world_size}"
            )

    @property
    def dp(self) -> int:
        """Data-parallel size: replicas times shards (the batch is split this many ways)."""
        return self.dp_replicate * self.dp_shard

    def sizes(self) -> dict[str, int]:
        return {axis: getattr(self, axis) for axis in MESH_AXES}


def build_mesh(dims: ParallelDims, device_type: str | None = None) -> DeviceMesh:
    """Build the DeviceMesh over all axes (size-1 axes included) and label its groups."""
    if device_type is None:
        device_type = get_accelerator().device_name()
    sizes = dims.sizes()
    mesh = init_device_mesh(device_type, tuple(sizes.values()), mesh_dim_names=tuple(sizes))
    for axis in MESH_AXES:
        comm.register_axis(mesh.get_group(axis), axis)
    comm.register_axis(dp_group(mesh), "dp")
    if dims.sp > 1 and dims.dp > 1:
        comm.register_axis(dp_sp_group(mesh), "dp_sp")
    return mesh


def dp_group(mesh: DeviceMesh) -> comm.Group:
    """The process group spanning all data-parallel ranks (replicate x shard)."""
    if mesh["dp_replicate"].size() == 1:
        return mesh.get_group("dp_shard")
    if mesh["dp_shard"].size() == 1:
        return mesh.get_group("dp_replicate")
    return mesh["dp_replicate", "dp_shard"]._flatten("dp").get_group()


def dp_sp_group(mesh: DeviceMesh) -> comm.Group:
    """The group of all data- and sequence-parallel ranks: they hold the same parameters.

    ZeRO shards over it and averages gradients over it (the sequence-parallel loss makes
    that average the full-batch gradient; see ``slipstream.sequence``). Equals
    :func:`dp_group` when ``sp`` is 1.
    """
    if mesh["sp"].size() == 1:
        return dp_group(mesh)
    if mesh["dp_replicate"].size() * mesh["dp_shard"].size() == 1:
        return mesh.get_group("sp")
    return mesh["dp_replicate", "dp_shard", "sp"]._flatten("dp_sp").get_group()
