"""The dataloader ``initialize`` builds from ``training_data``: one shard per data-parallel rank.

It can resume mid-epoch: ``state_dict()`` records the epoch and how many micro-batches of it
were yielded, and ``load_state_dict`` makes the next iteration skip exactly those (without
loading them), so a restored run sees the same batches as an uninterrupted one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

__all__ = ["RepeatingLoader", "ResumableDataLoader", "build_dataloader"]


class _SkippingSampler(DistributedSampler):  # type: ignore[type-arg]
    """A ``DistributedSampler`` whose next pass starts ``skip`` indices in."""

    skip = 0

    def __iter__(self) -> Iterator[Any]:
        indices = list(super().__iter__())
        skip, self.skip = self.skip, 0
        return iter(indices[skip:])


class ResumableDataLoader:
    """Micro-batches of this rank's shard of a dataset; resumable at any batch.

    Iterate it like a ``DataLoader``; call ``loader.sampler.set_epoch(epoch)`` (or
    ``loader.set_epoch``) each epoch for a new shuffle order.
    """

    def __init__(self, loader: DataLoader[Any], sampler: _SkippingSampler, micro_batch: int):
        self.loader = loader
        self.sampler = sampler
        self.micro_batch = micro_batch
        self.batches = 0  # yielded in the current pass
        self._resume = 0
        self._resume_epoch: int | None = None

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        resume = self._resume if self._resume_epoch == self.sampler.epoch else 0
        self._resume, self._resume_epoch = 0, None
        self.batches = resume
        self.sampler.skip = resume * self.micro_batch
        if resume:
            # A resumed epoch: its seed was drawn when it began, before the checkpoint whose
            # RNG state was restored; draw none again.
            state = torch.get_rng_state()
            batches = iter(self.loader)
            torch.set_rng_state(state)
        else:
            batches = iter(self.loader)
        for batch in batches:
            self.batches += 1
            yield batch
        self.batches = 0  # a finished pass: iterating again starts the epoch over

    def state_dict(self) -> dict[str, int]:
        pending = self._resume_epoch is not None  # loaded, not iterated yet
        return {
            "epoch": self._resume_epoch if pending else self.sampler.epoch,  # type: ignore[dict-item]
            "batches": self._resume if pending else self.batches,
            "micro_batch": self.micro_batch,
            "replicas": self.sampler.num_replicas,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume where ``state`` was taken. Saved at another data-parallel size or micro-batch
        size, it skips the same number of samples of the epoch (the global batches coincide
        when the global batch size is the same)."""
        self.sampler.set_epoch(state["epoch"])
        consumed = state["batches"] * state["micro_batch"] * state["replicas"]
        per_step = self.micro_batch * self.sampler.num_replicas
        self._resume, self._resume_epoch = consumed // per_step, state["epoch"]


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
) -> ResumableDataLoader:
    """A resumable loader yielding micro-batches of this rank's shard of ``dataset``."""
    sampler = _SkippingSampler(
        dataset,
        num_replicas=dp_world_size,
        rank=dp_rank,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
    )
    # No generator of its own, as DeepSpeed's loader: each pass draws its worker base seed
    # from the global RNG when its first batch is fetched. Dropout masks and MoE gate noise
    # after that point then follow DeepSpeed's on the same seed.
    loader = DataLoader(
        dataset,
        batch_size=micro_batch,
        sampler=sampler,
        collate_fn=collate_fn,
        drop_last=drop_last,
    )
    return ResumableDataLoader(loader, sampler, micro_batch)


class RepeatingLoader:
    """Iterate ``loader`` forever (DeepSpeed's ``deepspeed.utils.RepeatingLoader``): when a
    pass ends the next one starts, with the next epoch's shuffle order when ``loader`` has
    ``set_epoch`` (DeepSpeed's repeats the same order). The next epoch follows the loader's
    own (``loader.sampler.epoch``), so a loader that ``load_checkpoint`` put back in epoch 5
    goes on with epoch 6, not 1."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.epoch = 0
        self._it = iter(loader)

    def __iter__(self) -> RepeatingLoader:
        return self

    def __next__(self) -> Any:
        try:
            return next(self._it)
        except StopIteration:
            current = getattr(getattr(self.loader, "sampler", None), "epoch", None)
            self.epoch = (current if isinstance(current, int) else self.epoch) + 1
            if hasattr(self.loader, "set_epoch"):
                self.loader.set_epoch(self.epoch)
            self._it = iter(self.loader)
            try:
                return next(self._it)
            except StopIteration:
                raise ValueError("RepeatingLoader: the loader yields no batches") from None
