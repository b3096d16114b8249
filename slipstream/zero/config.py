"""``deepspeed.runtime.zero.config``: the ``zero_optimization`` block under DeepSpeed's names.

``DeepSpeedZeroConfig(**block)`` is slipstream's typed ``ZeroConfig`` read the way DeepSpeed
reads the block: the deprecated keys (``cpu_offload``, ``cpu_offload_param``,
``stage3_gather_fp16_weights_on_model_save``) and the stage-3 keys with or without their
``stage3_`` prefix are accepted, the short names are attributes too
(``config.prefetch_bucket_size``), and an absent ``overlap_comm`` takes DeepSpeed's default
(true at stage 3 only). Unknown keys are errors, as everywhere in slipstream.
"""

from __future__ import annotations

from typing import Any

from pydantic import model_validator

from slipstream.config.loader import normalize_zero_block
from slipstream.config.zero import OffloadConfig, ZeroConfig

__all__ = [
    "DeepSpeedZeroConfig",
    "DeepSpeedZeroOffloadOptimizerConfig",
    "DeepSpeedZeroOffloadParamConfig",
    "ZeroStageEnum",
]

DeepSpeedZeroOffloadParamConfig = OffloadConfig
DeepSpeedZeroOffloadOptimizerConfig = OffloadConfig


class ZeroStageEnum(int):
    """DeepSpeed's stage names: ``ZeroStageEnum.weights == 3``."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


class DeepSpeedZeroConfig(ZeroConfig):
    """The ``zero_optimization`` block, built from DeepSpeed's keyword names."""

    @model_validator(mode="before")
    @classmethod
    def _deepspeed_names(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        block = normalize_zero_block(data)
        if block.get("overlap_comm") is None:
            block["overlap_comm"] = block.get("stage", 0) == 3
        return block

    @property
    def prefetch_bucket_size(self) -> int:
        return self.stage3_prefetch_bucket_size

    @property
    def param_persistence_threshold(self) -> int:
        return self.stage3_param_persistence_threshold

    @property
    def model_persistence_threshold(self) -> int:
        return self.stage3_model_persistence_threshold

    @property
    def max_live_parameters(self) -> int:
        return self.stage3_max_live_parameters

    @property
    def max_reuse_distance(self) -> int:
        return self.stage3_max_reuse_distance

    @property
    def gather_16bit_weights_on_model_save(self) -> bool:
        return self.stage3_gather_16bit_weights_on_model_save

    @property
    def module_granularity_threshold(self) -> int:
        return self.stage3_module_granularity_threshold

    @property
    def pipeline_loading_checkpoint(self) -> bool:
        """DeepSpeed's pipeline checkpoint-loading switch: slipstream has none (false)."""
        return False
