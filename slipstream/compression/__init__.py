"""DeepSpeed's compression library (``deepspeed.compression``): quantization-aware training,
layer reduction and pruning, driven by the ``compression_training`` config block.

``compress.init_compression`` prepares a model, the engine turns each technique on at its
``schedule_offset``, ``compress.redundancy_clean`` bakes the result into the weights
(docs/compression.md). ``helper`` holds the module-tree utilities that DeepSpeed-Chat and
other scripts import (``recursive_getattr``, ``recursive_setattr``).
"""

from slipstream.compression import engine as _engine  # noqa: F401  (registers the extension)
from slipstream.compression.compress import init_compression, redundancy_clean
from slipstream.compression.scheduler import CompressionScheduler, compression_scheduler

__all__ = [
    "CompressionScheduler",
    "compression_scheduler",
    "init_compression",
    "redundancy_clean",
]
