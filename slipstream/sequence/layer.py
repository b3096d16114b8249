"""DeepSpeed's module path ``deepspeed.sequence.layer``: re-exports :class:`DistributedAttention`."""

from slipstream.sequence.ulysses import DistributedAttention

__all__ = ["DistributedAttention"]
