"""``deepspeed.ops.aio``: the async-I/O builder name (slipstream's NVMe offload builds nothing)."""

from slipstream.ops.op_builder import AsyncIOBuilder

__all__ = ["AsyncIOBuilder"]
