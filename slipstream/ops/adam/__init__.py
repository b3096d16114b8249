"""``deepspeed.ops.adam``: ``FusedAdam`` and ``DeepSpeedCPUAdam`` as torch's fused Adam(W)."""

from slipstream.ops.adam.cpu_adam import DeepSpeedCPUAdam
from slipstream.ops.adam.fused_adam import FusedAdam

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]
