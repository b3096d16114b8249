"""``deepspeed.accelerator``: ``get_accelerator()``, the one device helper of slipstream.

Scripts written for DeepSpeed ask ``get_accelerator()`` for device names, the communication
backend, memory counters and RNG seeding instead of hard-coding ``cuda``. slipstream's own code
uses the same object for the same questions. It sits on floor 1: it imports only torch and
floor 0, so every other unit may use it.
"""

from slipstream.accelerator.real_accelerator import (
    get_accelerator,
    is_current_accelerator_supported,
    set_accelerator,
)
from slipstream.accelerator.torch_accelerator import TorchAccelerator, host_rss_bytes

DeepSpeedAccelerator = TorchAccelerator

__all__ = [
    "DeepSpeedAccelerator",
    "TorchAccelerator",
    "get_accelerator",
    "host_rss_bytes",
    "is_current_accelerator_supported",
    "set_accelerator",
]
