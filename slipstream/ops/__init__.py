"""``deepspeed.ops``: DeepSpeed's optimizer classes, on torch's kernels (nothing is compiled)."""

from slipstream.ops import adam

__all__ = ["adam"]
