"""Parallel dimensions -> one DeviceMesh with named axes; groups are read from it.

Groups that lie outside the training mesh are made here too, so no code above
``slipstream/distributed`` calls ``new_group`` (``tests/test_layering.py`` holds this): the
tensor-parallel group of inference and of the hybrid engine's generation (consecutive ranks,
:func:`consecutive_group`) and the groups of tied pipeline layers (:func:`member_group`).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from slipstream.accelerator import get_accelerator
from slipstream.distributed import comm

__all__ = [
    "MESH_AXES",
    "DeviceMesh",
    "ParallelDims",
    "build_mesh",
    "consecutive_group",
    "dp_group",
    "dp_sp_group",
    "member_group",
    "sp_ring_groups",
]

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


def member_group(rank_lists: list[list[int]], axis: str) -> tuple[comm.Group, list[int]] | None:
    """Create a group for each list of global ranks, in order; return this rank's group and its
    ranks (None when this rank is in none of them). The lists should not overlap.

    A collective call: every rank of the world makes it with the same lists, members or not.
    Without a world (``torch.distributed`` not started) the groups are ``None``.
    """
    mine: tuple[comm.Group, list[int]] | None = None
    rank = comm.get_rank()
    for ranks in rank_lists:
        group = comm.new_group(ranks, axis=axis)
        if rank in ranks:
            mine = (group, ranks)
    return mine


def consecutive_group(size: int, axis: str) -> comm.Group:
    """This rank's group of ``size`` consecutive ranks (ranks 0..size-1, size..2*size-1, ...);
    ``None``, the default group, when ``size`` is the whole world.

    A collective call when ``size`` is less than the world (every rank creates every group).
    The world size must be a multiple of ``size`` (the callers check it, naming their key).
    """
    world = comm.get_world_size()
    if size == world:
        return None
    found = member_group(
        [list(range(start, start + size)) for start in range(0, world, size)], axis
    )
    return None if found is None else found[0]


def sp_ring_groups(mesh: DeviceMesh, ring_size: int) -> tuple[comm.Group, comm.Group]:
    """``(ulysses, ring)``: the ``sp`` axis of ``mesh`` unflattened into ``sp_ring`` (outer,
    ``ring_size`` ranks) x ``sp_ulysses`` (inner, consecutive ranks), for Ulysses x ring
    attention (``slipstream.sequence.ring``). Both are groups of the mesh, a group of one
    rank included.

    A collective call (every rank of the world makes it). ``ring_size`` must divide the
    ``sp`` axis size (the config checks it, naming the key).
    """
    sp = mesh["sp"].size()
    if ring_size < 1 or sp % ring_size:
        raise ValueError(f"ring size {ring_size} does not divide the sp axis size {sp}")
    sub = mesh._unflatten("sp", (ring_size, sp // ring_size), ("sp_ring", "sp_ulysses"))
    ulysses, ring = sub.get_group("sp_ulysses"), sub.get_group("sp_ring")
    comm.register_axis(ulysses, "sp_ulysses")
    comm.register_axis(ring, "sp_ring")
    return ulysses, ring
