"""``deepspeed.runtime.zero.stage_1_and_2``: ``DeepSpeedZeroOptimizer``, the name of the
stage-1/2 optimizer, for ``isinstance`` checks (see ``slipstream.zero._deepspeed_classes``)."""

from slipstream.zero._deepspeed_classes import DeepSpeedZeroOptimizer

__all__ = ["DeepSpeedZeroOptimizer"]
