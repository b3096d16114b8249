"""``hybrid_engine``: DeepSpeed-Chat's actor that switches between ZeRO training and
KV-cache generation (DeepSpeed key names and defaults; used by ``slipstream.rlhf``)."""

from __future__ import annotations

from pydantic import Field

from slipstream.config._base import StrictModel

__all__ = ["HybridEngineConfig"]


class HybridEngineConfig(StrictModel):
    """``hybrid_engine``: ``engine.generate`` gathers ZeRO-3 parameters once per call and
    decodes through slipstream's inference path (docs/rlhf.md)."""

    enabled: bool = False
    """Turn the hybrid engine on (``engine.generate`` and ``engine.module.generate``)."""
    max_out_tokens: int = Field(512, ge=1)
    """Most tokens (prompt plus generated) one ``generate`` call may reach; a longer request
    is refused before any work."""
    inference_tp_size: int = Field(1, ge=1)
    """Tensor-parallel size of generation. 1: every rank generates its own prompts with the
    whole gathered model. T > 1: groups of T consecutive ranks build a TP-split copy (each
    rank 1/T of every layer) and generate the group's prompts together; T must divide the
    world size and the model's attention heads."""
    release_inference_cache: bool = False
    """Free the KV cache after each ``generate``. slipstream's cache lives only inside one
    call, so it is always released; both values behave the same."""
    pin_parameters: bool = True
    """True: gather every ZeRO-3 parameter once per ``generate`` and keep it for all tokens.
    False: gather each layer when it runs and free it after (per layer, per token), which
    needs one layer's memory instead of the model's, at many more all-gathers. No effect at
    ``inference_tp_size`` > 1, where each rank keeps 1/T of the weights for the call (built
    ``tp_gather_partition_size`` layers at a time) and nothing is gathered per token."""
    tp_gather_partition_size: int = Field(8, ge=1)
    """Transformer layers gathered at a time while building the TP copy at
    ``inference_tp_size`` > 1 (bounds the extra memory); no effect at ``inference_tp_size``
    1."""
