"""Reading the ``compression_training`` block (``deepspeed.compression.config``)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from slipstream.config._base import validate_model
from slipstream.config.compression import CompressionConfig
from slipstream.config.loader import load_config
from slipstream.config.schema import SlipstreamConfig

__all__ = ["CompressionConfig", "get_compression_config"]


def get_compression_config(
    config: Mapping[str, Any] | str | os.PathLike[str] | SlipstreamConfig | CompressionConfig,
) -> CompressionConfig:
    """The typed ``compression_training`` block of a DeepSpeed config (a dict, a JSON/HJSON
    path, a parsed ``SlipstreamConfig``, or the block itself); absent means all off.

    Raises:
        ConfigError: an unknown key (with a did-you-mean), a bad value, or a technique
            slipstream refuses (named, with the reason).
    """
    if isinstance(config, CompressionConfig):
        return config
    if isinstance(config, SlipstreamConfig):
        return config.compression_training
    raw = load_config(config).get("compression_training") or {}
    return validate_model(CompressionConfig, raw, "compression_training")  # type: ignore[no-any-return]
