"""Expert-parallel and expert-data-parallel groups, cut from the ranks holding the same
parameters: the data-parallel axis of the mesh, times the sequence-parallel axis under
sequence parallelism.

An MoE layer with ``ep_size`` spreads its experts over ``ep_size`` of those ranks (the
expert-parallel group, ``ep``); ranks holding the same experts form the expert-data-parallel
group (``edp``, ``dp * sp / ep_size`` ranks), over which expert gradients are reduced. Both
are sub-meshes of the one device mesh: the data-parallel ranks (replicate x shard, then
``sp`` innermost, the flattening ZeRO shards dense parameters over) are unflattened into
``(edp, ep)`` (consecutive ranks share an expert-parallel group, DeepSpeed's default) or
``(ep, edp)`` (``data_before_expert``), so no group is made outside the mesh.

Under sequence parallelism each rank routes its own sequence shard's tokens (rows of an MoE
layer are independent); with ``sp`` innermost and consecutive expert-parallel groups, the
shards of one sequence exchange tokens first, as in DeepSpeed (whose expert groups are
consecutive ranks of the world, and whose Ulysses groups are consecutive too). Expert
gradients, summed over ``edp`` and divided by ``dp * sp`` (``ExpertGroups.dp_size``), get
the average dense gradients get over the data x sequence-parallel ranks.

Under tensor and pipeline parallelism the data-parallel ranks are those of this rank's TP
coordinate and pipeline stage: the experts are spread over the data-parallel axis only, each
TP rank and stage has its own groups (``slipstream.moe.tensor_parallel`` for what TP adds).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh

from slipstream.distributed import comm
from slipstream.distributed.mesh import ParallelDims, build_mesh

__all__ = ["ExpertGroups", "expert_groups"]


@dataclass(frozen=True)
class ExpertGroups:
    """The groups of one ``ep_size``.

    Attributes:
        ep_size: ranks in an expert-parallel group.
        ep_group: this rank's expert-parallel group (token all-to-all).
        edp_group: this rank's expert-data-parallel group (expert gradient reduction).
        dp_size: ranks in the whole data-parallel group, times the sequence-parallel ranks
            (expert gradients are averaged by it).
    """

    ep_size: int
    ep_group: comm.Group
    edp_group: comm.Group
    dp_size: int


# Keyed by the mesh's id; each entry holds its mesh too, so that id cannot be reused by a
# later mesh (after an engine is destroyed) and hand out the old mesh's groups.
_CACHE: dict[tuple[int, int, bool], tuple[DeviceMesh, ExpertGroups]] = {}
_WORLD_MESH: list[DeviceMesh] = []


def _dp_size(mesh: DeviceMesh) -> int:
    return mesh["dp_replicate"].size() * mesh["dp_shard"].size() * mesh["sp"].size()


def _dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The ranks holding the same parameters, as one axis: data-parallel (replicate x shard)
    and, under sequence parallelism, sequence-parallel too (``sp`` innermost; the flattening
    ``mesh.dp_sp_group`` makes)."""
    if mesh["sp"].size() > 1:
        if mesh["dp_replicate"].size() * mesh["dp_shard"].size() == 1:
            return mesh["sp"]
        return mesh["dp_replicate", "dp_shard", "sp"]._flatten("dp_sp")
    if mesh["dp_replicate"].size() == 1:
        return mesh["dp_shard"]
    if mesh["dp_shard"].size() == 1:
        return mesh["dp_replicate"]
    return mesh["dp_replicate", "dp_shard"]._flatten("dp")


def expert_groups(
    mesh: DeviceMesh | None, ep_size: int, data_before_expert: bool = False
) -> ExpertGroups:
    """The expert-parallel groups of ``ep_size`` over ``mesh``'s data-parallel (times
    sequence-parallel) ranks.

    A collective call on first use for a ``(mesh, ep_size)`` (every rank must make it);
    cached after. ``mesh=None`` uses a data-parallel mesh over the whole world, and without
    ``torch.distributed`` initialized both groups are single-process (``None``).

    Raises:
        ValueError: ``ep_size`` does not divide the data- (times sequence-) parallel size.
    """
    if not comm.is_initialized():
        if ep_size != 1:
            raise ValueError(
                f"ep_size={ep_size} needs {ep_size} processes: launch with torchrun / "
                "`slipstream run --nproc` or set ep_size=1"
            )
        return ExpertGroups(1, None, None, 1)
    if ep_size == 1:  # experts are replicated like dense parameters: no groups needed
        dp_size = comm.get_world_size() if mesh is None else _dp_size(mesh)
        return ExpertGroups(1, None, None, dp_size)
    if mesh is None:
        if not _WORLD_MESH:
            _WORLD_MESH.append(build_mesh(ParallelDims(world_size=comm.get_world_size())))
        mesh = _WORLD_MESH[0]
    key = (id(mesh), ep_size, data_before_expert)
    if key not in _CACHE:
        dp = _dp_mesh(mesh)
        dp_size = dp.size()
        if ep_size < 1 or dp_size % ep_size:
            raise ValueError(
                f"ep_size={ep_size} must divide the data-parallel size {dp_size}"
                f"{' (data x sequence parallel)' if mesh['sp'].size() > 1 else ''}: choose an "
                "ep_size that divides the number of data-parallel ranks"
            )
        sizes = (
            (ep_size, dp_size // ep_size) if data_before_expert else (dp_size // ep_size, ep_size)
        )
        ep_name, edp_name = f"ep{ep_size}", f"edp{ep_size}"
        names = (ep_name, edp_name) if data_before_expert else (edp_name, ep_name)
        sub = dp._unflatten(0, sizes, names)
        ep_group, edp_group = sub.get_group(ep_name), sub.get_group(edp_name)
        comm.register_axis(ep_group, "ep")
        comm.register_axis(edp_group, "edp")
        _CACHE[key] = (mesh, ExpertGroups(ep_size, ep_group, edp_group, dp_size))
    return _CACHE[key][1]
