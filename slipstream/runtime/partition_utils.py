"""DeepSpeed's partitioning helpers of ``deepspeed.runtime.utils``: ``prefix_sum_inc``,
``partition_uniform`` and ``partition_balanced`` under DeepSpeed's signatures, and
``PartitionedTensor`` (a tensor split evenly over a process group, rebuilt with ``full()``).

``partition_uniform``/``partition_balanced`` here answer as DeepSpeed's do, including the
case of fewer items than parts, where DeepSpeed leaves the trailing parts empty. The pipeline
module (``slipstream.parallel.pipeline``) uses the same cut rules but refuses an empty stage
when it partitions a model, since a stage without layers cannot run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from slipstream.accelerator import get_accelerator
from slipstream.distributed import comm
from slipstream.parallel.pipeline import module as _pipeline

__all__ = ["PartitionedTensor", "partition_balanced", "partition_uniform", "prefix_sum_inc"]


def prefix_sum_inc(weights: Sequence[Any]) -> list[Any]:
    """Inclusive prefix sums: ``[3, 4, 5]`` gives ``[3, 7, 12]``."""
    out: list[Any] = []
    for w in weights:
        out.append(w if not out else out[-1] + w)
    return out


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """``num_parts + 1`` boundaries cutting ``num_items`` into near-equal runs, the first
    ``num_items % num_parts`` one longer; with ``num_items <= num_parts`` one item per part
    and the remaining parts empty (DeepSpeed's rule)."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    return _pipeline.partition_uniform(num_items, num_parts)


def partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """Contiguous runs of ``weights`` with the least spread between the heaviest and the
    lightest (ties: the later cut), as DeepSpeed cuts pipeline stages; with no more weights
    than parts, :func:`partition_uniform`'s answer (trailing parts empty)."""
    if len(weights) <= num_parts:
        return partition_uniform(len(weights), num_parts)
    return _pipeline.partition_balanced(weights, num_parts)


class PartitionedTensor:
    """``tensor`` flattened and cut into ``world_size(group)`` near-equal pieces
    (:func:`partition_uniform`); each rank keeps its own piece (``local_data``).

    ``full()`` gathers the pieces back into the original shape on every rank; ``to_meta()``
    encodes the shape and the cut as a ``LongTensor`` so another rank can rebuild the object
    around a piece it received (``from_meta``). Every rank of ``group`` must pass the same
    tensor (DeepSpeed's pipeline engine uses this to send activations partitioned).
    """

    def __init__(self, tensor: torch.Tensor, group: comm.Group, partition_meta: Any = None):
        self.group = group
        self.num_parts = comm.get_world_size(group)
        self.rank = comm.get_rank(group)
        self.orig_size = list(tensor.size())
        self.orig_device = tensor.device
        self.partition = partition_uniform(tensor.numel(), self.num_parts)
        start, stop = self.partition[self.rank], self.partition[self.rank + 1]
        self.local_data = tensor.detach().contiguous().view(-1)[start:stop].clone()
        self.even_split = tensor.numel() % self.num_parts == 0

    @classmethod
    def from_meta(
        cls,
        meta: torch.Tensor,
        local_part: torch.Tensor,
        group: comm.Group,
        device: Any = None,
    ) -> PartitionedTensor:
        """Rebuild from :meth:`to_meta`'s encoding and this rank's piece."""
        if meta.dtype != torch.long:
            raise TypeError(f"PartitionedTensor.from_meta: meta must be int64, got {meta.dtype}")
        values = meta.tolist()
        ndim = values[0]
        obj = cls.__new__(cls)
        obj.group = group
        obj.orig_size = values[1 : 1 + ndim]
        num_parts, rank, *partition = values[1 + ndim :]
        obj.num_parts = comm.get_world_size(group)
        obj.rank = comm.get_rank(group)
        if (num_parts, rank) != (obj.num_parts, obj.rank):
            raise ValueError(
                f"PartitionedTensor.from_meta: the meta was made by rank {rank} of {num_parts}, "
                f"this is rank {obj.rank} of {obj.num_parts} in the group"
            )
        obj.partition = partition
        obj.orig_device = torch.device(
            device if device is not None else get_accelerator().device_name()
        )
        obj.local_data = local_part.detach()
        obj.even_split = math.prod(obj.orig_size) % obj.num_parts == 0
        return obj

    def full(self, device: Any = None) -> torch.Tensor:
        """The whole tensor, in its original shape, on ``device`` (default: where it was)."""
        device = self.orig_device if device is None else device
        numel = math.prod(self.orig_size)
        flat = torch.zeros(numel, dtype=self.local_data.dtype, device=device)
        if self.even_split:
            comm.all_gather_into_tensor(flat, self.local_data.to(device), group=self.group)
        else:
            for part in range(self.num_parts):
                lo, hi = self.partition[part], self.partition[part + 1]
                piece = flat[lo:hi]
                if part == self.rank:
                    piece.copy_(self.local_data)
                comm.broadcast(piece, comm.global_rank(self.group, part), group=self.group)
        return flat.view(self.orig_size).clone()

    def to_meta(self) -> torch.Tensor:
        """``[ndim, *shape, num_parts, rank, *boundaries]`` as a ``LongTensor``."""
        meta = [len(self.orig_size), *self.orig_size, self.num_parts, self.rank, *self.partition]
        return torch.tensor(meta, dtype=torch.long, device=self.orig_device)

    def data(self) -> torch.Tensor:
        return self.local_data

    def local_size(self) -> torch.Size:
        return self.local_data.size()

    def full_size(self) -> list[int]:
        return self.orig_size
