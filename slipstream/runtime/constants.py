"""``deepspeed.runtime.constants``: the config key names and defaults code compares against."""

from __future__ import annotations

from slipstream.config.schema import GRADIENT_CLIPPING_DEFAULT

__all__ = [
    "GRADIENT_ACCUMULATION_STEPS",
    "GRADIENT_CLIPPING",
    "GRADIENT_CLIPPING_DEFAULT",
    "ROUTE_EVAL",
    "ROUTE_PREDICT",
    "ROUTE_TRAIN",
    "TRAIN_BATCH_SIZE",
    "TRAIN_MICRO_BATCH_SIZE_PER_GPU",
    "ZERO_OPTIMIZATION",
]

TRAIN_BATCH_SIZE = "train_batch_size"
TRAIN_MICRO_BATCH_SIZE_PER_GPU = "train_micro_batch_size_per_gpu"
GRADIENT_ACCUMULATION_STEPS = "gradient_accumulation_steps"
GRADIENT_CLIPPING = "gradient_clipping"
ZERO_OPTIMIZATION = "zero_optimization"
ROUTE_TRAIN = "train"
ROUTE_EVAL = "eval"
ROUTE_PREDICT = "predict"
