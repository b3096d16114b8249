"""DeepSpeed4Science: memory-efficient Evoformer attention and long-sequence genome LMs.

Public API::

    from slipstream.science import (
        evoformer_attention, evoformer_attention_reference,   # DS4Sci_EvoformerAttention
        DS4Sci_EvoformerAttention,                            # the same, DeepSpeed's name
        MSARowAttentionWithPairBias, MSAColumnAttention,      # Evoformer modules
        TriangleAttentionStartingNode, TriangleAttentionEndingNode,
        synthetic_genomes,                                    # ACGT with planted motifs
    )
"""

from slipstream.science.attention import (
    evoformer_attention,
    evoformer_attention_reference,
)
from slipstream.science.evoformer import (
    GatedAttention,
    MSAColumnAttention,
    MSARowAttentionWithPairBias,
    TriangleAttention,
    TriangleAttentionEndingNode,
    TriangleAttentionStartingNode,
    mask_to_bias,
)
from slipstream.science.genome import NUCLEOTIDES, GenomeBatch, decode, encode, synthetic_genomes

DS4Sci_EvoformerAttention = evoformer_attention
"""DeepSpeed's name for :func:`evoformer_attention` (same arguments and result)."""

__all__ = [
    "NUCLEOTIDES",
    "DS4Sci_EvoformerAttention",
    "GatedAttention",
    "GenomeBatch",
    "MSAColumnAttention",
    "MSARowAttentionWithPairBias",
    "TriangleAttention",
    "TriangleAttentionEndingNode",
    "TriangleAttentionStartingNode",
    "decode",
    "encode",
    "evoformer_attention",
    "evoformer_attention_reference",
    "mask_to_bias",
    "synthetic_genomes",
]
