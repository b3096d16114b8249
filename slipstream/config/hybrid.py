"""``hybrid_engine``: DeepSpeed-Chat's actor that switches between ZeRO training and
KV-cache generation (DeepSpeed key names and defaults; used by ``slipstream.rlhf``)."""

from __future__ import annotations

from pydantic import Field

from slipstream.config._base import StrictModel
from slipstream.config._errors import ConfigError

__all__ = ["HybridEngineConfig", "check_hybrid_engine_config"]


class HybridEngineConfig(StrictModel):
    """``hybrid_engine``: ``engine.generate`` gathers ZeRO-3 parameters once per call and
    decodes through slipstream's inference path (docs/rlhf.md)."""

    enabled: bool = False
    """Turn the hybrid engine on (``engine.generate`` and ``engine.module.generate``)."""
    max_out_tokens: int = Field(512, ge=1)
    """Most tokens (prompt plus generated) one ``generate`` call may reach; a longer request
    is refused before any work."""
    inference_tp_size: int = Field(1, ge=1)
    """Tensor-parallel size of generation. Only 1 is implemented (every rank generates its
    own prompts with the whole gathered model)."""
    release_inference_cache: bool = False
    """Free the KV cache after each ``generate``. slipstream's cache lives only inside one
    call, so it is always released; both values behave the same."""
    pin_parameters: bool = True
    """True: gather every ZeRO-3 parameter once per ``generate`` and keep it for all tokens.
    False: gather each layer when it runs and free it after (per layer, per token), which
    needs one layer's memory instead of the model's, at many more all-gathers."""
    tp_gather_partition_size: int = Field(8, ge=1)
    """Layers gathered at a time when re-sharding to ``inference_tp_size`` > 1; has no effect
    at ``inference_tp_size`` 1."""


def check_hybrid_engine_config(block: HybridEngineConfig) -> None:
    """Refuse the hybrid-engine options slipstream does not implement (never ignored)."""
    if block.enabled and block.inference_tp_size > 1:
        raise ConfigError(
            f"config key 'hybrid_engine.inference_tp_size' = {block.inference_tp_size} is not "
            "supported: slipstream's hybrid engine generates with the whole model gathered on "
            "every rank (no tensor-parallel re-sharding for generation yet); set "
            "inference_tp_size to 1"
        )
