"""The dataloader ``initialize`` builds from ``training_data``: one shard per data-parallel rank."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils.data import DataLoader, Dataset, DistributedSampler

__all__ = ["build_dataloader"]


def build_dataloader(
    dataset: Dataset[Any],
    micro_batch: int,
    dp_world_size: int,
    dp_rank: int,
    *,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    drop_last: bool = False,
    seed: int = 0,
    shuffle: bool = True,
) -> DataLoader[Any]:
    """A DataLoader yielding micro-batches of this rank's shard of ``dataset``.

    Call ``loader.sampler.set_epoch(epoch)`` each epoch for a new shuffle order.
    """
    sampler: DistributedSampler[Any] = DistributedSampler(
        dataset,
        num_replicas=dp_world_size,
        rank=dp_rank,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
    )
    return DataLoader(
        dataset, batch_size=micro_batch, sampler=sampler, collate_fn=collate_fn, drop_last=drop_last
    )
