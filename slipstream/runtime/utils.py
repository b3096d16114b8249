"""``deepspeed.runtime.utils``: the helpers training scripts import from it."""

from __future__ import annotations

import gc
import random

import torch

from slipstream._logging import log_rank0
from slipstream.accelerator import get_accelerator
from slipstream.parallel.pipeline.module import partition_balanced, partition_uniform

__all__ = ["see_memory_usage", "set_random_seed"]
__all__ += ["partition_balanced", "partition_uniform"]  # DeepSpeed's pipeline cut rules

_GIB = 1024**3


def set_random_seed(seed: int) -> None:
    """Seed Python's ``random``, NumPy's global generator (when installed) and torch.

    As DeepSpeed's: NumPy takes ``seed mod 2**32`` and torch ``seed mod 2**63``, the widths
    each accepts, so any Python int works.
    """
    random.seed(seed)
    try:
        import numpy
    except ImportError:
        pass
    else:
        numpy.random.seed(seed % 2**32)
    torch.manual_seed(seed % 2**63)


def see_memory_usage(message: str, force: bool = False) -> None:
    """Log ``message`` and the memory counters on rank 0, then reset the peaks.

    As DeepSpeed's, it does nothing unless ``force`` is true. The line holds the accelerator's
    allocated and peak-allocated memory, its reserved (cached) and peak-reserved memory, and
    the host's used memory. DeepSpeed prints to stdout; slipstream logs (rank 0, INFO).
    """
    if not force:
        return
    gc.collect()  # freed-but-uncollected tensors would inflate the numbers
    acc = get_accelerator()
    used = acc.total_memory() - acc.available_memory() if acc.device_name() == "cpu" else None
    host = f" | CPU used {used / _GIB:.2f} GB" if used is not None else ""
    log_rank0(
        "%s | MA %.2f GB Max_MA %.2f GB CA %.2f GB Max_CA %.2f GB%s",
        message,
        acc.memory_allocated() / _GIB,
        acc.max_memory_allocated() / _GIB,
        acc.memory_reserved() / _GIB,
        acc.max_memory_reserved() / _GIB,
        host,
    )
    acc.reset_peak_memory_stats()
