"""The sequence-parallel modules a model's plan swaps in for its single-device parts.

A model that runs on one device computes attention over its whole sequence, starts its
positions at 0 and averages its loss over its tokens. Under sequence parallelism each rank
holds one segment of every sequence, so three parts change, and each of these modules holds
the group it needs (the model never does):

- :class:`SequenceParallelAttention`: attention of the segment's queries over the whole
  sharded sequence (Ulysses all-to-all or LSS all-gathered K/V);
- :class:`ShardedSequence`: where the segment sits in the sequence (RoPE positions, length
  checks);
- :class:`SequenceParallelOutput`: the global mean loss of the sharded batch.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.distributed import comm
from slipstream.sequence._autograd import all_reduce_scalar
from slipstream.sequence.loss import sequence_parallel_cross_entropy
from slipstream.sequence.lss import lss_attention
from slipstream.sequence.ring import ring_attention_heads_first, sequence_shard_indices
from slipstream.sequence.ulysses import ulysses_attention

__all__ = [
    "SequenceParallelAttention",
    "SequenceParallelOutput",
    "ShardedSequence",
    "ZigZagSequence",
]

Method = Literal["ulysses", "lss", "ring"]


class SequenceParallelAttention(nn.Module):
    """Causal attention of this rank's segment over the sequence sharded on ``sp_group``.

    The drop-in for a model's local attention core: ``forward(q, k, v)`` takes this rank's
    rotated queries ``[B, H, T/P, D]`` and keys/values ``[B, kv, T/P, D]`` and returns
    ``[B, T/P, H, D]``. ``method``: "ulysses" (all-to-all over heads, which must divide by the
    group size) or "lss" (all-gathered K/V, no head constraint). ``dropout``: on the attention
    probabilities while training.
    """

    def __init__(self, method: Method, sp_group: comm.Group, dropout: float = 0.0) -> None:
        super().__init__()
        if method == "ring" and dropout:
            raise ValueError(
                f"ring attention has no attention dropout, but dropout={dropout}: build the "
                "model with dropout 0 or use sequence-parallel attention 'ulysses' or 'lss'"
            )
        self.method, self.sp_group, self.dropout = method, sp_group, dropout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.method == "ring":
            return ring_attention_heads_first(q, k, v, self.sp_group).transpose(1, 2)
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        dropout = self.dropout if self.training else 0.0
        if self.method == "lss":
            return lss_attention(q, k, v, self.sp_group, dropout_p=dropout)
        return ulysses_attention(q, k, v, self.sp_group, dropout_p=dropout)

    def extra_repr(self) -> str:
        return f"{self.method}, sp={comm.get_world_size(self.sp_group)}"


class ShardedSequence(nn.Module):
    """Where this rank's segment sits: segment r of P, each as long as the local input."""

    def __init__(self, sp_group: comm.Group) -> None:
        super().__init__()
        self.sp_group = sp_group

    def span(self, length: int) -> tuple[int, int]:
        """``(start, total)``: the segment's first position and the full sequence length,
        for a local input of ``length`` tokens."""
        world = comm.get_world_size(self.sp_group)
        start = comm.get_rank(self.sp_group) * length if world > 1 else 0
        return start, length * world


class ZigZagSequence(ShardedSequence):
    """Where this rank's tokens sit under ring attention: chunks ``r`` and ``2P-1-r`` of
    ``2P`` (:func:`~slipstream.sequence.ring.sequence_shard_indices`)."""

    def span(self, length: int) -> tuple[int, int]:
        return 0, length * comm.get_world_size(self.sp_group)

    def indices(self, length: int, device: torch.device) -> torch.Tensor:
        """The global positions of this rank's ``length`` local tokens."""
        world = comm.get_world_size(self.sp_group)
        rank = comm.get_rank(self.sp_group)
        return sequence_shard_indices(length * world, world, rank, device=device)


class SequenceParallelOutput(nn.Module):
    """A language model's output step on a sequence segment.

    ``forward(logits, labels)``: the segment's logits when ``labels`` is None, else the mean
    token cross-entropy over the *whole* sequences (:func:`sequence_parallel_cross_entropy`;
    a plain fp32 cross-entropy when the group has one rank).

    ``local``: the output step the model had before (tensor parallelism's vocabulary-parallel
    one, whose logits are a slice of the vocabulary), or None for full-vocabulary logits. It
    must return the logits given no labels, else the mean loss over the segment's counted
    tokens; that mean times the segment's count is summed over the group and divided by the
    global count, the same global token mean.
    """

    def __init__(self, sp_group: comm.Group, local: nn.Module | None = None) -> None:
        super().__init__()
        self.sp_group = sp_group
        self.local = local

    def forward(self, logits: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if self.local is not None:
            return self._around_local(self.local, logits, labels)
        if labels is None:
            return logits
        if comm.get_world_size(self.sp_group) > 1:
            return sequence_parallel_cross_entropy(logits, labels, self.sp_group)
        return F.cross_entropy(
            logits.float().view(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100
        )

    def _around_local(
        self, local: nn.Module, logits: torch.Tensor, labels: torch.Tensor | None
    ) -> torch.Tensor:
        out: torch.Tensor = local(logits, labels)
        if labels is None or comm.get_world_size(self.sp_group) == 1:
            return out
        count = (labels != -100).sum().to(torch.float32)
        total = count.clone()
        comm.all_reduce(total, group=self.sp_group, label="sp.token_count")
        return all_reduce_scalar(out.float() * count, self.sp_group) / total.clamp(min=1)
