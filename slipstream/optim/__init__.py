"""Optimizers (Lamb, Lion) and DeepSpeed's lr schedules, plus builders from config names.

``build_optimizer`` / ``build_scheduler`` turn a DeepSpeed ``optimizer`` / ``scheduler`` block
into objects; ``optimizer_defaults`` gives the values ``"auto"`` resolves to.
"""

from slipstream.optim.builder import build_optimizer, build_scheduler, optimizer_defaults
from slipstream.optim.lamb import Lamb
from slipstream.optim.lion import Lion
from slipstream.optim.schedules import (
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
)

__all__ = [
    "LRRangeTest",
    "Lamb",
    "Lion",
    "OneCycle",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "build_optimizer",
    "build_scheduler",
    "optimizer_defaults",
]
