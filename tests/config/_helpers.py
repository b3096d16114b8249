"""Shared helpers of the config tests: minimal configs, expected-error checks."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from slipstream.config import (
    AutoContext,
    ConfigError,
    parse_config,
)
from slipstream.optim import optimizer_defaults

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "configs"
MB = {"train_micro_batch_size_per_gpu": 2}
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def _cfg(**blocks: Any) -> dict[str, Any]:
    """A minimal valid config (micro batch 2) plus ``blocks``."""
    return {**MB, **blocks}


def _nested(dotted: str, value: Any) -> dict[str, Any]:
    """``"a.b.c", v`` -> ``{"a": {"b": {"c": v}}}``."""
    out: Any = value
    for part in reversed(dotted.split(".")):
        out = {part: out}
    return out


def _full_auto(**kwargs: Any) -> AutoContext:
    """An AutoContext that can resolve everything slipstream resolves."""
    base: dict[str, Any] = {
        "hidden_size": 64,
        "model_dtype": torch.bfloat16,
        "optimizer_defaults": optimizer_defaults,
    }
    return AutoContext(**{**base, **kwargs})


def _error(config: Any, *fragments: str, **kwargs: Any) -> str:
    """Parse ``config`` expecting a ConfigError whose message contains every fragment."""
    with pytest.raises(ConfigError) as info:
        parse_config(config, **kwargs)
    msg = str(info.value)
    for fragment in fragments:
        assert fragment in msg, f"{fragment!r} not in {msg!r}"
    return msg


def _b64(config: dict[str, Any]) -> str:
    return base64.b64encode(json.dumps(config).encode()).decode()
