"""DeepSpeed4Science: memory-efficient Evoformer attention and long-sequence genome LMs.

Public API::

    from slipstream.science import (
        evoformer_attention, evoformer_attention_reference,   # DS4Sci_EvoformerAttention
        DS4Sci_EvoformerAttention,                            # the same, DeepSpeed's name
    )
"""

from slipstream.science.attention import (
    evoformer_attention,
    evoformer_attention_reference,
)

DS4Sci_EvoformerAttention = evoformer_attention
"""DeepSpeed's name for :func:`evoformer_attention` (same arguments and result)."""

__all__ = [
    "DS4Sci_EvoformerAttention",
    "evoformer_attention",
    "evoformer_attention_reference",
]
