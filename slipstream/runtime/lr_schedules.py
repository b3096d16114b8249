"""``deepspeed.runtime.lr_schedules``: the schedulers of ``slipstream.optim.schedules`` under
DeepSpeed's module path, with DeepSpeed's schedule and parameter names."""

from __future__ import annotations

from slipstream.optim.schedules import (
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
)

__all__ = [
    "LR_RANGE_TEST",
    "ONE_CYCLE",
    "VALID_LR_SCHEDULES",
    "WARMUP_COSINE_LR",
    "WARMUP_DECAY_LR",
    "WARMUP_LINEAR_RATE",
    "WARMUP_LOG_RATE",
    "WARMUP_LR",
    "LRRangeTest",
    "OneCycle",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
]

LR_RANGE_TEST = "LRRangeTest"
ONE_CYCLE = "OneCycle"
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]
"""The ``scheduler.type`` names DeepSpeed builds itself (torch's schedulers also work)."""

WARMUP_LOG_RATE = "log"
WARMUP_LINEAR_RATE = "linear"
"""Values of ``warmup_type``."""
