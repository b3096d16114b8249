"""Sharding batches along the sequence for the ranks of a sequence-parallel group."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import default_collate

from slipstream.distributed import comm

__all__ = ["SequenceShardCollate", "shard_sequence"]


def shard_sequence(batch: Any, sp_world_size: int, sp_rank: int, seq_dim: int = 1) -> Any:
    """This rank's contiguous slice of every tensor in ``batch`` along ``seq_dim``.

    Tensors with fewer than ``seq_dim + 1`` dims (per-sample scalars) are kept whole; tuples,
    lists and dicts are walked. Rank r gets positions r*S/P .. (r+1)*S/P-1.

    Raises:
        ValueError: a sequence length not divisible by ``sp_world_size`` (names the shape).
    """
    if isinstance(batch, torch.Tensor):
        if batch.dim() <= seq_dim:
            return batch
        length = batch.shape[seq_dim]
        if length % sp_world_size:
            raise ValueError(
                f"sequence parallelism: a batch tensor of shape {tuple(batch.shape)} has "
                f"length {length} along dim {seq_dim}, not divisible by sp={sp_world_size}; "
                "pad or crop sequences to a multiple of the sequence-parallel size"
            )
        return batch.chunk(sp_world_size, dim=seq_dim)[sp_rank]
    if isinstance(batch, dict):
        return {k: shard_sequence(v, sp_world_size, sp_rank, seq_dim) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        items = [shard_sequence(v, sp_world_size, sp_rank, seq_dim) for v in batch]
        return type(batch)(items) if isinstance(batch, list) else tuple(items)
    return batch


class SequenceShardCollate:
    """A collate function: collate as usual, then keep this sp rank's sequence slice.

    Every rank of one sp group reads the same samples (the sampler shards by data-parallel
    rank only), so the slices of the group together form the full batch.

    ``shard``: how a collated batch is split, ``shard(batch, sp_world_size, sp_rank)``;
    default :func:`shard_sequence` along ``seq_dim`` (a causal LM's dict batches use
    :func:`slipstream.sequence.shard_causal_lm_batch`, which shifts labels first).
    """

    def __init__(
        self,
        sp_group: comm.Group,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        seq_dim: int = 1,
        shard: Callable[[Any, int, int], Any] | None = None,
    ) -> None:
        self.sp_world_size = comm.get_world_size(sp_group)
        self.sp_rank = comm.get_rank(sp_group)
        self.collate_fn = collate_fn or default_collate
        self.seq_dim = seq_dim
        self.shard = shard

    def __call__(self, samples: list[Any]) -> Any:
        batch = self.collate_fn(samples)
        if self.shard is not None:
            return self.shard(batch, self.sp_world_size, self.sp_rank)
        return shard_sequence(batch, self.sp_world_size, self.sp_rank, self.seq_dim)
