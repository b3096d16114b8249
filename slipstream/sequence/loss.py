"""Sequence-parallel cross-entropy: the global mean loss of a batch sharded along the sequence."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from slipstream.distributed import comm
from slipstream.sequence._autograd import all_reduce_scalar

__all__ = ["sequence_parallel_cross_entropy"]


def sequence_parallel_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    sp_group: comm.Group,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Mean token cross-entropy over the *whole* sequences, from sequence shards.

    Each rank holds ``logits [B, S/P, V]`` and ``labels [B, S/P]`` of its segment. The loss is
    (sum of all ranks' token losses) / (global count of non-ignored tokens), the same value
    on every rank and equal to the single-process ``F.cross_entropy`` of the unsharded batch.

    Gradients: the group sum is differentiable with a summing backward, so each rank's
    gradients are P times its share; the sum over the P ranks is P times the full gradient
    and the average over them (what ZeRO's reduction over the dp x sp group computes) is
    exactly the full gradient. Computed in fp32.

    Communication: two scalar all-reduces forward (token count, loss) and one backward.
    """
    flat_labels = labels.reshape(-1)
    token_sum = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]),
        flat_labels,
        ignore_index=ignore_index,
        reduction="sum",
    )
    count = (flat_labels != ignore_index).sum().to(token_sum.dtype)
    if comm.get_world_size(sp_group) > 1:
        comm.all_reduce(count, group=sp_group, label="sp.token_count")
    return all_reduce_scalar(token_sum, sp_group) / count.clamp(min=1)
