"""``deepspeed.runtime.fp16.fused_optimizer``: ``FP16_Optimizer``, refused with the way to get it.

DeepSpeed wraps an optimizer in ``FP16_Optimizer`` to keep fp32 master weights of fp16 parameters
and scale the loss. slipstream's engine does both itself for every ZeRO stage when the
config has ``"fp16": {"enabled": true}``: pass the plain optimizer to ``initialize``.
The class exists so that ``isinstance`` checks and imports keep working.
"""

from __future__ import annotations

from typing import Any

__all__ = ["FP16_Optimizer"]


class FP16_Optimizer:
    """Refused at construction (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            "FP16_Optimizer is not built by slipstream: its engine keeps fp32 master weights and the "
            'loss scale itself. Set "fp16": {"enabled": true} in the config and pass the plain '
            "optimizer to deepspeed.initialize"
        )
