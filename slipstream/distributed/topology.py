"""Which ranks share a node: the hierarchy ZeRO++ (hpZ, qgZ) and comm accounting use.

Ranks are numbered node-major (``slipstream run`` and torchrun do this): node ``n`` holds
global ranks ``[n G, (n + 1) G)``. ``G`` (ranks per node) comes from, in order:
the ``ranks_per_node`` argument, ``SLIPSTREAM_RANKS_PER_NODE`` (lets tests declare e.g.
4 processes = 2 nodes x 2 on one machine), ``LOCAL_WORLD_SIZE`` (set by the launcher), or the
whole world (one node).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from slipstream.distributed import comm

__all__ = ["NodeTopology", "build_node_topology", "resolve_ranks_per_node"]


def resolve_ranks_per_node(world: int, ranks_per_node: int | None = None) -> int:
    for source, value in (
        ("ranks_per_node", ranks_per_node),
        ("SLIPSTREAM_RANKS_PER_NODE", os.environ.get("SLIPSTREAM_RANKS_PER_NODE")),
        ("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_WORLD_SIZE")),
    ):
        if value is None:
            continue
        g = int(value)
        if g <= 0 or world % g:
            raise ValueError(
                f"{source} = {value} does not divide the world size {world}: every node must "
                f"hold the same number of ranks (set {source} to a divisor of {world})"
            )
        return g
    return world


@dataclass
class NodeTopology:
    """This rank's node group (``G`` ranks) and cross-node group (``N`` ranks, same local
    index on every node)."""

    world: int
    ranks_per_node: int
    node_group: comm.Group
    cross_group: comm.Group

    @property
    def num_nodes(self) -> int:
        return self.world // self.ranks_per_node

    @property
    def node(self) -> int:
        return comm.get_rank() // self.ranks_per_node

    @property
    def local_rank(self) -> int:
        return comm.get_rank() % self.ranks_per_node


def build_node_topology(ranks_per_node: int | None = None) -> NodeTopology:
    """Create the node and cross-node groups (a collective: every rank must call it)."""
    import torch.distributed as dist

    world = comm.get_world_size()
    g = resolve_ranks_per_node(world, ranks_per_node)
    rank = comm.get_rank()
    comm.check_same_across_ranks(g, "ranks per node")
    node_group = cross_group = None
    for n in range(world // g):
        grp = dist.new_group(list(range(n * g, (n + 1) * g)))
        if rank // g == n:
            node_group = grp
    for i in range(g):
        grp = dist.new_group(list(range(i, world, g)))
        if rank % g == i:
            cross_group = grp
    comm.register_axis(node_group, "intra_node")
    comm.register_axis(cross_group, "inter_node")
    comm.set_ranks_per_node(g)
    return NodeTopology(world, g, node_group, cross_group)
