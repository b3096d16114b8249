"""``deepspeed.runtime.precision_config``: the ``bf16`` and ``fp16`` blocks as typed objects.

``get_bfloat16_config(config_dict)`` reads ``bf16`` (or its old name ``bfloat16``) and
``get_float16_config(config_dict)`` reads ``fp16``, into the same typed blocks the engine
acts on (``slipstream.config``), so unknown keys and wrong types are errors naming the key.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from slipstream.config.precision import BF16Config, FP16Config

__all__ = [
    "BFLOAT16",
    "BFLOAT16_OLD",
    "FP16",
    "DeepSpeedBF16Config",
    "DeepSpeedFP16Config",
    "get_bfloat16_config",
    "get_float16_config",
]

BFLOAT16 = "bf16"
BFLOAT16_OLD = "bfloat16"
FP16 = "fp16"

DeepSpeedBF16Config = BF16Config
DeepSpeedFP16Config = FP16Config


def get_bfloat16_config(param_dict: Mapping[str, Any]) -> BF16Config:
    """The ``bf16`` block (``bfloat16`` when ``bf16`` is absent; defaults when neither)."""
    block = param_dict.get(BFLOAT16)
    if block is None:
        block = param_dict.get(BFLOAT16_OLD, {})
    return BF16Config.model_validate(dict(block))


def get_float16_config(param_dict: Mapping[str, Any]) -> FP16Config:
    """The ``fp16`` block (defaults when absent)."""
    return FP16Config.model_validate(dict(param_dict.get(FP16, {})))
