"""Tensor-parallel parameters: a rank's slice of a weight, and the full weight back.

A sharded parameter stays the same ``nn.Parameter`` object (optimizers built earlier, names and
checkpoints keep working); its data becomes the local slice and its
:class:`~slipstream.distributed.placement.TPShard` (split dimension of the logical weight, equal
blocks fused along it such as q|k|v, the rank and size that cut it) is what the gradient norm
and the checkpoint code read.
"""

from __future__ import annotations

import torch
from torch import nn

from slipstream.distributed import comm
from slipstream.distributed.placement import TPShard, set_tp_shard_, tp_shard
from slipstream.parallel.tensor.collectives import all_gather

__all__ = ["is_tp_sharded", "shard_param_", "tp_join", "tp_slice", "unshard_tp"]


def shard_param_(p: nn.Parameter, dim: int, group: comm.Group, parts: int = 1) -> None:
    """Replace ``p``'s data by this rank's slice along ``dim`` (in place, same Parameter).

    ``parts > 1``: the dimension is a concatenation of ``parts`` equal blocks (fused q|k|v);
    each block is split and this rank keeps its slice of every block, in order.
    """
    world, rank = comm.get_world_size(group), comm.get_rank(group)
    local = tp_slice(p.data, TPShard(dim=dim, parts=parts, rank=rank, size=world))
    # swap_tensors, not .data: a parameter that already ran backward caches its old shape
    # in its gradient accumulator. The Parameter object (and its identity) stays.
    torch.utils.swap_tensors(p, nn.Parameter(local, requires_grad=p.requires_grad))
    set_tp_shard_(p, TPShard(dim=dim, parts=parts, rank=rank, size=world))


def tp_slice(full: torch.Tensor, shard: TPShard) -> torch.Tensor:
    """The slice ``shard`` describes of the full logical tensor ``full`` (a new tensor)."""
    blocks = full.chunk(shard.parts, shard.dim)
    pieces = [b.chunk(shard.size, shard.dim)[shard.rank] for b in blocks]
    return torch.cat(pieces, shard.dim).contiguous()


def is_tp_sharded(p: torch.Tensor) -> bool:
    """True for a parameter holding one TP rank's slice."""
    return tp_shard(p) is not None


def unshard_tp(
    p: torch.Tensor, group: comm.Group, value: torch.Tensor | None = None
) -> torch.Tensor:
    """The full logical tensor of TP-sharded parameter ``p`` (or of ``value``, a tensor
    sharded like ``p``, e.g. its gradient); replicated tensors are returned as they are.
    Collective over ``group``."""
    value = (p if value is None else value).detach()
    shard = tp_shard(p)
    if shard is None or comm.get_world_size(group) == 1:
        return value
    dim, parts = shard.dim, shard.parts
    world = comm.get_world_size(group)
    full = all_gather(value, group, dim)  # rank-major: [rank0 blocks..., rank1 ...]
    return full if parts == 1 else tp_join(list(full.chunk(world, dim)), dim, parts)


def tp_join(shards: list[torch.Tensor], dim: int, parts: int = 1) -> torch.Tensor:
    """The full logical tensor from every rank's slice, in rank order (the inverse of
    :func:`tp_slice`; no collective): with ``parts`` fused blocks, block ``b`` is rebuilt
    from block ``b`` of each rank's slice, so q|k|v comes back as q|k|v."""
    if parts == 1:
        return torch.cat(shards, dim)
    per_rank = [s.chunk(parts, dim) for s in shards]
    return torch.cat([per_rank[r][b] for b in range(parts) for r in range(len(shards))], dim)
