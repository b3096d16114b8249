"""``deepspeed.runtime.zero.offload_config``: the offload block and its device names."""

from __future__ import annotations

from enum import Enum

from slipstream.config.zero import OffloadConfig

__all__ = [
    "DeepSpeedZeroOffloadOptimizerConfig",
    "DeepSpeedZeroOffloadParamConfig",
    "OffloadDeviceEnum",
]

DeepSpeedZeroOffloadParamConfig = OffloadConfig
DeepSpeedZeroOffloadOptimizerConfig = OffloadConfig


class OffloadDeviceEnum(str, Enum):
    """``offload_*.device`` values."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"
