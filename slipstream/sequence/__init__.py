"""Sequence parallelism: DeepSpeed-Ulysses all-to-all attention and LSS Transformer attention.

* :class:`DistributedAttention` / :func:`ulysses_attention`: head-sharded exact attention
  via all-to-alls (needs heads divisible by the sp size; constant volume per rank as S and
  P grow together).
* :func:`lss_attention`: segment-local queries against all-gathered K/V (one fused
  collective each way per layer, no head constraint, K/V of the whole sequence in memory).
* :func:`sequence_parallel_cross_entropy`: the global mean loss from sequence shards.
* :class:`SequenceShardCollate` / :func:`shard_sequence`: each sp rank's slice of a batch.
* :func:`parallelize_sequence_`: bind a model's sequence-parallel attention to a group
  (``slipstream.initialize`` does this when ``sequence_parallel_size > 1``).
"""

from __future__ import annotations

from torch import nn

from slipstream.distributed import comm
from slipstream.sequence.data import SequenceShardCollate, shard_sequence
from slipstream.sequence.loss import sequence_parallel_cross_entropy
from slipstream.sequence.lss import double_average_gradients_, lss_attention
from slipstream.sequence.ulysses import (
    DistributedAttention,
    check_heads,
    sdpa_attention,
    ulysses_attention,
)

__all__ = [
    "DistributedAttention",
    "SequenceShardCollate",
    "check_heads",
    "double_average_gradients_",
    "lss_attention",
    "parallelize_sequence_",
    "sdpa_attention",
    "sequence_parallel_cross_entropy",
    "shard_sequence",
    "ulysses_attention",
]


def parallelize_sequence_(model: nn.Module, sp_group: comm.Group) -> nn.Module:
    """Bind every submodule that takes a sequence-parallel group to ``sp_group``, in place.

    A module opts in by defining ``set_sequence_parallel_group(group)``
    (:class:`DistributedAttention` and a ``GPT`` built with ``sequence_parallel`` do).

    Raises:
        ValueError: no submodule opts in while the group has more than one rank (the model
            would silently attend within each shard only).
    """
    bound = 0
    for module in model.modules():
        setter = getattr(module, "set_sequence_parallel_group", None)
        if callable(setter):
            setter(sp_group)
            bound += 1
    if bound == 0 and comm.get_world_size(sp_group) > 1:
        raise ValueError(
            f"sequence_parallel_size={comm.get_world_size(sp_group)} but "
            f"{type(model).__name__} has no sequence-parallel attention: build the reference "
            "GPT with GPTConfig(sequence_parallel='ulysses' or 'lss'), or route your attention "
            "through slipstream.sequence.DistributedAttention"
        )
    return model
