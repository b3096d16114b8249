"""Sequence parallelism: DeepSpeed-Ulysses all-to-all attention and LSS Transformer attention.

* :class:`DistributedAttention` / :func:`ulysses_attention`: head-sharded exact attention
  via all-to-alls (needs heads divisible by the sp size; constant volume per rank as S and
  P grow together).
* :func:`lss_attention`: segment-local queries against all-gathered K/V (one fused
  collective each way per layer, no head constraint, K/V of the whole sequence in memory).
* :func:`sequence_parallel_cross_entropy`: the global mean loss from sequence shards.
* :class:`SequenceShardCollate` / :func:`shard_sequence`: each sp rank's slice of a batch.
* :func:`install_hf_ulysses_` / :func:`shard_causal_lm_batch`: Ulysses for Hugging Face causal
  LMs through transformers' attention registry, and the matching batch shard (labels shifted
  on the full sequence, global position ids).
* :func:`ring_attention` / :func:`usp_attention`: ring attention (context parallelism) with a
  zig-zag load-balanced split, alone or inside Ulysses (USP); any head count; packed
  documents; :func:`install_hf_ring_` / :func:`shard_causal_lm_batch_ring` for Hugging Face
  causal LMs (``sequence_parallel_mode: "ring"``).
* :func:`parallelize_sequence_`: apply a model's sequence-parallel plan (:class:`SPPlan`, which
  swaps in :class:`SequenceParallelAttention`, :class:`ShardedSequence` and
  :class:`SequenceParallelOutput`) or bind its ``DistributedAttention`` modules to a group
  (``slipstream.initialize`` does this when ``sequence_parallel_size > 1``).
"""

from slipstream.sequence.data import SequenceShardCollate, shard_sequence
from slipstream.sequence.hf import install_hf_ulysses_, shard_causal_lm_batch
from slipstream.sequence.loss import sequence_parallel_cross_entropy
from slipstream.sequence.lss import double_average_gradients_, lss_attention
from slipstream.sequence.modules import (
    SequenceParallelAttention,
    SequenceParallelOutput,
    ShardedSequence,
    ZigZagSequence,
)
from slipstream.sequence.plan import SPPlan, parallelize_sequence_
from slipstream.sequence.ring import (
    doc_starts,
    ring_attention,
    sequence_shard_indices,
    shard_batch_zigzag,
    shard_sequence_zigzag,
    unshard_sequence_zigzag,
    usp_attention,
)
from slipstream.sequence.ring_hf import install_hf_ring_, shard_causal_lm_batch_ring
from slipstream.sequence.ulysses import (
    DistributedAttention,
    check_heads,
    sdpa_attention,
    ulysses_attention,
)

__all__ = [
    "DistributedAttention",
    "SPPlan",
    "SequenceParallelAttention",
    "SequenceParallelOutput",
    "SequenceShardCollate",
    "ShardedSequence",
    "ZigZagSequence",
    "check_heads",
    "doc_starts",
    "double_average_gradients_",
    "install_hf_ring_",
    "install_hf_ulysses_",
    "lss_attention",
    "parallelize_sequence_",
    "ring_attention",
    "sdpa_attention",
    "sequence_parallel_cross_entropy",
    "sequence_shard_indices",
    "shard_batch_zigzag",
    "shard_causal_lm_batch",
    "shard_causal_lm_batch_ring",
    "shard_sequence",
    "shard_sequence_zigzag",
    "ulysses_attention",
    "unshard_sequence_zigzag",
    "usp_attention",
]
